"""Step time, memory and traffic of zero3/2/1, ddp and the peers (FSDP2, FSDP, DeepSpeed), in one go.

    python benchmarks/step_time.py [--model small|large|gpt2|both] [--steps 20] [--devices 2]

Each strategy trains the same GPT-like model (fp32) on the same random tokens with Lightning on
CPU/gloo, one process per rank with one thread each, as a separate launch, strategies interleaved.
Models: ``small`` (17M: 6 layers, width 384, vocab 8192) and ``large`` (47M: 4 layers, width 512,
vocab 32768, untied output layer: embedding and head each larger than a 25 MB bucket). Each rank
writes its figures; this script prints them side by side:

  * median step time (wall time between consecutive batch starts, steps after the first 3, so an
    all-gather left in flight into the next forward is counted) and its ratio to "ddp";
  * exposed communication: seconds per step this rank blocked on collectives, over the time the
    same collectives take alone (measured after training with nothing else running);
  * optimizer-state bytes and gradient bytes held per rank after a step;
  * elements sent per step, counted at the collectives (DDP through a counting comm hook,
    ZeroRedundancyOptimizer's broadcasts through torch.distributed, the peers FSDP2, FSDP and
    DeepSpeed at torch.distributed's all-reduce, all-gather, reduce-scatter and broadcast: a ring's
    share per rank), over the minimum 2Ψ(N−1)/N, and for the rows that shard parameters over
    3Ψ(N−1)/N (a gather in forward, another in backward, a reduce-scatter);
  * RSS per rank when training starts (after setup) and at its peak (ru_maxrss), and the peak's
    saving against ddp over the theoretical one (Adam state and gradients cut to 1/N, and no DDP
    bucket copy of the gradients);
  * the peak of the heap in use during training (glibc's ``mallinfo2``: bytes allocated and not
    freed, sampled every millisecond by a thread, up to ``on_train_end``: zero3's teardown, which
    gathers the full model back, comes after), the analogue of ``torch.cuda.max_memory_allocated``: RSS also
    counts memory glibc keeps after a free, which depends on the allocation history, not on what
    the strategy holds. Its saving against ddp over the same theoretical one is printed too.
With ``--profile`` the ``zero*`` rows also run the strategy's step profiler
(``profile_steps``) over the steps the step time is the median of, and the last (its report is made at
the fit's end, outside those steps); ``benchmarks/step_time_profile.py`` prints its figures against
this script's own.
A row whose launch fails (or whose library is missing: DeepSpeed is optional, ``pip install
deepspeed==0.19.8``) is printed as "not run: <reason>" and the other rows still run; "n/c" marks a
figure not counted for that row.

The peers on CPU need workarounds: ``benchmarks/peers.py``.
Figures, not assertions: these machines are noisy, so compare ratios from one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, not another install

import lightning as L  # noqa: E402
import torch  # noqa: E402
from peers import CPUDeepSpeedStrategy, CPUFSDPStrategy, count_collectives  # noqa: E402  # this folder
from step_time_model import GPT, Block, HeapPeak  # noqa: E402  # this folder
from step_time_profile import agreement, profile_figures  # noqa: E402  # this folder
from step_time_report import WARMUP_STEPS, figures_path, report  # noqa: E402  # this folder
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_zero  # noqa: E402

STRATEGIES = (
    "zero3",
    "zero3-bf16",
    "zero3-int8",
    "zero3-keep",
    "fsdp2",
    "fsdp2-keep",
    "fsdp-full",
    "fsdp-grad-op",
    "deepspeed3",
    "deepspeed2",
    "zero2",
    "zero2-bf16",
    "zero2-int8",
    "zero2-2x2",
    "zero3-2x2",
    "zero2-overlap",
    "zero2-5MB",
    "zero2-nonfinite",
    "zero2-fused",
    "zero1",
    "ddp",
    "ddp-fused",
    "ddp+ZeroRedundancyOptimizer",
)
"""``zero2-overlap``: with ``overlap_param_gather`` (the all-gather left in flight into the next
forward). ``zero2-5MB``: 5 MiB buckets (at 25 MiB a 68 MB model is three buckets).
``zero2-nonfinite``: with ``skip_nonfinite_steps`` (a min/max pass per bucket before it is sent, one
small all-reduce and one host synchronisation per step). ``-bf16`` / ``-int8``: gradients on the wire as
bf16 / int8 blocks (``reduce_dtype``; the rows without a suffix send fp32), ``zero3-int8`` with int8
parameter gathers too (``gather_dtype``); their bytes per step are printed against the fp32 row's.
``-fused``: ``AdamW(fused=True)`` (the others
use torch's default AdamW; the sharded update runs the kernel family the user's optimizer asks for).
``zero3``: parameters sharded too; units: each block, the embedding and the output layer (the default
policy), the rest (position table, final norm) the root (``-keep``: ``reshard_after_forward=False``).
``fsdp2``: torch's ``fully_shard`` on every block and the root through Lightning's
``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)``, ``reshard_after_forward=True``
(``-keep``: ``False``, FSDP2's ZeRO-2). ``fsdp-full``: FSDP1 ``ShardingStrategy.FULL_SHARD``, one unit
per block (``auto_wrap_policy={Block}``) and the root; ``fsdp-grad-op``: ``SHARD_GRAD_OP`` (parameters
kept gathered from forward to backward, like ``-keep``). Both with Lightning's default
``use_orig_params=True``, under which ``configure_optimizers`` sees flattened 1-D parameter shards (a
``p.ndim >= 2`` weight-decay rule would put every weight in the no-decay group; this model's
optimizer has one group). ``deepspeed3`` / ``deepspeed2``: Lightning's ``DeepSpeedStrategy(stage=3 / 2)``
with its defaults and the model's own AdamW."""
MODELS = {
    "small": {"layers": 6, "dim": 384, "vocab": 8192},
    "large": {"layers": 4, "dim": 512, "vocab": 32768},
    "gpt2": {"layers": 12, "dim": 768, "vocab": 32768},
}
BOTH = ("small", "large")
"""What ``--model both`` (the default) runs. ``gpt2`` (135M: GPT-2 small's shape, untied output layer)
is run on its own: about 10 s per step and 3 GB per rank under ddp on a CPU core, so memory only,
with few steps (``--model gpt2 --steps 6 --rounds 1``)."""


def model_shape(args: argparse.Namespace) -> dict[str, int]:
    """``args.model``'s shape with ``--layers``, ``--dim``, ``--vocab`` laid over it."""
    overrides = {k: getattr(args, k) for k in ("layers", "dim", "vocab") if getattr(args, k) is not None}
    return {**MODELS[args.model], **overrides}


def make_model(name: str, shape: dict[str, int], seq: int) -> GPT:
    return GPT(
        shape["vocab"],
        shape["dim"],
        shape["layers"],
        seq,
        zero_redundancy=name.endswith("Optimizer"),
        fused=name.endswith("fused"),
        fsdp2_reshard=(not name.endswith("keep")) if name.startswith("fsdp2") else None,
    )


def make_strategy(name: str, args: argparse.Namespace) -> Any:
    """The Trainer's ``strategy`` for the row ``name`` of STRATEGIES."""
    if name.startswith("ddp"):
        return "ddp"
    if name.startswith("zero"):
        cap = 5.0 if name.endswith("5MB") else args.bucket_cap_mb
        wire = {"bf16": "bf16", "int8": "int8"}.get(name.rsplit("-", 1)[-1])
        stage3 = {"reshard_after_forward": not name.endswith("keep")}  # units: blocks, embedding, head
        window = (WARMUP_STEPS, args.steps - 1) if args.profile else None  # the timed steps, and the last
        return lightning_zero.ZeroStrategy(
            stage=int(name[4]),
            shard_group_size=2 if name.endswith("2x2") else None,  # 4 ranks: 2 groups of 2
            bucket_cap_mb=cap,
            overlap_param_gather=name.endswith("overlap"),
            skip_nonfinite_steps=3 if name.endswith("nonfinite") else 0,
            reduce_dtype=wire,
            gather_dtype="int8" if name == "zero3-int8" else None,
            profile_steps=window,
            **(stage3 if name.startswith("zero3") else {}),
        )
    if name.startswith("fsdp2"):
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(args.devices, 1)  # data-parallel size, tensor-parallel size: FSDP2 alone
    if name.startswith("fsdp-"):
        from torch.distributed.fsdp import ShardingStrategy

        full = name == "fsdp-full"
        sharding = ShardingStrategy.FULL_SHARD if full else ShardingStrategy.SHARD_GRAD_OP
        return CPUFSDPStrategy(sharding_strategy=sharding, auto_wrap_policy={Block})
    if name.startswith("deepspeed"):
        return CPUDeepSpeedStrategy(stage=int(name[-1]))
    raise ValueError(f"unknown strategy row {name!r}")


def unavailable(name: str, devices: int = 2) -> str | None:
    """Why the row ``name`` cannot run in this environment, or None."""
    if name.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed not installed (pip install deepspeed==0.19.8)"
    if name.endswith("2x2") and devices != 4:
        return f"2 shard groups of 2 ranks need --devices 4, not {devices}"
    return None


def child_env(mmap_threshold: int | None = None) -> dict[str, str]:
    """The environment of every launch: one thread per rank, DeepSpeed's CPU accelerator.

    ``mmap_threshold`` fixes glibc's mmap threshold at that many bytes (``MALLOC_MMAP_THRESHOLD_``,
    which also turns its dynamic threshold off), the same for every row: freed buffers above it go
    back to the system at once, so RSS follows what is allocated (see docs/performance.md).
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", DS_ACCELERATOR="cpu")
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    return env


def failure_reason(returncode: int, stderr: str) -> str:
    """One line saying why a launch failed: the last exception line of its stderr, else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", line)]
    if errors:
        return errors[-1][:300]
    if returncode < 0:
        return f"killed by signal {-returncode}"
    return f"exit code {returncode}: {lines[-1][:300] if lines else 'no output'}"


def run_one(name: str, args: argparse.Namespace) -> None:
    """One launch of the row ``name`` (this process is rank 0; Lightning starts the others): trains
    and writes this rank's figures to ``figures_path``."""
    heap = HeapPeak()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    shape = model_shape(args)
    tokens = torch.randint(
        0, shape["vocab"], (args.steps * args.batch * args.devices, args.seq + 1), generator=g
    )
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    model = make_model(name, shape, args.seq)
    model.heap = heap
    params = sum(p.numel() for p in model.parameters())  # before a wrapper shards them
    if name.startswith(("fsdp", "deepspeed")):
        count_collectives(model.counted)
    trainer = L.Trainer(
        strategy=make_strategy(name, args),
        devices=args.devices,
        accelerator="cpu",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=Path(args.out, f"{args.model}.{name}.round{args.round}"),  # step_profile.json
    )
    trainer.fit(model, DataLoader(data, batch_size=args.batch))
    state_b, grad_b, sent = model.figures
    skip = min(WARMUP_STEPS, len(model.step_s) - 1)  # at least one step is kept
    figures = {
        "min_elements": model.min_elements,
        "inter_elements": model.inter,
        "step_s": model.step_s[skip:],
        "wait_s": model.wait_s[skip:],
        "alone_s": model.alone_s,
        "opt_state_bytes": state_b,
        "grad_bytes": grad_b,
        "elements_sent": sent,
        "bytes_sent": getattr(model, "bytes_sent", None),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "setup_rss_mb": model.setup_rss_mb,
        "peak_heap_mb": model.train_heap_mb,
        "params": params,
        "profile": profile_figures(trainer),
    }
    figures_path(args, name, args.round, trainer.global_rank).write_text(json.dumps(figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", choices=[*MODELS, "both"], default="both")
    parser.add_argument("--layers", type=int, help="overrides the model's layer count")
    parser.add_argument("--dim", type=int, help="overrides the model's width")
    parser.add_argument("--vocab", type=int, help="overrides the model's vocabulary size")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument(
        "--bucket-cap-mb", type=float, default=25.0, help="for zero1/zero2 (DDP keeps its 25)"
    )
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        metavar="BYTES",
        help="fix glibc's mmap threshold for every row (e.g. 1048576); default: glibc's dynamic one",
    )
    parser.add_argument("--out", default="benchmarks/results/step_time")
    parser.add_argument(
        "--json", type=Path, help="also write every rank's raw figures, by model and row, to this file"
    )
    parser.add_argument("--rounds", type=int, default=2, help="runs of every strategy, interleaved")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="zero rows: run the step profiler over the timed steps and print its figures against these",
    )
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    parser.add_argument("--only", choices=STRATEGIES, help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.profile and args.steps < WARMUP_STEPS + 2:
        parser.error(f"--profile needs --steps >= {WARMUP_STEPS + 2}: timed steps from {WARMUP_STEPS} on")
    if args.only:
        run_one(args.only, args)
        return
    Path(args.out).mkdir(parents=True, exist_ok=True)
    models = list(BOTH) if args.model == "both" else [args.model]
    not_run: dict[str, dict[str, str]] = {model: {} for model in models}
    for model in models:
        for k in range(args.rounds):
            for name in args.strategies.split(","):
                if name in not_run[model]:
                    continue
                print(f"{model}, round {k + 1}/{args.rounds}: {name} ...", flush=True)
                args.model = model
                for stale in range(args.devices):  # a failed launch must not report an older run
                    figures_path(args, name, k, stale).unlink(missing_ok=True)
                reason = unavailable(name, args.devices) or launch(
                    [sys.executable, *sys.argv, "--model", model, "--only", name, "--round", str(k)],
                    args.mmap_threshold,
                )
                if reason:
                    print(f"  not run: {reason}", flush=True)
                    not_run[model][name] = reason
    raw = {}
    for model in models:
        args.model = model
        raw[model] = {"rows": report(args, not_run[model]), "not_run": not_run[model]}
        if args.profile:
            raw[model]["profile_agreement"] = agreement(raw[model]["rows"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(raw, indent=1) + "\n")
        print(f"\nraw figures: {args.json}")


def launch(cmd: list[str], mmap_threshold: int | None = None) -> str | None:
    """Runs one launch to its end; why it failed, or None."""
    env = child_env(mmap_threshold)
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return failure_reason(proc.returncode, proc.stderr) if proc.returncode else None


if __name__ == "__main__":
    main()
