"""Fits of the recipe's GPT built on the meta device, next to the same fits built eagerly.

Run on 2 ranks (``tests/distributed/test_deferred_init.py``); rank 0 saves, for every case, the
model's full state at the start of training (read through ``state_dict()``, which gathers one unit
at a time at stage 3), after 2 steps, and the engine's figures::

    python -m tests.distributed.deferred_fit --out result.pt --checkpoint DIR

Cases (each from ``seed_everything(0)``):
  * ``eager3``/``deferred3``: ``"zero3"``, the model built eagerly / under
    ``trainer.init_module(empty_init=True)`` (meta, initialized unit by unit at setup);
  * ``configure3``/``configure_ddp``: the model built in ``configure_model()`` under ``"zero3"``
    (meta) / under ``"ddp"`` (eager, the peer);
  * ``resume3``: ``deferred3``'s checkpoint (saved after its 2 steps) resumed into a model built on the
    meta device from another seed, one more step;
  * ``eager2``/``deferred2``: the same two ways at stage 2 (the whole model initialized at setup).
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from recipes.training.model import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=64, max_seq_len=16, n_layer=3, n_head=2, d_model=32, tie_embeddings=True)


class GPTLit(L.LightningModule):
    """The recipe's GPT, built in ``__init__`` or (``in_configure_model``) in ``configure_model()``."""

    def __init__(self, in_configure_model: bool = False) -> None:
        super().__init__()
        self.model: GPT | None = None if in_configure_model else GPT(CONFIG)

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(CONFIG)

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        tokens = batch[0]
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Record(L.Callback):
    """The full state at the start of training (every rank takes part in the stage-3 gathers)."""

    def __init__(self) -> None:
        self.start: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def _strategy(name: str) -> Any:
    if name == "ddp":
        return "ddp"
    stage = int(name[-1])
    units = {"min_unit_numel": 1000} if stage == 3 else {}  # blocks, embedding and head are units
    return lightning_zero.ZeroStrategy(stage=stage, bucket_cap_mb=0.01, **units)


def fit(case: str, checkpoint: str) -> dict[str, Any]:
    strategy = {"configure_ddp": "ddp"}.get(case, f"zero{case[-1]}")
    L.seed_everything(5 if case == "resume3" else 0, verbose=False)  # resumed: other initial values
    record = Record()
    trainer = L.Trainer(
        strategy=_strategy(strategy),
        devices=2,
        accelerator="cpu",
        max_steps=3 if case == "resume3" else 2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[record],
    )
    if case.startswith(("deferred", "resume")):
        with trainer.init_module(empty_init=True):
            model = GPTLit()
        assert model.model is not None and model.model.embed.weight.is_meta
    else:
        model = GPTLit(in_configure_model=case.startswith("configure"))
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randint(0, CONFIG.vocab_size, (8, CONFIG.max_seq_len), generator=generator))
    trainer.fit(model, DataLoader(data, batch_size=2), ckpt_path=checkpoint if case == "resume3" else None)
    if case == "deferred3":
        trainer.save_checkpoint(checkpoint)
    out: dict[str, Any] = {
        "start": record.start,
        "end": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }
    optimizer = getattr(trainer.strategy, "sharded_optimizer", None)
    if optimizer is not None and optimizer.engine.units is not None:
        engine = optimizer.engine
        out["peak"] = engine.init_peak_elements
        out["units"] = [sum(b.padded_numel for b in unit.buckets) for unit in engine.units.units]
    return out


def fabric_fit(case: str) -> dict[str, Any]:
    """``fabric3``/``fabric_deferred3``: the same GPT under ``ZeroFabricStrategy(stage=3)``, built eagerly /
    under ``fabric.init_module(empty_init=True)``, 2 steps of a plain loop."""
    from lightning.fabric import Fabric

    strategy = lightning_zero.ZeroFabricStrategy(stage=3, min_unit_numel=1000, bucket_cap_mb=0.01)
    fabric = Fabric(strategy=strategy, devices=2, accelerator="cpu")
    fabric.launch()
    fabric.seed_everything(0, verbose=False)
    if case == "fabric_deferred3":
        with fabric.init_module(empty_init=True):
            model = GPT(CONFIG)
        assert model.embed.weight.is_meta
    else:
        model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    generator = torch.Generator().manual_seed(1 + fabric.global_rank)
    for _ in range(2):
        tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.max_seq_len), generator=generator)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), tokens[:, 1:].reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return {"start": start, "end": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoint", required=True)
    args = parser.parse_args()
    cases = ["eager3", "deferred3", "resume3", "configure3", "configure_ddp", "eager2", "deferred2"]
    results = {case: fit(case, args.checkpoint) for case in cases}
    results.update({case: fabric_fit(case) for case in ("fabric3", "fabric_deferred3")})
    if torch.distributed.get_rank() == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
