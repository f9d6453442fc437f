"""Thousands of ranks on one machine (issue 31): the engine, the optimizer, checkpoints and the cluster
tools run as rank ``r`` of ``N`` in a simulated world (:mod:`lightning_zero.comm.simulated`), and
every cost that could grow with ``N`` is measured against it.

    python benchmarks/scale.py [--ranks 64,1024,8192] [--narrow 8] [--steps 9] [--out DIR]
    python benchmarks/scale.py --from-json DIR/scale.json [--out DIR]   # the table and plot again

The model is the recipe's ``llama_1b`` (``conf/model/llama_1b.yaml``: 22 blocks, grouped-query
attention, untied 32,000-token vocabulary) at reduced width: ``d_model``, ``mlp_hidden`` and the
vocabulary divided by ``--narrow`` (default 8: 256, 704, 4,000; 17 M parameters instead of 1.1 B),
the same tensors in the same stage-3 units, and ``bucket_cap_mb`` divided by ``narrow^2`` so that the
bucket plan has about as many buckets as the full model's (the counts are printed). Costs that
depend on the number of tensors, units and buckets are those of ``llama_1b``; those proportional to
its size are 1/64 of them.

Per ``N`` (flat, and hybrid ``N/8 x 8``) and stage (1-3), as simulated rank 0:

  * **setup**: seconds to build ``ShardedAdamW`` (stage 3: on the meta device, initialized unit by
    unit into the shards), and the Python memory it allocated (``tracemalloc``: plan, records, slots,
    hooks; tensors are not Python allocations), beside the sharded state's bytes (tensors);
  * **per step**: elements sent and collectives issued, and the host time of our code: a step's wall
    time minus the same forward and backward on a plain copy of the model (the median of ``--steps``
    after a warm-up; the model's compute is excluded, a simulated collective is a local copy), and
    the number of Python calls into ``lightning_zero`` in a step (``cProfile``; setup's too): the
    same figure without the machine's noise;
  * **checkpoint** (``--tmp``, default ``/dev/shm``): rank 0's save of ``N`` shard files (the others'
    are hard links made when the status gather asks for them: :class:`PeerFiles`), the time of its
    commit (gather, listing and size checks, ``meta.pt``, rename), the size of ``meta.pt``;
  * **resume**: the checkpoint of ``N`` loaded by simulated ranks ``0``, ``M/2`` and ``M-1`` of
    ``M = 3N/4`` and ``2N``: the most shard files a rank reads per bucket, files and bytes it opens;
  * **cluster tools**: ``preflight``'s table (lines) and rank 0's checks for ``N`` ranks on ``N/8``
    hosts, and ``python -m recipes.sbatch`` for ``N/8`` nodes of 8 GPUs.

Figures, not assertions; written to ``--out`` as ``scale.json``, ``scale.png`` and the ``sbatch``
script of the largest ``N``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout, not another install

import torch  # noqa: E402
import yaml  # noqa: E402

import lightning_zero  # noqa: E402
from benchmarks.record import machine  # noqa: E402
from lightning_zero import ShardedAdamW, ZeroConfig  # noqa: E402
from lightning_zero.checkpoint import format as checkpoint_format  # noqa: E402
from lightning_zero.checkpoint.format import META, read_meta, save_sharded  # noqa: E402
from lightning_zero.checkpoint.reshard import ShardFiles, files_per_bucket, load_sharded, preflight  # noqa: E402
from lightning_zero.checkpoint.simulated import PeerFiles  # noqa: E402
from lightning_zero.comm import CommGroups  # noqa: E402
from lightning_zero.engine.deferred_init import DeferredInit, capture_rng, check_deferred  # noqa: E402
from lightning_zero.integrations.preflight_views import RankView, check_views, rank_table  # noqa: E402
from recipes.training.model import GPT  # noqa: E402
from recipes.training.model_config import GPTConfig  # noqa: E402

PER_NODE = 8
SEQ = 8


def model_config(narrow: int) -> GPTConfig:
    """``llama_1b`` (the recipe's file) with its widths and vocabulary divided by ``narrow``."""
    spec = yaml.safe_load((ROOT / "conf/model/llama_1b.yaml").read_text())["model"]
    spec = {k: v for k, v in spec.items() if k != "_target_"}
    for key in ("d_model", "mlp_hidden", "vocab_size"):
        spec[key] //= narrow
    spec["max_seq_len"] = SEQ
    return GPTConfig(**spec)


def _config(stage: int, narrow: int) -> ZeroConfig:
    return ZeroConfig(stage=stage, bucket_cap_mb=25.0 / narrow**2, first_bucket_cap_mb=1.0 / narrow**2)


def build(
    config: GPTConfig, stage: int, narrow: int, groups: CommGroups
) -> tuple[torch.nn.Module, ShardedAdamW, float, int]:
    """``(model, optimizer, setup seconds, Python bytes allocated)`` as the simulated rank of ``groups``."""
    torch.manual_seed(0)
    if stage == 3:
        rng = capture_rng(torch.device("cpu"))
        with torch.device("meta"):
            model = GPT(config)
        check_deferred(model)
        deferred = DeferredInit(torch.device("cpu"), rng)
    else:
        model, deferred = GPT(config), None
    gc.collect()
    tracemalloc.start()
    began = time.perf_counter()
    opt = ShardedAdamW(
        model.parameters(),
        lr=1e-4,
        config=_config(stage, narrow),
        groups=groups,
        module=model if stage == 3 else None,
        deferred_init=deferred,
    )
    seconds = time.perf_counter() - began
    allocated = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return model, opt, seconds, allocated


def _batch(config: GPTConfig) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (1, SEQ + 1), generator=torch.Generator().manual_seed(1))


