"""Activation memory per pipeline stage, measured: GPipe against 1F1B, against the schedules' theory.

A stack of equal linear layers (with tanh) is cut into ``P`` stages on ``P`` CPU ranks (gloo), each
stage's parameters under ``ShardedAdamW`` (ZeRO stage 2 over its one data-parallel rank, the
pipeline group given), driven by :mod:`lightning_zero.comm.pipeline`'s schedules. During each step
every tensor autograd saves for backward goes through ``torch.autograd.graph.saved_tensors_hooks``:

  * **pack** counts the bytes of the tensor's storage once per distinct storage (a tanh's output
    saved again as the next linear layer's input is one buffer), the stage's parameters left out,
    and notes which micro-batch's forward saved it (the stage's forward calls, counted);
  * the packed object owns the tensor until autograd drops it (its backward node ran, or the graph
    died): its ``__del__`` takes the storage's bytes off when its last saved reference goes.

So ``live`` is, at every moment, the bytes of activations the autograd graphs of the in-flight
micro-batches keep for backward, and ``peak`` is its largest value during a step (the optimizer step
outside it). Per stage and schedule: ``peak`` (the median over the steps after the first, which
also runs torch's shape inference), the micro-batches whose activations are alive at that moment,
one micro-batch's activations, and the theory's count: GPipe holds all ``M``, 1F1B
``min(M, P - stage)``. The script asserts, per stage, that the peak is the theory's count of whole
micro-batches, that nothing is left alive after a step, and that 1F1B's peak is at most GPipe's.

Also reported: the bytes of the receive buffers torch's stage allocates once per micro-batch
(activations on every stage but the first, their gradients on every stage but the last), held for
the whole run whatever the schedule (``PipelineStage``'s ``args_recv_info`` / ``grad_recv_info``).

    python benchmarks/pipeline_memory.py [--stages 2] [--width 512] [--rows 64] [--layers 8]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from local_ranks import (  # this folder is on sys.path when run as a script
    launch_ranks,
    parse_or_work,
    report_and_end,
)

RUNS = [("gpipe", 2), ("gpipe", 4), ("gpipe", 8), ("1f1b", 2), ("1f1b", 4), ("1f1b", 8)]
"""(schedule, micro-batches)."""
NAMES = {"gpipe": "GPipe", "1f1b": "1F1B"}


def theory(kind: str, microbatches: int, stages: int, index: int) -> int:
    """Micro-batches whose activations a stage holds at once: GPipe all, 1F1B its warm-up forwards."""
    return microbatches if kind == "gpipe" else min(microbatches, stages - index)


class SavedActivations:
    """The bytes of distinct storages autograd saves for backward, live and at the peak, per
    micro-batch (see the module docstring). Use :meth:`hooks` around the schedule's ``step()``."""

    def __init__(self) -> None:
        self.live: dict[
            tuple[int, int], list[int]
        ] = {}  # (address, nbytes) -> [nbytes, references, micro-batch]
        self.live_nbytes = 0
        self.peak_nbytes = 0
        self.peak_microbatches = 0
        self.micro = -1
        self.microbatch_nbytes: dict[int, int] = {}  # what each micro-batch's forward saved, distinct
        self.excluded: set[int] = set()

    def start_step(self, parameters: list[Any]) -> None:
        self.peak_nbytes = self.peak_microbatches = 0
        self.micro = -1
        self.microbatch_nbytes = {}
        self.excluded = {p.untyped_storage().data_ptr() for p in parameters}

    def hooks(self) -> Any:
        import torch

        counter = self

        class Saved:
            """A saved tensor, owned until autograd drops it."""

            def __init__(self, tensor: torch.Tensor, key: tuple[int, int]) -> None:
                self.tensor, self.key = tensor, key

            def __del__(self) -> None:
                counter._release(self.key)

        def pack(tensor: torch.Tensor) -> Any:
            nbytes = tensor.numel() * tensor.element_size()
            if tensor.untyped_storage().data_ptr() in self.excluded or nbytes == 0:
                return tensor
            key = (tensor.data_ptr(), nbytes)
            entry = self.live.get(key)
            if entry is None:
                entry = self.live[key] = [nbytes, 0, self.micro]
                self.live_nbytes += nbytes
                self.microbatch_nbytes[self.micro] = self.microbatch_nbytes.get(self.micro, 0) + nbytes
                if self.live_nbytes > self.peak_nbytes:
                    self.peak_nbytes = self.live_nbytes
                    self.peak_microbatches = len({e[2] for e in self.live.values()})
            entry[1] += 1
            # detached: a saved output holding its own grad_fn would be a reference cycle, freed late
            return Saved(tensor.detach(), key)

        def unpack(packed: Any) -> torch.Tensor:
            return packed.tensor if isinstance(packed, Saved) else packed

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _release(self, key: tuple[int, int]) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live_nbytes -= entry[0]
            del self.live[key]


def recv_buffer_nbytes(stage: Any) -> int:
    """Bytes of the distinct receive buffers torch's stage holds (activations and their gradients,
    one set per micro-batch)."""
    seen: dict[int, int] = {}
    for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
        for info in infos:
            buffer = getattr(info, "buffer", None)
            if buffer is not None:
                seen[buffer.untyped_storage().data_ptr()] = buffer.untyped_storage().nbytes()
    return sum(seen.values())


