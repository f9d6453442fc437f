"""Fits whose data carries its sample indices, for the exact data-resume tests.

`fit(...)` trains `TinyNet` (float64) on `IndexedSamples` through `recipes.data.resume.TrainDataResume` and
returns the final parameters plus the sample indices this rank trained, one row per micro-batch
`(global_step before the batch, index, ...)`, observed in `training_step` from the batch itself.

Run as a script it performs several fits in one launch (Lightning's launcher re-runs this file for the
other ranks) and every rank saves its results to `<--out>.rank<R>`::

    python -m tests.distributed.resume_fit --out result.pt --cases '[{"devices": 2, "steps": 4}]'
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import traceback
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from recipes.data.resume import TrainDataResume
from recipes.data.sampling import global_batch
from tests.distributed.models import TinyNet

NUM_SAMPLES = 123  # not a multiple of the global batch: each epoch drops a remainder


def expected_rows(
    steps: int, world_size: int, accum: int, batch_size: int, rank: int = 0, seed: int = 7
) -> list[list[int]]:
    """The rows `fit` should record on `rank`: global batch k of the order, micro-batch m*W + r."""
    rows = []
    for step in range(steps):
        order = global_batch(NUM_SAMPLES, world_size * accum * batch_size, seed, step).tolist()
        for micro in range(accum):
            start = (micro * world_size + rank) * batch_size
            rows.append([step, *order[start : start + batch_size]])
    return rows


class IndexedSamples(Dataset[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    """Sample i is `(i, x_i, y_i)` with fixed random float64 `x_i` (7,) and `y_i` (5,)."""

    def __init__(self, n: int = NUM_SAMPLES) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 7, generator=g, dtype=torch.float64)
        self.y = torch.randn(n, 5, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.tensor(index), self.x[index], self.y[index]


class IndexedData(L.LightningDataModule):
    """Wires `TrainDataResume` the way `recipes.data.module.PretrainDataModule` does."""

    def __init__(self, batch_size: int, seed: int = 7, num_workers: int = 0) -> None:
        super().__init__()
        self.batch_size, self.seed, self.num_workers = batch_size, seed, num_workers
        self.train_resume = TrainDataResume()

    def train_dataloader(self) -> DataLoader:
        return self.train_resume.loader(
            self.trainer,
            IndexedSamples(),
            micro_batch_size=self.batch_size,
            seed=self.seed,
            num_workers=self.num_workers,
        )

    def state_dict(self) -> dict[str, Any]:
        return self.train_resume.state_dict(self.trainer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.train_resume.load_state_dict(state_dict)


class IndexedLit(L.LightningModule):
    """TinyNet on the x -> y regression; records the sample indices of every micro-batch it trains."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # float64 before a checkpoint loads into it (on one device Lightning loads before precision setup)
        self.net = TinyNet().double()
        self.trained: list[list[int]] = []

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        index, x, y = batch
        self.trained.append([self.global_step, *index.tolist()])
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.net.parameters(), lr=3e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class SignalAt(Callback):
    """Sends this process SIGUSR1 after the batch that reaches `step` (the SLURM pre-emption signal)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)


class SaveAtBatch(Callback):
    """`trainer.save_checkpoint(path)` after micro-batch `batch_idx` of the first epoch."""

    def __init__(self, batch_idx: int, path: str) -> None:
        self.batch_idx, self.path = batch_idx, path

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if idx == self.batch_idx and trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


def fit(
    devices: int = 1,
    strategy: str = "auto",
    accum: int = 1,
    batch_size: int = 4,
    steps: int = 10,
    max_epochs: int = -1,
    save: str | None = None,
    resume: str | None = None,
    every_n_steps: int | None = None,
    every_n_epochs: int | None = None,
    checkpoint_dir: str | None = None,
    requeue_at: int | None = None,
    save_at_batch: tuple[int, str] | None = None,
    num_workers: int = 0,
    seed: int = 7,
    callbacks: Sequence[Callback] = (),
) -> dict[str, Any]:
    """One fit; `save`: `trainer.save_checkpoint` path at the end; `every_n_steps`/`every_n_epochs`: a
    ModelCheckpoint into `checkpoint_dir` (every checkpoint kept); `requeue_at`: SIGUSR1 after that step
    with the recipe's `SlurmRequeue` (saves `last.ckpt` through a `RunCheckpoint` in `checkpoint_dir`,
    then stops);
    `save_at_batch=(batch_idx, path)`: a checkpoint after that micro-batch (see `SaveAtBatch`);
    `callbacks`: more callbacks, first in order."""
    callbacks = list(callbacks)
    if every_n_steps or every_n_epochs:
        callbacks.append(
            ModelCheckpoint(
                checkpoint_dir,
                filename="{step}",
                every_n_train_steps=every_n_steps,
                every_n_epochs=every_n_epochs,
                save_top_k=-1,
            )
        )
    if requeue_at is not None:
        from recipes.training.callbacks import RunCheckpoint, SlurmRequeue

        callbacks += [SlurmRequeue(), SignalAt(requeue_at), RunCheckpoint(checkpoint_dir, save_last=True)]
    if save_at_batch is not None:
        callbacks.append(SaveAtBatch(*save_at_batch))
    trainer = L.Trainer(
        strategy=strategy,
        devices=devices,
        accelerator="cpu",
        precision="64-true",
        max_steps=steps,
        max_epochs=max_epochs,
        accumulate_grad_batches=accum,
        logger=False,
        enable_checkpointing=any(isinstance(cb, ModelCheckpoint) for cb in callbacks),
        callbacks=callbacks,
        default_root_dir=checkpoint_dir,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = IndexedLit()
    trainer.fit(model, datamodule=IndexedData(batch_size, seed, num_workers), ckpt_path=resume)
    if save:
        trainer.save_checkpoint(save)
    return {
        "rank": trainer.global_rank,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "trained": model.trained,
        "global_step": trainer.global_step,
    }


def main() -> None:
    import lightning_zero  # noqa: F401  # registers "zero"

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True, help="JSON list of keyword-argument dicts for fit()")
    args = parser.parse_args()
    results: list[Any] = []
    rank = int(os.environ.get("LOCAL_RANK", 0))
    for case in json.loads(args.cases):
        try:
            result = fit(**case)
            rank = result["rank"]
        except Exception as error:  # noqa: BLE001 - a refused resume is an expected result
            result = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        results.append(result)
    torch.save(results, f"{args.out}.rank{rank}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
