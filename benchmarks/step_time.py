"""Step time, memory and traffic of zero2 / zero1 / ddp / ddp+ZeroRedundancyOptimizer, in one go.

    python benchmarks/step_time.py [--steps 20] [--layers 6] [--dim 384] [--devices 2]

Each strategy trains the same GPT-like model (>= 10M parameters, fp32) on the same random tokens
with Lightning on CPU/gloo, one process per rank with one thread each, as a separate launch. Each
rank writes its figures; this script prints them side by side:

  * median step time (steps after the first 3) and its ratio to "ddp";
  * optimizer-state bytes and gradient bytes held per rank after a step;
  * elements sent per step, counted at the collectives (DDP through a counting comm hook,
    ZeroRedundancyOptimizer's broadcasts through torch.distributed), over the minimum 2Ψ(N−1)/N;
  * peak RSS per rank (ru_maxrss).
Figures, not assertions: these machines are noisy, so compare ratios from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero

STRATEGIES = ("zero2", "zero2-5MB", "zero1", "ddp", "ddp+ZeroRedundancyOptimizer")
"""``zero2-5MB``: the same with 5 MiB buckets. At 25 MiB a 68 MB model is only three buckets, whose
transient wire buffers then hide the gradient saving; on billion-parameter models they do not."""


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(L.LightningModule):
    def __init__(self, vocab: int, dim: int, layers: int, seq: int, zero_redundancy: bool) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, max(1, dim // 64)) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.zero_redundancy = zero_redundancy
        self.step_s: list[float] = []
        self.counted = {"elements": 0}

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        mask = torch.triu(torch.full((idx.shape[1],) * 2, float("-inf")), diagonal=1)
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.zero_redundancy:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def on_fit_start(self) -> None:
        wrapper = self.trainer.strategy.model
        if isinstance(wrapper, nn.parallel.DistributedDataParallel):
            counted = self.counted

            def counting_allreduce(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations

                n = dist.get_world_size()
                counted["elements"] += 2 * bucket.buffer().numel() * (n - 1) // n
                return default_hooks.allreduce_hook(state, bucket)

            wrapper.register_comm_hook(None, counting_allreduce)
            if self.zero_redundancy:  # its parameter sync is python-level dist.broadcast
                original = dist.broadcast

                def counting_broadcast(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                    counted["elements"] += (
                        tensor.numel() * (dist.get_world_size() - 1) // dist.get_world_size()
                    )
                    return original(tensor, *args, **kwargs)

                dist.broadcast = counting_broadcast

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._t0 = time.perf_counter()
        self.counted["elements"] = 0
        opt = getattr(self.trainer.strategy, "sharded_optimizer", None)
        if opt is not None:
            opt.comm.stats.reset()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.step_s.append(time.perf_counter() - self._t0)

    def on_train_end(self) -> None:  # before the strategy tears the sharded optimizer down
        self.figures = optimizer_and_grad_bytes(self.trainer, self)


def optimizer_and_grad_bytes(trainer: L.Trainer, model: GPT) -> tuple[int, int, int]:
    """(optimizer state bytes, gradient bytes, elements sent in the last step) on this rank."""
    opt = getattr(trainer.strategy, "sharded_optimizer", None)
    if opt is not None:
        grads = sum(g.numel() * g.element_size() for g in opt.reducer.grad_shards)
        return opt.shards.nbytes(), grads, opt.comm.stats.elements_sent
    inner = trainer.optimizers[0]
    inner = getattr(inner, "optim", inner)  # ZeroRedundancyOptimizer keeps the local optimizer in .optim
    state = sum(
        t.numel() * t.element_size()
        for s in inner.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.ndim > 0
    )
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    return state, grads, model.counted["elements"]


def run_one(name: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.steps * args.batch * args.devices, args.seq + 1), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    model = GPT(args.vocab, args.dim, args.layers, args.seq, zero_redundancy=name.endswith("Optimizer"))
    strategy: Any = "ddp" if name.startswith("ddp") else name
    if name.startswith("zero"):
        cap = 5.0 if name.endswith("5MB") else args.bucket_cap_mb
        strategy = lightning_zero.ZeroStrategy(stage=int(name[4]), bucket_cap_mb=cap)
    trainer = L.Trainer(
        strategy=strategy,
        devices=args.devices,
        accelerator="cpu",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=args.batch))
    state_b, grad_b, sent = model.figures
    figures = {
        "step_s": model.step_s[3:],
        "opt_state_bytes": state_b,
        "grad_bytes": grad_b,
        "elements_sent": sent,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "params": sum(p.numel() for p in model.parameters()),
    }
    Path(args.out, f"{name}.round{args.round}.rank{trainer.global_rank}.json").write_text(json.dumps(figures))


def report(args: argparse.Namespace) -> None:
    rows = {}
    for name in STRATEGIES:
        rows[name] = [
            json.loads(Path(args.out, f"{name}.round{k}.rank{r}.json").read_text())
            for k in range(args.rounds)
            for r in range(args.devices)
        ]
    params = rows["ddp"][0]["params"]
    n = args.devices
    minimum = 2 * params * (n - 1) // n
    ddp_median = statistics.median(s for r in rows["ddp"] for s in r["step_s"])
    print(
        f"\nGPT {params / 1e6:.1f}M params, {n} ranks x 1 thread, gloo, fp32, batch {args.batch}x{args.seq} "
        f"per rank, {args.steps} steps x {args.rounds} rounds, strategies interleaved (median of steps 4..)\n"
    )
    header = (
        f"{'strategy':<30}{'step s':>8}{'vs ddp':>8}{'opt state MB':>14}{'grads MB':>10}"
        f"{'sent/step':>12}{'vs min':>8}{'peak RSS MB':>13}"
    )
    print(header)
    print("-" * len(header))
    for name, ranks in rows.items():
        med = statistics.median(s for r in ranks for s in r["step_s"])
        r0 = ranks[0]
        rss = max(r["peak_rss_mb"] for r in ranks)
        print(
            f"{name:<30}{med:>8.3f}{med / ddp_median:>8.2f}{r0['opt_state_bytes'] / 2**20:>14.1f}"
            f"{r0['grad_bytes'] / 2**20:>10.1f}{r0['elements_sent'] / 1e6:>11.2f}M"
            f"{r0['elements_sent'] / minimum:>8.2f}{rss:>13.0f}"
        )
    print(f"\nminimum elements sent per rank and step: 2Ψ(N−1)/N = {minimum / 1e6:.2f}M")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument(
        "--bucket-cap-mb", type=float, default=25.0, help="for zero1/zero2 (DDP keeps its 25)"
    )
    parser.add_argument("--out", default="benchmarks/results/step_time")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every strategy, interleaved")
    parser.add_argument("--only", choices=STRATEGIES, help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only:
        run_one(args.only, args)
        return
    Path(args.out).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in range(args.rounds):
        for name in STRATEGIES:
            print(f"round {k + 1}/{args.rounds}: {name} ...", flush=True)
            proc = subprocess.run(
                [sys.executable, *sys.argv, "--only", name, "--round", str(k)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            if proc.returncode:
                sys.exit(f"{name} failed:\n{proc.stderr[-4000:]}")
    report(args)


if __name__ == "__main__":
    main()
