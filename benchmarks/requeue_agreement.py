"""What the SLURM requeue check costs per optimizer step: before (a blocking one-element all-reduce on
the training group, read on the host) and after (`recipes.training.callbacks.StopAgreement`: an asynchronous
all-reduce on a gloo side group, launched at one step and read at the next).

    python benchmarks/requeue_agreement.py [--steps 2000] [--work-ms 5]

Two gloo ranks on this machine. Each "step" sleeps `--work-ms` (a stand-in for training that leaves
the cores to the collectives, as a GPU step leaves the host; 0 measures back-to-back checks), then
runs the check. Printed (rank 0): the mean and 99th percentile of the time the step path spends
inside the check, in microseconds. On GPU the blocking variant also synchronises the host with the
device every step (its flag lives on the device under NCCL); the side group's flag is a CPU tensor
and never does.
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recipes.training.callbacks import StopAgreement


def _blocking_check(requested: bool) -> bool:
    flag = torch.tensor([1.0 if requested else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return float(flag) > 0


def _run(rank: int, port: int, steps: int, work_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    agreement = StopAgreement()
    agreement.open()
    checks = {
        "blocking (before)": lambda: _blocking_check(False),
        "async side group (after)": lambda: agreement.poll(False),
    }
    timings = {}
    for name, check in checks.items():
        for _ in range(20):  # warm up
            check()
        dist.barrier()
        inside = torch.empty(steps, dtype=torch.float64)
        for step in range(steps):
            time.sleep(work_s)
            start = time.perf_counter()
            check()
            inside[step] = time.perf_counter() - start
        timings[name] = (inside.mean().item() * 1e6, inside.quantile(0.99).item() * 1e6)
    agreement.close(wait=True)
    if rank == 0:
        print(f"{steps} steps of {work_s * 1e3:g} ms, 2 gloo ranks; time inside the check per step:")
        for name, (mean, p99) in timings.items():
            print(f"  {name:26s} mean {mean:8.1f} us   p99 {p99:8.1f} us")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--work-ms", type=float, default=5.0)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_run, args=(port, args.steps, args.work_ms / 1e3), nprocs=2)


if __name__ == "__main__":
    main()