def _loss(model: torch.nn.Module, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))


def our_calls(fn: Any) -> int:
    """Python function calls into ``lightning_zero`` while ``fn()`` runs (``cProfile``'s count): the
    host work of our code in a figure that, unlike its time, has no noise."""
    profile = cProfile.Profile()
    profile.enable()
    try:
        fn()
    finally:
        profile.disable()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    return sum(
        calls for (file, _, _), (_, calls, *_) in stats.items() if f"{os.sep}lightning_zero{os.sep}" in file
    )


def step_figures(
    config: GPTConfig, model: torch.nn.Module, opt: ShardedAdamW, plain: torch.nn.Module, steps: int
) -> dict[str, float]:
    """Elements and collectives per step, and the host time of our code per step (see the module
    docstring)."""
    tokens = _batch(config)
    engine = opt.engine
    comms = [engine.groups.shard, engine.groups.replicas, engine.groups.world]
    ours, theirs = [], []
    for i in range(steps + 1):
        began = time.perf_counter()  # the plain model and ours alternate: drifts of the machine cancel
        _loss(plain, tokens, config.vocab_size).backward()
        plain.zero_grad(set_to_none=True)
        bare = time.perf_counter() - began
        engine.reset_comm_stats()
        for comm in comms:
            comm.stats.reset()
        began = time.perf_counter()
        _loss(model, tokens, config.vocab_size).backward()
        opt.step()
        opt.zero_grad()
        sharded = time.perf_counter() - began
        if i:  # the first step warms up (allocations, the wire pool)
            ours.append(sharded - bare)
            theirs.append(bare)
    unique = {id(c): c for c in comms}.values()
    figures = {
        "elements_per_step": engine.comm_stats.elements_sent + engine.replica_comm_stats.elements_sent,
        "collectives_per_step": sum(c.stats.collectives for c in unique),
    }

    def one_step() -> None:
        _loss(model, tokens, config.vocab_size).backward()
        opt.step()
        opt.zero_grad()

    return {
        **figures,
        "our_calls_per_step": our_calls(one_step),
        "host_ms_per_step": 1e3 * statistics.median(ours),
        "model_ms_per_step": 1e3 * statistics.median(theirs),
    }


