"""Callbacks the recipe adds to Lightning's defaults.

`RunCheckpoint` is Lightning's `ModelCheckpoint` plus one guarantee: when training stops at
`max_steps` between two `every_n_train_steps` saves, it still writes `last.ckpt` for the final step, so
`ckpt_path=last` always resumes from where the previous command ended. (The stock callback only saves
`last` at train end when it never saved anything during the run.) Saving runs on every rank, as
`trainer.save_checkpoint` requires for sharded strategies.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override


class RunCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` that also saves `last` at the end of training if the final step is unsaved."""

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.save_last and trainer.global_step > self._last_global_step_saved:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
            self._last_global_step_saved = trainer.global_step
        super().on_train_end(trainer, pl_module)
