"""gloo's reduce-scatter and all-gather against the per-rank reduces and broadcasts that
``lightning_zero/comm/backends.py`` (``GlooSplit``) uses on gloo.

    python benchmarks/gloo_collectives.py [--ranks 2] [--sizes 1,5,25] [--repeats 20]

One process per rank, one thread each, on CPU/gloo; for each bucket size (MiB of fp32) the mean
time of: ``reduce_scatter_single`` (gloo's own), ``N`` async ``reduce`` calls (one per destination
rank), ``all_gather_single``, ``N`` async ``broadcast`` calls (one per source rank), and an
``all_reduce`` of the same bucket for scale. Figures, not assertions.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _ops(x: torch.Tensor, out: torch.Tensor, world: int) -> dict[str, Callable[[], None]]:
    n = x.numel() // world
    chunks = [x[r * n : (r + 1) * n] for r in range(world)]
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def split_reduce() -> None:
        for work in [dist.reduce(c, dst=r, async_op=True) for r, c in enumerate(chunks)]:
            work.wait()

    def split_broadcast() -> None:
        for work in [dist.broadcast(c, src=r, async_op=True) for r, c in enumerate(chunks)]:
            work.wait()

    return {
        "reduce-scatter (gloo)": lambda: reduce_scatter(out, x),
        "N reduces": split_reduce,
        "all-gather (gloo)": lambda: all_gather(x, out),
        "N broadcasts": split_broadcast,
        "all-reduce": lambda: dist.all_reduce(x),
    }


def _rank(rank: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    try:
        for mib in args.sizes:
            numel = int(mib * 2**20 / 4) // args.ranks * args.ranks
            x, out = torch.randn(numel), torch.empty(numel // args.ranks)
            row = []
            for name, op in _ops(x, out, args.ranks).items():
                for _ in range(3):
                    op()
                dist.barrier()
                start = time.perf_counter()
                for _ in range(args.repeats):
                    op()
                dist.barrier()
                row.append(f"{name} {(time.perf_counter() - start) / args.repeats * 1e3:7.2f} ms")
            if rank == 0:
                print(f"{mib:>6g} MiB: " + " | ".join(row), flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--sizes", type=lambda s: [float(v) for v in s.split(",")], default=[1.0, 5.0, 25.0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--port", type=int, default=29533)
    args = parser.parse_args()
    if args.ranks < 2 or args.repeats < 1 or any(v <= 0 for v in args.sizes):
        parser.error(
            f"need --ranks >= 2, --repeats >= 1 and sizes > 0, got {args.ranks}, {args.repeats}, {args.sizes}"
        )
    mp.spawn(_rank, args=(args,), nprocs=args.ranks)


if __name__ == "__main__":
    main()