def checkpoint_figures(opt: ShardedAdamW, stage: int, target: Path, peer: PeerFiles) -> dict[str, float]:
    """Rank 0's save into ``target`` (the other ranks' files come from the simulated world's
    :class:`PeerFiles`) and the time of its commit; ``meta.pt``'s size."""
    commit_s: list[float] = []
    agree = checkpoint_format.StagedSave._agree_and_commit  # noqa: SLF001

    def timed(self: Any, *args: Any) -> Any:
        began = time.perf_counter()
        try:
            return agree(self, *args)
        finally:
            commit_s.append(time.perf_counter() - began)

    checkpoint_format.StagedSave._agree_and_commit = timed  # type: ignore[method-assign]  # noqa: SLF001
    try:
        began = time.perf_counter()
        save_sharded(opt.engine, target, {"global_step": 1}, {}, stage)
        total = time.perf_counter() - began
    finally:
        checkpoint_format.StagedSave._agree_and_commit = agree  # type: ignore[method-assign]  # noqa: SLF001
    meta = read_meta(target)  # the commit's time without the simulation's (the other ranks' files made)
    commit_s[0] -= peer.seconds
    shard_files = [n for n in meta["files"] if n.startswith("shard-")]
    return {
        "save_s": total,
        "commit_s": commit_s[0],
        "meta_bytes": (target / META).stat().st_size,
        "shard_files": len(shard_files),
        "shard_file_bytes": meta["files"][shard_files[0]]["size"],
    }


