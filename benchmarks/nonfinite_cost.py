"""What ``skip_nonfinite_steps`` costs per step: the same GPT trained with the guard off and on, steps
alternating in one launch, so that load from other processes falls on both alike.

    python benchmarks/nonfinite_cost.py [--model small|large] [--steps 16] [--devices 2]

Each rank (gloo, one thread) holds two copies of ``benchmarks/step_time.py``'s GPT, each with its own
``ShardedAdamW`` (stage 2, 25 MiB buckets), one with ``skip_nonfinite_steps=3``; they train on the same
batches, one step of each in turn, for each of ``find_unused_parameters=False`` (the flags take one
small all-reduce and one host synchronisation) and ``True`` (they ride on the used-parameter mask).
Printed per setting: the median step time off and on, the median of the per-step ratios on/off
(paired, so a burst of load elsewhere falls on both), the same for the CPU time of the rank's process
(all its threads: what the step costs in work, whatever else competes for the cores), and the time
spent in the guard's per-bucket check and in its agreement, measured around those calls. Figures,
not assertions.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, not another install

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.step_time import GPT, MODELS  # noqa: E402
from lightning_zero import ShardedAdamW, ZeroConfig  # noqa: E402
from lightning_zero.engine.nonfinite import NonFiniteGuard  # noqa: E402

SEQ, BATCH = 128, 4


def _timed(cls: type, name: str, into: list[float]) -> None:
    original = getattr(cls, name)

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)

    setattr(cls, name, wrapped)


def _rank(rank: int, world_size: int, init: str, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world_size)
    check_s: list[float] = []
    agree_s: list[float] = []
    for name in ("inspect", "inspect_reduced"):
        _timed(NonFiniteGuard, name, check_s)
    _timed(NonFiniteGuard, "agree", agree_s)
    shape = MODELS[args.model]
    vocab = shape["vocab"]
    report = {}
    for find_unused in (False, True):
        copies = []
        for limit in (0, 3):
            torch.manual_seed(0)
            model = GPT(shape["vocab"], shape["dim"], shape["layers"], SEQ, zero_redundancy=False)
            config = ZeroConfig(find_unused_parameters=find_unused, skip_nonfinite_steps=limit)
            opt = ShardedAdamW(model.parameters(), lr=1e-4, config=config, param_order=model.parameters())
            copies.append((model, opt))
        times: list[list[float]] = [[], []]
        cpu: list[list[float]] = [[], []]
        check_s.clear()
        agree_s.clear()
        g = torch.Generator().manual_seed(rank)
        for step in range(args.steps):
            tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
            order = (0, 1) if step % 2 == 0 else (1, 0)  # neither always runs first
            for which in order:
                model, opt = copies[which]
                dist.barrier()
                start, start_cpu = time.perf_counter(), time.process_time()
                loss = nn.functional.cross_entropy(
                    model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
                )
                loss.backward()
                opt.step()
                opt.zero_grad()
                times[which].append(time.perf_counter() - start)
                cpu[which].append(time.process_time() - start_cpu)
        warm = 3
        off, on = times[0][warm:], times[1][warm:]
        cpu_off, cpu_on = cpu[0][warm:], cpu[1][warm:]
        checked_steps = args.steps
        report[find_unused] = {
            "off_s": statistics.median(off),
            "on_s": statistics.median(on),
            "ratio": statistics.median(b / a for a, b in zip(off, on, strict=True)),
            "cpu_off_s": statistics.median(cpu_off),
            "cpu_on_s": statistics.median(cpu_on),
            "cpu_ratio": statistics.median(b / a for a, b in zip(cpu_off, cpu_on, strict=True)),
            "check_ms": 1e3 * sum(check_s) / checked_steps,
            "agree_ms": 1e3 * sum(agree_s) / checked_steps,
        }
        del copies
    queue.put((rank, report))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["small", "large"], default="small")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_rank, args=(r, args.devices, init, args, queue)) for r in range(args.devices)
        ]
        for p in procs:
            p.start()
        reports = dict(queue.get() for _ in procs)
        for p in procs:
            p.join()
    shape = MODELS[args.model]
    print(
        f"\nGPT {args.model} ({shape}), {args.devices} ranks x 1 thread, gloo, fp32, stage 2, 25 MiB "
        f"buckets, batch {BATCH}x{SEQ} per rank, {args.steps} steps each, alternating (median of steps 4..)\n"
    )
    print(
        f"{'find_unused':<13}{'rank':>5}{'off s':>9}{'on s':>9}{'on/off':>9}{'cpu off':>9}{'cpu on':>9}"
        f"{'on/off':>9}{'check ms':>10}{'agree ms':>10}"
    )
    for find_unused in (False, True):
        for rank in sorted(reports):
            r = reports[rank][find_unused]
            print(
                f"{find_unused!s:<13}{rank:>5}{r['off_s']:>9.3f}{r['on_s']:>9.3f}{r['ratio']:>9.3f}"
                f"{r['cpu_off_s']:>9.3f}{r['cpu_on_s']:>9.3f}{r['cpu_ratio']:>9.3f}"
                f"{r['check_ms']:>10.2f}{r['agree_ms']:>10.2f}"
            )
    print(
        "\non/off: median over steps of the paired ratio (wall, then CPU time of the rank's process); "
        "check/agree: ms per step inside the guard's calls"
    )


if __name__ == "__main__":
    main()