def worker(args: argparse.Namespace, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_zero import ShardedAdamW, ZeroConfig
    from lightning_zero.comm.pipeline import ShardedStage, schedule

    saved = SavedActivations()

    class CountedStage(ShardedStage):
        def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
            saved.micro += 1  # the loss, computed after the stage's forward, counts with its micro-batch
            return super().forward_maybe_with_nosync(*args, **kwargs)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    stages = dist.get_world_size()
    mesh = init_device_mesh("cpu", (stages, 1), mesh_dim_names=("pipeline", "data"))
    index = mesh["pipeline"].get_local_rank()
    results = []
    for kind, microbatches in RUNS:
        torch.manual_seed(0)
        per = args.layers // stages
        module = nn.Sequential(
            *[m for _ in range(per) for m in (nn.Linear(args.width, args.width), nn.Tanh())]
        )
        opt = ShardedAdamW(
            module.parameters(),
            lr=1e-4,
            config=ZeroConfig(stage=2),
            device_mesh=mesh["data"],
            pipeline_group=mesh["pipeline"],
        )
        stage = CountedStage(module, index, stages, torch.device("cpu"), mesh["pipeline"], opt.no_sync)
        runner = schedule(kind, stage, microbatches, lambda o, t: (o - t).pow(2).mean())
        rows = args.rows * microbatches
        inputs, targets = torch.randn(rows, args.width), torch.randn(rows, args.width)  # (M * rows, width)
        peaks, held, per_microbatch, left = [], [], [], []
        for _ in range(args.steps):
            saved.start_step(list(module.parameters()))
            with saved.hooks():
                if index == 0:
                    runner.step(inputs)
                elif index == stages - 1:
                    runner.step(target=targets, losses=[], return_outputs=False)
                else:
                    runner.step()
            left.append(saved.live_nbytes)
            peaks.append(saved.peak_nbytes)
            held.append(saved.peak_microbatches)
            per_microbatch.append(max(saved.microbatch_nbytes.values()))
            opt.step()
            opt.zero_grad()
        results.append(
            {
                "schedule": kind,
                "M": microbatches,
                "peak": statistics.median(peaks[1:]),
                "peaks": peaks,
                "held": held[1:],
                "microbatch": per_microbatch[-1],
                "microbatch_all": per_microbatch[1:],
                "left": left,
                "recv": recv_buffer_nbytes(stage),
            }
        )
    report_and_end(out, results)


def launch(args: argparse.Namespace) -> list[list[dict[str, Any]]]:
    return launch_ranks(__file__, args.stages)


def microbatch_nbytes(args: argparse.Namespace, index: int) -> int:
    """One micro-batch's saved activations on stage ``index``, by hand: the stage's input (``rows x
    width``, fp32) and each tanh's output (the next linear layer's input too), and on the last stage
    the loss's ``output - target``."""
    tensors = 1 + args.layers // args.stages + (index == args.stages - 1)
    return tensors * args.rows * args.width * 4


def check(per_rank: list[list[dict[str, Any]]], args: argparse.Namespace) -> list[str]:
    """What the theory says and the run broke: one micro-batch's bytes as counted by hand, the peak a
    whole number of micro-batches, their count the theory's, nothing left alive after a step, 1F1B at
    most GPipe at the same M."""
    problems = []
    stages = args.stages
    for index, runs in enumerate(per_rank):
        by = {(r["schedule"], r["M"]): r for r in runs}
        for run in runs:
            name = f"stage {index}, {run['schedule']}, M={run['M']}"
            expected = theory(run["schedule"], run["M"], stages, index)
            by_hand = microbatch_nbytes(args, index)
            if run["microbatch"] != by_hand:
                problems.append(f"{name}: a micro-batch saved {run['microbatch']} B, by hand {by_hand}")
            if any(run["left"]):
                problems.append(f"{name}: {run['left']} bytes still saved after the step")
            if set(run["microbatch_all"]) != {run["microbatch"]}:
                problems.append(f"{name}: micro-batches saved different bytes {run['microbatch_all']}")
            if run["peak"] != expected * run["microbatch"] or set(run["held"]) != {expected}:
                problems.append(
                    f"{name}: peak {run['peak']} B over {run['held']} micro-batches, theory "
                    f"{expected} x {run['microbatch']} B"
                )
            if run["schedule"] == "1f1b" and run["peak"] > by[("gpipe", run["M"])]["peak"]:
                problems.append(f"{name}: 1F1B's peak above GPipe's")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rows", type=int, default=64, help="rows per micro-batch")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parse_or_work(parser, worker)
    if args is None:
        return
    per_rank = launch(args)
    stages = args.stages
    print(
        f"{stages} stages, {args.layers} layers of width {args.width}, {args.rows} rows per micro-batch, fp32"
    )
    print(
        f"{'schedule':8} {'M':>3} {'stage':>5} {'peak MB':>8} {'mb MB':>7} {'held':>5} {'theory':>6} "
        f"{'peak/theory':>11} {'vs GPipe':>8} {'recv MB':>8}"
    )
    for i, run in enumerate(per_rank[0]):
        for index, rank in enumerate(per_rank):
            mine = rank[i]
            expected = theory(mine["schedule"], mine["M"], stages, index)
            gpipe = next(r for r in rank if r["schedule"] == "gpipe" and r["M"] == mine["M"])
            print(
                f"{NAMES[run['schedule']]:8} {run['M']:3d} {index:5d} {mine['peak'] / 1e6:8.3f} "
                f"{mine['microbatch'] / 1e6:7.3f} {max(mine['held']):5d} {expected:6d} "
                f"{mine['peak'] / (expected * mine['microbatch']):11.3f} {mine['peak'] / gpipe['peak']:8.3f} "
                f"{mine['recv'] / 1e6:8.3f}"
            )
    problems = check(per_rank, args)
    for problem in problems:
        print("FAILED:", problem)
    if problems:
        raise SystemExit(1)
    print(
        "checked: one micro-batch's bytes as counted by hand; every peak the theory's count of whole "
        "micro-batches; 1F1B <= GPipe; nothing left saved after a step"
    )


if __name__ == "__main__":
    main()