def resume_figures(
    config: GPTConfig, stage: int, narrow: int, path: Path, new_world: int, group: int | None
) -> dict[str, float]:
    """Simulated ranks 0, M/2 and M-1 of ``new_world`` load the checkpoint at ``path``: the most files
    a rank reads for one bucket, and the most files and bytes a rank opens."""
    meta = read_meta(path)
    opened: list[int] = []
    load = ShardFiles.__getitem__

    def counted(self: ShardFiles, rank: int) -> Any:
        if rank not in self._open:  # noqa: SLF001
            opened.append(rank)
        return load(self, rank)

    per_bucket, files, nbytes, seconds = 0, 0, 0, 0.0
    ShardFiles.__getitem__ = counted  # type: ignore[method-assign]
    try:
        for rank in sorted({0, new_world // 2, new_world - 1}):
            _, opt, _, _ = build(config, stage, narrow, CommGroups.simulated(rank, new_world, group))
            needed = files_per_bucket(opt.engine, meta)
            opened.clear()
            began = time.perf_counter()
            preflight(opt.engine, path, meta)
            load_sharded(opt.engine, path, meta)
            seconds = max(seconds, time.perf_counter() - began)
            distinct = set().union(*needed)
            per_bucket = max(per_bucket, max(len(r) for r in needed))
            files = max(files, len(distinct))
            size = meta["files"][checkpoint_format.shard_name(0, int(meta["plan"]["world_size"]))]["size"]
            nbytes = max(nbytes, len(distinct) * size)
            assert set(opened) <= distinct, (sorted(opened), sorted(distinct))
    finally:
        ShardFiles.__getitem__ = load  # type: ignore[method-assign]
    return {"files_per_bucket": per_bucket, "files": files, "file_bytes": nbytes, "load_s": seconds}


def cluster_figures(world: int, out: Path | None) -> dict[str, Any]:
    """``preflight``'s table and checks for ``world`` ranks on ``world/8`` hosts; the sbatch script."""
    nodes = world // PER_NODE
    views = [
        RankView(
            r,
            f"gpu{r // PER_NODE:05d}",
            world,
            r % PER_NODE,
            r // PER_NODE,
            "gpu00000",
            29500,
            PER_NODE,
            nodes,
            "auto",
            torch.__version__,
            lightning_zero.__version__,
        )
        for r in range(world)
    ]
    began = time.perf_counter()
    problems = check_views(views)
    lines = rank_table(views)
    checks_s = time.perf_counter() - began
    overrides = [
        "cluster=slurm",
        f"cluster.nodes={nodes}",
        "cluster.partition=gpu",
        "trainer=gpu",
        "experiment=llama_1b_multinode",
        "data.path=/shared/tok",
    ]
    began = time.perf_counter()
    sbatch = subprocess.run(
        [sys.executable, "-m", "recipes.sbatch", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    sbatch_s = time.perf_counter() - began
    if out is not None:
        (out / f"scale-{world}.sbatch").write_text(sbatch.stdout)
    return {
        "preflight_table_lines": len(lines),
        "preflight_checks_s": checks_s,
        "preflight_problems": len(problems),
        "preflight_table": lines,
        "sbatch_s": sbatch_s,
        "sbatch_nodes_line": next(x for x in sbatch.stdout.splitlines() if x.startswith("#SBATCH --nodes")),
    }


def row(args: argparse.Namespace, world: int, group: int | None, stage: int) -> dict[str, Any]:
    """One row: ``world`` simulated ranks, ``group`` ranks per shard group (``None``: flat), ``stage``."""
    config = model_config(args.narrow)
    torch.manual_seed(0)
    plain = GPT(config)
    build(
        config, stage, args.narrow, CommGroups.simulated(0, world, group)
    )  # one-time costs out of the figures
    tmp = args.tmp / f"lz-scale-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    peer = PeerFiles(tmp / "ckpt", world, PER_NODE, group)
    groups = CommGroups.simulated(0, world, group, peer=peer)
    setup_calls = our_calls(lambda: build(config, stage, args.narrow, CommGroups.simulated(0, world, group)))
    model, opt, setup_s, python_bytes = build(config, stage, args.narrow, groups)
    memory = opt.engine.memory()
    out: dict[str, Any] = {
        "ranks": world,
        "layout": f"1x{world}" if group is None else f"{world // group}x{group}",
        "stage": stage,
        "parameters": sum(p.numel() for p in plain.parameters()),
        "tensors": len(list(plain.parameters())),
        "buckets": len(opt.engine.plan.buckets),
        "units": 0 if opt.engine.units is None else len(opt.engine.units.units),
        "padding": sum(b.padding for b in opt.engine.plan.buckets),
        "setup_s": setup_s,
        "setup_calls": setup_calls,
        "python_mb": python_bytes / 2**20,
        "state_mb": (memory.state_bytes + memory.grad_shard_bytes) / 2**20,
        **step_figures(config, model, opt, plain, args.steps),
    }
    try:
        out.update(checkpoint_figures(opt, stage, tmp / "ckpt", peer))
        for name, new_world in (("3N/4", 3 * world // 4), ("2N", 2 * world)):
            resume = resume_figures(config, stage, args.narrow, tmp / "ckpt", new_world, group)
            out.update({f"resume {name} {k}": v for k, v in resume.items()})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every row, each in a process of its own (a long-lived process drifts: the same plain model's
    step took twice as long late in one process as early), then the cluster tools."""
    rows = []
    for world in args.ranks:
        for group in (None, PER_NODE):
            for stage in (1, 2, 3):
                layout = f"1x{world}" if group is None else f"{world // group}x{group}"
                print(f"N={world} {layout} stage {stage} ...", flush=True)
                command = [sys.executable, __file__, "--row", f"{world},{group or 0},{stage}"]
                command += ["--narrow", str(args.narrow), "--steps", str(args.steps), "--tmp", str(args.tmp)]
                done = subprocess.run(command, capture_output=True, text=True, check=False)
                if done.returncode:
                    raise RuntimeError(f"row N={world} {layout} stage {stage} failed:\n{done.stderr[-3000:]}")
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(
                    "   ",
                    {k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()},
                    flush=True,
                )
    cluster = {
        world: cluster_figures(world, args.out if world == max(args.ranks) else None) for world in args.ranks
    }
    return {
        "date": time.strftime("%Y-%m-%d"),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "machine": machine(),
        "torch": torch.__version__,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "model": (
            f"llama_1b / {args.narrow}: {rows[0]['parameters'] / 1e6:.1f} M parameters, "
            f"{rows[0]['tensors']} tensors, {rows[0]['buckets']} buckets, {rows[2]['units']} units"
        ),
        "rows": rows,
        "cluster": cluster,
    }


COLUMNS = [
    ("ranks", "N", "{}"),
    ("layout", "layout", "{}"),
    ("stage", "stage", "{}"),
    ("setup_s", "setup s", "{:.2f}"),
    ("setup_calls", "setup calls", "{:,}"),
    ("python_mb", "Python MiB", "{:.2f}"),
    ("state_mb", "state MiB", "{:.2f}"),
    ("elements_per_step", "elements/step", "{:,}"),
    ("collectives_per_step", "collectives", "{}"),
    ("host_ms_per_step", "host ms/step", "{:.1f}"),
    ("our_calls_per_step", "our calls/step", "{:,}"),
    ("meta_bytes", "meta.pt KiB", "{}"),
    ("commit_s", "commit s", "{:.3f}"),
    ("shard_files", "files", "{}"),
    ("padding", "padding", "{:,}"),
    ("resume 3N/4 files_per_bucket", "3N/4 files/bucket", "{}"),
    ("resume 3N/4 files", "3N/4 files", "{}"),
    ("resume 2N files_per_bucket", "2N files/bucket", "{}"),
    ("resume 2N files", "2N files", "{}"),
]


def table(result: dict[str, Any]) -> str:
    lines = ["| " + " | ".join(title for _, title, _ in COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for row in result["rows"]:
        cells = []
        for key, _, fmt in COLUMNS:
            value = row[key] / 1024 if key == "meta_bytes" else row[key]
            cells.append(f"{value:.0f}" if key == "meta_bytes" else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("setup_s", "setup (s)"),
        ("setup_calls", "Python calls into our code at setup"),
        ("host_ms_per_step", "host time of our code per step (ms)"),
        ("our_calls_per_step", "Python calls into our code per step"),
        ("commit_s", "rank 0's commit (s)"),
        ("meta_bytes", "meta.pt (bytes)"),
        ("python_mb", "Python memory of our structures (MiB)"),
        ("resume 3N/4 files_per_bucket", "files per bucket, resume to 3N/4"),
    ]
    fig, axes = plt.subplots(2, 4, figsize=(18, 7.5))
    for ax, (key, title) in zip(axes.flat, panels, strict=True):
        for layout in ("flat", "hybrid"):
            for stage in (1, 2, 3):
                rows = [
                    r
                    for r in result["rows"]
                    if r["stage"] == stage and (r["layout"].startswith("1x")) == (layout == "flat")
                ]
                ax.plot(
                    [r["ranks"] for r in rows],
                    [r[key] for r in rows],
                    marker="o",
                    linestyle="-" if layout == "flat" else "--",
                    label=f"{layout}, stage {stage}",
                )
        ax.set_xscale("log", base=2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("simulated ranks N")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(
        f"Costs against N, simulated rank 0 ({result['model']}; {result['date']}, {result['commit']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ranks", default="64,1024,8192", help="simulated world sizes, comma-separated (multiples of 32)"
    )
    parser.add_argument(
        "--narrow", type=int, default=8, help="divide llama_1b's widths and vocabulary by this"
    )
    parser.add_argument("--steps", type=int, default=9, help="timed steps per row (after one warm-up)")
    parser.add_argument(
        "--tmp", type=Path, default=Path("/dev/shm"), help="where checkpoints are written (tmpfs)"
    )
    parser.add_argument(
        "--from-json", type=Path, help="print (and with --out, plot) a run's scale.json again"
    )
    parser.add_argument("--row", help=argparse.SUPPRESS)  # N,G,stage: one row, printed as JSON
    parser.add_argument("--out", type=Path, help="directory for scale.json, scale.png and the sbatch script")
    args = parser.parse_args()
    args.ranks = [int(n) for n in args.ranks.split(",")]
    bad = [n for n in args.ranks if n % (4 * PER_NODE)]
    if bad:  # 3N/4 must hold whole nodes too
        parser.error(f"--ranks must be multiples of {4 * PER_NODE}, got {bad}")
    torch.set_num_threads(1)
    if args.row:
        world, group, stage = (int(x) for x in args.row.split(","))
        print(json.dumps(row(args, world, group or None, stage)))
        return
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    if args.from_json is not None:  # the table and the plot again, from a run's raw results
        result = json.loads(args.from_json.read_text())
        report(result)
        if args.out is not None:
            plot(result, args.out / "scale.png")
        return
    result = run(args)
    report(result)
    if args.out is not None:
        (args.out / "scale.json").write_text(json.dumps(result, indent=1) + "\n")
        plot(result, args.out / "scale.png")
        print(f"written: {args.out}/scale.json, scale.png, scale-{max(args.ranks)}.sbatch")


def report(result: dict[str, Any]) -> None:
    """The table and the cluster tools' figures of a run."""
    print()
    print(f"{result['model']}; {result['machine']}; torch {result['torch']}; commit {result['commit']}")
    print(table(result))
    for world, figures in result["cluster"].items():
        print(
            f"N={world}: preflight table {figures['preflight_table_lines']} lines, rank 0's checks "
            f"{figures['preflight_checks_s'] * 1e3:.1f} ms; sbatch {figures['sbatch_s']:.1f} s "
            f"({figures['sbatch_nodes_line']})"
        )
    largest = max(result["cluster"], key=int)
    print("\n".join(result["cluster"][largest]["preflight_table"]))


if __name__ == "__main__":
    main()
