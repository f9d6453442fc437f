"""With ``overlap_param_gather``, parameters are complete only inside their module's forward (which
waits for its buckets) until the gathers are waited for. Lightning runs user code between the
optimizer step and the next forward: callback and LightningModule hooks such as
``on_train_batch_end`` (an EMA of the weights reads them there). ``ParamReadBarrier`` is placed
first among the callbacks and waits for the gathers before such a hook runs — unless every hook
that runs at that point is known not to read parameters:

  * Lightning's own callbacks that do not (progress bars, ``LearningRateMonitor``, ``ModelSummary``,
    ``Timer``, ``EarlyStopping``, ``ThroughputMonitor``; ``ModelCheckpoint`` saves, and every save
    waits by itself);
  * any callback or LightningModule with ``reads_parameters_between_steps = False``.

Before evaluation, a checkpoint save and the end of training it always waits; re-planning, saves,
loads and teardown wait in the strategy and the optimizer themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import (
    Callback,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
    ThroughputMonitor,
    Timer,
)
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

_PARAMETER_FREE = (
    ProgressBar,
    LearningRateMonitor,
    ModelSummary,
    Timer,
    EarlyStopping,
    ThroughputMonitor,
    ModelCheckpoint,
)
HOOKS = ("on_train_batch_end", "on_train_batch_start", "on_train_epoch_end", "on_train_epoch_start")
"""The hooks that run between an optimizer step and the next forward."""


def _may_read(obj: Any, hook: str, parent: type) -> bool:
    if getattr(obj, "reads_parameters_between_steps", True) is False or isinstance(obj, _PARAMETER_FREE):
        return False
    return is_overridden(hook, obj, parent=parent)


def _hooks_that_read(trainer: pl.Trainer, this: Callback, hooks: tuple[str, ...]) -> dict[str, bool]:
    """For each of ``hooks``: whether a callback other than ``this``, or the LightningModule, may read
    parameters in it."""
    others = [cb for cb in trainer.callbacks if cb is not this]  # type: ignore[attr-defined]
    module = trainer.lightning_module
    readers = {hook: _may_read(module, hook, pl.LightningModule) for hook in hooks}
    for hook in hooks:
        readers[hook] = readers[hook] or any(_may_read(cb, hook, Callback) for cb in others)
    return readers


class ParamReadBarrier(Callback):
    """Waits for the parameter gathers before the between-step hooks that may read parameters.

    Args:
        wait: completes the gathers in flight (the strategy's sharded optimizer's).
        trainer: whose callbacks and LightningModule are inspected, once, here.
    """

    reads_parameters_between_steps = False

    def __init__(self, wait: Callable[[], None], trainer: pl.Trainer) -> None:
        self._wait = wait
        self.waits_before = _hooks_that_read(trainer, self, HOOKS)
        """For each hook, whether the barrier waits before it (what the test inspects)."""

    def _maybe_wait(self, hook: str) -> None:
        if self.waits_before[hook]:
            self._wait()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int
    ) -> None:
        self._maybe_wait("on_train_batch_start")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self._maybe_wait("on_train_batch_end")

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._maybe_wait("on_train_epoch_start")

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._maybe_wait("on_train_epoch_end")

    # phase changes are rare: wait unconditionally, before any other callback (EMA swaps weights in
    # on_validation_start, SWA writes the average in on_train_end)
    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._wait()

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._wait()

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._wait()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._wait()

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Any) -> None:
        self._wait()
