"""What keeping the last collectives per group (``lightning_zero/comm/history.py``) costs.

    python benchmarks/history_overhead.py [--steps 24] [--ranks 2] [--bucket-mb 0.25]

Per collective (this process, ``timeit``): ``GroupHistory.note`` (what every collective pays, always
on) and ``Comm.labelled`` (one per bucket launch and per bucket parameter gather), against a call
of a no-op of the same shape.

Per step: ``benchmarks/trace_overhead.py``'s tiny GPT on ``--ranks`` local ranks (gloo, one thread
each), ``ShardedAdamW`` at stages 2 and 3 (the blocks its units), buckets of ``--bucket-mb`` MiB
(small, so that a step issues many collectives). Steps alternate between the rings as shipped and
``note`` and ``labelled`` replaced by no-ops. Printed per stage: the collectives and labels of a
step, the median step time of each mode, the median of the paired ratios, and the estimate
(collectives x note + labels x labelled, over the step time), steadier than the ratio on a loaded
machine. Figures, not assertions.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, not another install

from local_ranks import launch_ranks, parse_or_work, report_and_end  # noqa: E402  # this folder
from trace_overhead import BATCH, MODELS, SEQ, WARMUP, build, timed_step  # noqa: E402  # this folder

SHAPE = MODELS["tiny"]
"""``trace_overhead.py``'s tiny GPT, where the rings' share of a step is largest."""


def per_call_ns() -> dict[str, float]:
    """Nanoseconds per ``note`` and per ``labelled`` block, and per call of a no-op method."""
    import torch

    from lightning_zero.comm import Comm
    from lightning_zero.comm.history import GroupHistory

    ring, n = GroupHistory("world", 2), 500_000
    comm = Comm.single(torch.device("cpu"))

    class Noop:
        def note(self, what: str, numel: int, dtype: Any) -> None:
            pass

    noop, dtype = Noop(), torch.float32

    def noted() -> None:
        ring.note("gradient reduce-scatter", 1 << 20, dtype)

    def skipped() -> None:
        noop.note("gradient reduce-scatter", 1 << 20, dtype)

    def labelled() -> None:
        with comm.labelled(f"bucket {3}"):
            pass

    best = {
        name: min(timeit.repeat(fn, number=n, repeat=5)) / n
        for name, fn in {"note": noted, "noop": skipped, "labelled": labelled}.items()
    }
    return {f"{k}_ns": v * 1e9 for k, v in best.items()}


def worker(args: argparse.Namespace, out: Path) -> None:
    from contextlib import nullcontext

    import torch
    import torch.distributed as dist

    from lightning_zero.comm import Comm
    from lightning_zero.comm.history import GroupHistory

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    note, labelled, off = GroupHistory.note, Comm.labelled, nullcontext()
    counts = {"note": 0, "labelled": 0}

    def counting_note(self: GroupHistory, *a: Any) -> None:
        counts["note"] += 1
        note(self, *a)

    def counting_labelled(self: Comm, label: str) -> Any:
        counts["labelled"] += 1
        return labelled(self, label)

    def use(shipped: bool, counting: bool = False) -> None:
        noting = (counting_note if counting else note) if shipped else (lambda self, *a: None)
        labelling = (counting_labelled if counting else labelled) if shipped else (lambda self, label: off)
        setattr(GroupHistory, "note", noting)  # noqa: B010 - a method replaced for the no-op steps
        setattr(Comm, "labelled", labelling)  # noqa: B010

    def step(model: Any, opt: Any, g: torch.Generator) -> float:
        return timed_step(model, opt, g, SHAPE[0])

    report: dict[str, Any] = {}
    for stage in (2, 3):
        model, opt = build(stage, SHAPE, args.bucket_mb)
        g = torch.Generator().manual_seed(dist.get_rank())
        step(model, opt, g)  # stage 3's first step learns the prefetch order
        counts.update(note=0, labelled=0)
        use(True, counting=True)
        step(model, opt, g)
        per_step = dict(counts)
        times: dict[str, list[float]] = {"rings": [], "no-op": []}
        for i in range(args.steps):
            for mode in ("rings", "no-op") if i % 2 == 0 else ("no-op", "rings"):
                use(mode == "rings")
                times[mode].append(step(model, opt, g))
        use(True)
        on, none = times["rings"][WARMUP:], times["no-op"][WARMUP:]
        report[f"stage {stage}"] = {
            "collectives": per_step["note"],
            "labels": per_step["labelled"],
            "rings_s": statistics.median(on),
            "noop_s": statistics.median(none),
            "ratio": statistics.median(a / b for a, b in zip(on, none, strict=True)),
        }
        del model, opt
    report_and_end(out, report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24, help="steps of each mode (the first 2 not counted)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=0.25)
    args = parse_or_work(parser, worker)
    if args is None:
        return
    one = per_call_ns()
    print(
        f"per collective: note {one['note_ns']:.0f} ns (a no-op call {one['noop_ns']:.0f} ns); "
        f"labelled {one['labelled_ns']:.0f} ns per labelled block"
    )
    per_rank = launch_ranks(__file__, args.ranks, label="history_overhead")
    print(
        f"\nGPT tiny, {args.ranks} ranks x 1 thread, gloo, fp32, {args.bucket_mb} MiB buckets, batch "
        f"{BATCH}x{SEQ} per rank, {args.steps} steps each way, alternating (median of steps {WARMUP + 1}..)\n"
    )
    head = f"{'case':<10}{'rank':>5}{'colls':>7}{'labels':>7}{'rings s':>10}{'no-op s':>10}"
    print(f"{head}{'ratio':>8}{'estimate':>10}")
    for case in per_rank[0]:
        for rank, report in enumerate(per_rank):
            r = report[case]
            cost_s = (r["collectives"] * one["note_ns"] + r["labels"] * one["labelled_ns"]) * 1e-9
            print(
                f"{case:<10}{rank:>5}{r['collectives']:>7}{r['labels']:>7}{r['rings_s']:>10.4f}"
                f"{r['noop_s']:>10.4f}{r['ratio']:>8.3f}{cost_s / r['noop_s']:>10.3%}"
            )
    print(
        "\nratio: median over steps of (step with the rings) / (the paired step with note and labelled "
        "no-ops); estimate: collectives x note + labels x labelled, over the no-op step"
    )


if __name__ == "__main__":
    main()
