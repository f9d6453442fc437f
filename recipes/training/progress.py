"""A progress bar that reads metrics from the device only when it redraws.

Lightning converts every metric logged with `prog_bar=True` to a Python number after every batch
(`.item()` in its logger connector's `on_batch_end`), whether or not the bar redraws then, and keeps
doing so for a value logged once until the epoch ends: for a tensor on the GPU (a loss, or a Python
number `self.log` turned into one) that is a host synchronisation per step, which stalls the queue of
kernels the CPU has launched ahead. So `PretrainModule` logs `train/loss` and `TokenThroughput` logs
`tokens_per_s` without `prog_bar`, and `RefreshProgressBar` adds them (the keys of `show`) from
`trainer.callback_metrics` - still device tensors there - when it redraws, every `refresh_rate`
batches. `val/ppl` stays a `prog_bar` metric: it is read once per validation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override


class RefreshProgressBar(TQDMProgressBar):
    """`TQDMProgressBar` that also shows the `show` metrics, read at each redraw only.

    Args:
        refresh_rate: redraw every this many batches (each redraw reads the shown tensors: one sync).
        show: logged metric names to display besides those logged with `prog_bar=True`.
        **kwargs: further `TQDMProgressBar` arguments (`process_position`, `leave`).
    """

    def __init__(
        self, refresh_rate: int = 10, show: Sequence[str] = ("train/loss", "tokens_per_s"), **kwargs: Any
    ) -> None:
        super().__init__(refresh_rate=refresh_rate, **kwargs)
        self.show = tuple(show)

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        logged = trainer.callback_metrics
        shown = {key: float(logged[key]) for key in self.show if key in logged}
        return {**shown, **super().get_metrics(trainer, pl_module)}
