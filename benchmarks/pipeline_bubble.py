"""The pipeline bubble, measured: how much of a step each stage waits, against ``(P-1)/(M+P-1)``.

A stack of equal linear layers (with tanh) is cut into ``P`` stages of equal compute on ``P`` CPU
ranks (gloo, one thread each), each stage's parameters under ``ShardedAdamW`` (ZeRO stage 2 over its
one data-parallel rank, the pipeline group given), driven by :mod:`lightning_zero.comm.pipeline`'s
schedules. Per schedule and number of micro-batches ``M``:

  * ``busy``: the time the stage spends in its forwards and backwards during the step (timed around
    torch's ``forward_maybe_with_nosync`` and ``backward_maybe_with_nosync``): the work it must do;
  * ``step``: the pipeline's step, from the moment every rank has entered the schedule's ``step()``
    to the moment the last one has left it (one monotonic clock for the processes of one machine; a
    rank's own ``step()`` misses the fill or the drain: the first stage starts at once, the last
    returns before the first's last backward); the optimizer step is outside it;
  * ``idle = 1 - busy / step`` (median over the steps after the first two), per stage, against
    ``(P-1)/(M+P-1)`` (divided by ``V`` for interleaved 1F1B, whose ``V`` stages per rank are each
    ``1/V`` of its layers).

The formula assumes stages of equal cost: the first stage's input is made a leaf that wants a
gradient, so that its first layer's backward computes an input gradient as every other stage's does.
What is not the bubble also counts as idle: the activations and gradients sent between the stages
(through gloo's threads, on the same cores as the compute) and the schedule's own Python. It is a
fixed cost per micro-batch, so the idle fraction nears the formula as a micro-batch's compute grows
(``--width``, ``--layers``).

    python benchmarks/pipeline_bubble.py [--stages 2] [--width 1024] [--rows 64] [--layers 8]

Figures, not assertions.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from local_ranks import (  # this folder is on sys.path when run as a script
    launch_ranks,
    parse_or_work,
    report_and_end,
)

RUNS = [
    ("gpipe", 2, 1),
    ("gpipe", 4, 1),
    ("gpipe", 8, 1),
    ("1f1b", 2, 1),
    ("1f1b", 4, 1),
    ("1f1b", 8, 1),
    ("interleaved_1f1b", 4, 2),
    ("interleaved_1f1b", 8, 2),
]
"""(schedule, micro-batches, stages per rank)."""


def worker(args: argparse.Namespace, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_zero import ShardedAdamW, ZeroConfig
    from lightning_zero.comm.pipeline import ShardedStage, schedule

    class TimedStage(ShardedStage):
        busy = 0.0

        def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return super().forward_maybe_with_nosync(*args, **kwargs)
            finally:
                TimedStage.busy += time.perf_counter() - began

        def backward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return super().backward_maybe_with_nosync(*args, **kwargs)
            finally:
                TimedStage.busy += time.perf_counter() - began

    class InputGrad(nn.Module):
        """The first stage's input as a leaf that wants a gradient: its first layer's backward computes
        the input's gradient as every other stage's does, so that the stages cost the same (the
        formula's premise)."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.detach().requires_grad_()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    stages = dist.get_world_size()
    mesh = init_device_mesh("cpu", (stages, 1), mesh_dim_names=("pipeline", "data"))
    index = mesh["pipeline"].get_local_rank()
    results = []
    for kind, microbatches, virtual in RUNS:
        torch.manual_seed(0)
        chunks = stages * virtual
        per = args.layers // chunks
        mine = [
            nn.Sequential(
                *[InputGrad()] * (index + v == 0),
                *[m for _ in range(per) for m in (nn.Linear(args.width, args.width), nn.Tanh())],
            )
            for v in range(virtual)
        ]
        module = mine[0] if virtual == 1 else nn.ModuleList(mine)
        opt = ShardedAdamW(
            module.parameters(),
            lr=1e-4,
            config=ZeroConfig(stage=2),
            device_mesh=mesh["data"],
            pipeline_group=mesh["pipeline"],
        )
        built = [
            TimedStage(chunk, index + v * stages, chunks, torch.device("cpu"), mesh["pipeline"], opt.no_sync)
            for v, chunk in enumerate(mine)
        ]
        runner = schedule(
            kind, built if virtual > 1 else built[0], microbatches, lambda o, t: (o - t).pow(2).mean()
        )
        rows = args.rows * microbatches
        inputs, targets = torch.randn(rows, args.width), torch.randn(rows, args.width)
        steps, busy = [], []
        for _ in range(args.steps):
            dist.barrier()
            TimedStage.busy = 0.0
            began = time.perf_counter()
            if index == 0:
                runner.step(inputs)
            elif index == stages - 1:
                runner.step(target=targets, losses=[])
            else:
                runner.step()
            ended = time.perf_counter()  # one monotonic clock for every process of this machine
            spans: list[Any] = [None] * stages
            dist.all_gather_object(spans, (began, ended))
            steps.append(max(e for _, e in spans) - max(b for b, _ in spans))  # the pipeline's step
            busy.append(TimedStage.busy)
            opt.step()
            opt.zero_grad()
        idle = statistics.median([1 - b / t for b, t in zip(busy[2:], steps[2:], strict=True)])
        step = statistics.median(steps[2:])
        results.append({"schedule": kind, "M": microbatches, "V": virtual, "idle": idle, "step": step})
    report_and_end(out, results)


def launch(args: argparse.Namespace) -> list[list[dict[str, Any]]]:
    return launch_ranks(__file__, args.stages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=64, help="rows per micro-batch")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    args = parse_or_work(parser, worker)
    if args is None:
        return
    per_rank = launch(args)
    stages = args.stages
    print(f"{stages} stages, {args.layers} layers of width {args.width}, {args.rows} rows per micro-batch")
    print(
        f"{'schedule':18} {'M':>3} {'V':>3} {'step s':>8} "
        + " ".join(f"{'idle s' + str(r):>8}" for r in range(stages))
        + f" {'formula':>8}"
    )
    for i, run in enumerate(per_rank[0]):
        formula = (stages - 1) / (run["M"] + stages - 1) / run["V"]
        idle = [rank[i]["idle"] for rank in per_rank]
        print(
            f"{run['schedule']:18} {run['M']:3d} {run['V']:3d} {run['step']:8.3f} "
            + " ".join(f"{x:8.3f}" for x in idle)
            + f" {formula:8.3f}"
        )


if __name__ == "__main__":
    main()
