"""Stage 3 gradient accumulation, the two ways: keep full-size gradient buffers between micro-batches
(``no_sync`` on all but the last, what the Trainer's ``accumulate_grad_batches`` does; the default) or
reduce-scatter every micro-batch into the 1/N gradient shard (``ZeroConfig(sharded_accumulation=True)``,
the same ``no_sync`` loop). Printed side by side, 2 gloo ranks on CPU, one thread each:

  * median optimizer-step time (``accum`` micro-batches and the step), and its ratio;
  * elements sent per optimizer step, counted at the collectives, against the schedule: every
    micro-batch gathers every unit but the root in forward and (``reshard_after_forward``) again in
    backward, ``2(Ψ - Ψ_root)(N-1)/N``; the root once per step (it stays gathered until the step);
    the gradients cost ``Ψ(N-1)/N`` once per step with ``no_sync``, once per micro-batch sharded;
  * the heap peak during the steps (glibc ``mallinfo2``, sampled every millisecond), and what sets
    it apart: ``no_sync`` holds every bucket's fp32 accumulation buffer for the window (``4Ψ`` bytes),
    the other way ``4Ψ/N`` plus the reducer's few in-flight buckets.

    python benchmarks/stage3_accumulation.py [--accum 4] [--steps 4] [--rounds 2]
    python benchmarks/stage3_accumulation.py --sweep prefetch      # K = prefetch_units 0, 1, 2

Each mode builds the same model and optimizer afresh (seed 0) and trains ``--steps`` steps on
random tokens (the first step of a mode is not timed).

Figures, not assertions: the modes alternate (A B A B ...), and ratios are what to quote.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, not another install

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.step_time import HeapPeak  # noqa: E402
from lightning_zero import ShardedAdamW, ZeroConfig  # noqa: E402

MODES = ("no_sync", "sharded_accumulation")
PREFETCH = (0, 1, 2)
"""``--sweep prefetch``: ``prefetch_units`` K (units gathered ahead of the one computing), accum 1."""


class Net(nn.Module):
    """A GPT-shaped stack: embedding, ``layers`` pre-norm blocks in a ModuleList, output layer."""

    def __init__(self, layers: int, dim: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                dim, dim // 64, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


def _modes(args: argparse.Namespace) -> list[tuple[str, int, bool]]:
    """(name, prefetch_units, sharded accumulation) of each mode the sweep compares."""
    if args.sweep == "prefetch":
        return [(f"prefetch_units={k}", k, False) for k in PREFETCH]
    return [(mode, 1, mode == "sharded_accumulation") for mode in MODES]


def _rank(rank: int, world_size: int, store: str, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    heap = HeapPeak()
    g = torch.Generator().manual_seed(rank)
    modes = _modes(args)
    figures: dict[str, dict[str, list[float]]] = {
        m: {"step_s": [], "elements": [], "heap_mb": []} for m, _, _ in modes
    }
    accum = args.accum if args.sweep == "accumulation" else 1
    layout: dict[str, int] = {}
    for _round in range(args.rounds):
        for mode, prefetch, sharded in modes:
            torch.manual_seed(0)  # the same model and optimizer for every mode
            model = Net(args.layers, args.dim, args.vocab)
            config = ZeroConfig(stage=3, prefetch_units=prefetch, sharded_accumulation=sharded)
            opt = ShardedAdamW(model.parameters(), lr=1e-4, config=config, module=model)
            engine = opt.engine
            heap.peak = 0
            for step in range(args.steps):
                engine.comm_stats.reset()
                start = time.perf_counter()
                for micro in range(accum):
                    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
                    last = micro == accum - 1
                    with opt.no_sync() if not last else nullcontext():
                        logits = model(ids[:, :-1])
                        loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
                        (loss / accum).backward()
                opt.step()
                opt.zero_grad()
                elapsed = time.perf_counter() - start
                if step >= 1:  # the first step of a mode settles allocations
                    figures[mode]["step_s"].append(elapsed)
                figures[mode]["elements"].append(engine.comm_stats.elements_sent)
            figures[mode]["heap_mb"].append(heap.peak_mb or 0.0)
            units = engine.units
            assert units is not None
            layout = {
                "root": sum(b.padded_numel for b in units.units[0].buckets),
                "padded": sum(b.padded_numel for b in engine.plan.buckets),
                "units": len(units.units),
            }
            del model, opt, engine, units
            gc.collect()
    out[rank] = {"figures": figures, **layout}
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sweep", choices=("accumulation", "prefetch"), default="accumulation")
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    world_size = 2
    with tempfile.TemporaryDirectory() as tmp:
        manager = mp.Manager()
        out = manager.dict()
        mp.spawn(_rank, args=(world_size, os.path.join(tmp, "store"), args, out), nprocs=world_size)
        results = dict(out)
    n = world_size
    first = results[0]
    psi, root = first["padded"], first["root"]
    accum = args.accum if args.sweep == "accumulation" else 1
    gathers = (root + accum * 2 * (psi - root)) * (n - 1) // n  # the root stays gathered for the window
    modes = _modes(args)
    schedule = {m: gathers + (accum if sharded else 1) * psi * (n - 1) // n for m, _, sharded in modes}
    print(
        f"stage 3, {n} ranks, {psi / 1e6:.1f}M parameters (padded), {first['units']} units, "
        f"accum {accum}, batch {args.batch}x{args.seq} per micro-batch, {args.rounds} rounds"
    )
    base = statistics.median(first["figures"][modes[0][0]]["step_s"])
    header = ("step s", 9), (f"vs {modes[0][0]}", 20), ("elements/step", 16), ("vs schedule", 13)
    print(f"{'mode':<20}" + "".join(f"{name:>{width}}" for name, width in (*header, ("heap MB r0/r1", 16))))
    for mode, _, _ in modes:
        step = statistics.median(first["figures"][mode]["step_s"])
        elements = statistics.median(first["figures"][mode]["elements"])
        heaps = "/".join(f"{max(results[r]['figures'][mode]['heap_mb']):.0f}" for r in range(n))
        print(
            f"{mode:<20}{step:>9.2f}{step / base:>20.2f}{elements:>16.0f}"
            f"{elements / schedule[mode]:>13.2f}{heaps:>16}"
        )
    if args.sweep == "accumulation":
        print(
            f"theory: no_sync holds 4Ψ = {4 * psi / 2**20:.0f} MB of fp32 gradient buffers in the window, "
            f"the other way 4Ψ/N = {4 * psi / n / 2**20:.0f} MB plus the reducer's in-flight buckets"
        )


if __name__ == "__main__":
    main()
