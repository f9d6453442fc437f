"""What lightning-zero's named ranges (``lightning_zero/comm/trace.py``) cost, profiler off and on.

    python benchmarks/trace_overhead.py [--model tiny|small|large] [--steps 24] [--ranks 2] [--bucket-mb 0.25]

Per range (this process, ``timeit``): a range outside a profiler with a constant name, the same with
the f-string its callers build (``f"bucket {b}: launch"``), and a range while ``torch.profiler``
records (``span``'s profiler range).

Per step: ``benchmarks/step_time.py``'s GPT (or a tiny one) on ``--ranks`` local ranks (gloo, one
thread each), ``ShardedAdamW`` at stage 2 and at stage 3 (the blocks its units), buckets of
``--bucket-mb`` MiB (small, so that a step opens many ranges). Steps alternate between the ranges as
shipped and ``span`` replaced by a no-op in every module that calls it (the callers' f-strings still
built), first with no profiler, then inside one ``torch.profiler.profile`` (CPU activity) around all
the steps. Printed per stage: the ranges a step opens, the median step time of each, the median of
the paired ratios (steps taken alternately, so that load from elsewhere falls on both), and the
estimate those ranges times one range's cost over the step time gives (steadier than the ratio on
a loaded machine, whose noise is larger than the ranges' share). Figures, not assertions.
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

SEQ, BATCH, WARMUP = 128, 4, 2
MODELS = {"tiny": (2048, 128, 4), "small": (8192, 384, 6), "large": (32768, 512, 4)}
"""(vocab, width, layers): ``small`` and ``large`` are ``benchmarks/step_time.py``'s; ``tiny`` makes
the ranges' share of a step largest."""


def per_range_ns() -> dict[str, float]:
    """Nanoseconds per ``with span(...)``: off with a constant name, off with an f-string, on."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from lightning_zero.comm.trace import span

    device, b, n = torch.device("cpu"), 3, 200_000

    def constant() -> None:
        with span("bucket 3: launch", device):
            pass

    def formatted() -> None:
        with span(f"bucket {b}: launch", device):
            pass

    off = min(timeit.repeat(constant, number=n, repeat=5)) / n
    off_f = min(timeit.repeat(formatted, number=n, repeat=5)) / n
    with profile(activities=[ProfilerActivity.CPU]):
        on = min(timeit.repeat(formatted, number=n // 20, repeat=3)) / (n // 20)
    return {"off_ns": off * 1e9, "off_fstring_ns": off_f * 1e9, "on_ns": on * 1e9}


def build(stage: int, shape: tuple[int, int, int], bucket_mb: float) -> tuple[Any, Any]:
    """The GPT of ``shape`` (seeded alike on every rank) and its ``ShardedAdamW`` at ``stage`` (stage
    3: the blocks its units), buckets of ``bucket_mb`` MiB."""
    import torch
    from step_time_model import GPT, Block  # this folder

    from lightning_zero import ShardedAdamW, ZeroConfig

    torch.manual_seed(0)
    model = GPT(*shape, SEQ, zero_redundancy=False)
    units: dict[str, Any] = {"unit_modules": (Block,)} if stage == 3 else {}
    config = ZeroConfig(stage=stage, bucket_cap_mb=bucket_mb, **units)
    return model, ShardedAdamW(
        model.parameters(), lr=1e-4, config=config, module=model if stage == 3 else None
    )


def timed_step(model: Any, opt: Any, g: Any, vocab: int) -> float:
    """Seconds of one training step on a random batch (the ranks start it together)."""
    import time

    import torch
    import torch.distributed as dist

    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    dist.barrier()
    start = time.perf_counter()
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def worker(args: argparse.Namespace, out: Path) -> None:
    from contextlib import nullcontext

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import lightning_zero.comm.trace as trace

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    shape = MODELS[args.model]
    off, span = nullcontext(), trace.span
    callers = [
        m
        for n, m in sys.modules.items()
        if n.startswith("lightning_zero.") and m is not trace and getattr(m, "span", None) is span
    ]
    opened = [0]

    def counting(name: str, device: Any = None) -> Any:
        opened[0] += 1
        return span(name, device)

    def use(fn: Any) -> None:
        for module in callers:
            module.span = fn

    def step(model: Any, opt: Any, g: torch.Generator) -> float:
        return timed_step(model, opt, g, shape[0])

    report: dict[str, Any] = {}
    for stage in (2, 3):
        model, opt = build(stage, shape, args.bucket_mb)
        g = torch.Generator().manual_seed(dist.get_rank())
        step(model, opt, g)  # stage 3's first step learns the prefetch order
        opened[0] = 0
        use(counting)
        step(model, opt, g)
        use(span)
        ranges = opened[0]
        for profiled in (False, True):
            times: dict[str, list[float]] = {"ranges": [], "no-op": []}
            with profile(activities=[ProfilerActivity.CPU]) if profiled else nullcontext():
                for i in range(args.steps):
                    for mode in ("ranges", "no-op") if i % 2 == 0 else ("no-op", "ranges"):
                        use(span if mode == "ranges" else (lambda name, device=None: off))
                        times[mode].append(step(model, opt, g))
            use(span)
            on, none = times["ranges"][WARMUP:], times["no-op"][WARMUP:]
            report[f"stage {stage}, profiler {'on' if profiled else 'off'}"] = {
                "ranges_per_step": ranges,
                "buckets": len(opt.engine.plan.buckets),
                "ranges_s": statistics.median(on),
                "noop_s": statistics.median(none),
                "ratio": statistics.median(a / b for a, b in zip(on, none, strict=True)),
            }
        del model, opt
    report_and_end(out, report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--steps", type=int, default=24, help="steps of each mode (the first 2 not counted)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=0.25)
    args = parse_or_work(parser, worker)
    if args is None:
        return
    single = per_range_ns()
    print(
        f"one range: {single['off_ns']:.0f} ns off (constant name), {single['off_fstring_ns']:.0f} ns off "
        f"(with the caller's f-string), {single['on_ns'] / 1e3:.1f} us while a profiler records"
    )
    per_rank = launch_ranks(__file__, args.ranks, label="trace_overhead")
    print(
        f"\nGPT {args.model}, {args.ranks} ranks x 1 thread, gloo, fp32, {args.bucket_mb} MiB buckets, batch "
        f"{BATCH}x{SEQ} per rank, {args.steps} steps each way, alternating (median of steps {WARMUP + 1}..)\n"
    )
    print(
        f"{'case':<24}{'rank':>5}{'buckets':>8}{'ranges':>8}{'ranges s':>10}{'no-op s':>10}{'ratio':>8}"
        f"{'estimate':>10}"
    )
    for case in per_rank[0]:
        one_s = (single["on_ns"] if case.endswith("on") else single["off_fstring_ns"]) * 1e-9
        for rank, report in enumerate(per_rank):
            r = report[case]
            print(
                f"{case:<24}{rank:>5}{r['buckets']:>8}{r['ranges_per_step']:>8}{r['ranges_s']:>10.4f}"
                f"{r['noop_s']:>10.4f}{r['ratio']:>8.3f}{r['ranges_per_step'] * one_s / r['noop_s']:>10.2%}"
            )
    print(
        "\nratio: median over steps of (step with the ranges) / (the paired step with span a no-op); "
        "estimate: ranges x one range's cost (off: with its f-string; on: recorded) / the no-op step"
    )


if __name__ == "__main__":
    main()
