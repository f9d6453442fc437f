"""Pretrain the recipe's GPT in a Lightning Fabric loop with ``strategy="zero"`` (ZeRO-2).

Byte-level language modelling on this repository's own Python sources (no download). On a laptop::

    python -m examples.fabric_pretrain                          # 2 CPU processes, gloo
    python -m examples.fabric_pretrain --devices 1 --steps 20   # from the repository root
On GPUs: ``--accelerator cuda --devices 8 --precision bf16-mixed``; under SLURM,
``srun python -m examples.fabric_pretrain ...``.

The loop is what it would be under ``"ddp"``; only the strategy name differs. The checkpoint is a
directory of per-rank shards that ``fabric.load`` reads on any number of processes, the Trainer
strategy resumes from, and ``lightning-zero consolidate`` turns into one ``"ddp"``-style file.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from lightning.fabric import Fabric

import lightning_zero  # noqa: F401  # registers "zero", "zero1", "zero2", "zero3" for Fabric
from recipes.training.model import GPT, GPTConfig


def token_stream() -> torch.Tensor:
    """The bytes of this repository's Python files, as one long sequence of token ids."""
    root = Path(__file__).resolve().parents[1]
    text = b"".join(p.read_bytes() for p in sorted(root.glob("lightning_zero/*.py")))
    return torch.tensor(list(text), dtype=torch.long)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--strategy", default="zero", help='"zero" (stage 2), "zero1", or "ddp" to compare')
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch and process")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", default="outputs/fabric_pretrain.ckpt", help="checkpoint written at the end")
    args = parser.parse_args()

    fabric = Fabric(
        accelerator=args.accelerator, devices=args.devices, strategy=args.strategy, precision=args.precision
    )
    fabric.launch()
    fabric.seed_everything(1234)
    model = GPT(GPTConfig(vocab_size=256, max_seq_len=args.seq_len, n_layer=4, n_head=4, d_model=128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    model, optimizer = fabric.setup(model, optimizer)  # under "zero": the sharded twin of the AdamW
    warmup = max(1, args.steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))),
    )

    tokens = token_stream()
    generator = torch.Generator().manual_seed(fabric.global_rank)  # each process its own windows
    start = time.perf_counter()
    for step in range(args.steps):
        for micro in range(args.accum):
            offsets = torch.randint(len(tokens) - args.seq_len - 1, (args.batch_size,), generator=generator)
            window = torch.stack([tokens[o : o + args.seq_len + 1] for o in offsets.tolist()])
            x, y = fabric.to_device(window[:, :-1]), fabric.to_device(window[:, 1:])
            # non-stepping micro-batches accumulate locally: nothing is sent
            with fabric.no_backward_sync(model, enabled=micro < args.accum - 1):
                loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
                fabric.backward(loss / args.accum)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)  # global norm over every rank's shard
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if step % 10 == 0 or step == args.steps - 1:
            seen = (step + 1) * args.accum * args.batch_size * args.seq_len * fabric.world_size
            fabric.print(
                f"step {step:4d}  loss {loss.item():.3f}  lr {scheduler.get_last_lr()[0]:.2e}  "
                f"{seen / (time.perf_counter() - start):,.0f} tokens/s"
            )
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": args.steps}
    fabric.save(args.out, state)  # every process writes its own shard
    fabric.print(f"saved {args.out}")


if __name__ == "__main__":
    main()
