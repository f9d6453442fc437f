"""Which between-step hooks make ``overlap_param_gather`` wait for the parameter gathers."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint

from lightning_zero.integrations.trainer.param_barrier import HOOKS, ParamReadBarrier


class ReadsWeights(Callback):
    def on_train_batch_end(self, *args: Any) -> None:  # e.g. an EMA of the weights
        pass


class MarkedFree(ReadsWeights):
    reads_parameters_between_steps = False


class Module(L.LightningModule):
    pass


class ModuleWithHook(L.LightningModule):
    def on_train_batch_start(self, *args: Any) -> None:
        pass


class ModuleMarkedFree(ModuleWithHook):
    reads_parameters_between_steps = False


def _barrier(callbacks: list[Callback], module: L.LightningModule) -> ParamReadBarrier:
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=callbacks)
    trainer.strategy.connect(module)
    return ParamReadBarrier(lambda: None, trainer)


@pytest.mark.parametrize(
    ("callbacks", "module", "waits"),
    [
        ([LearningRateMonitor(), ModelCheckpoint()], Module(), set()),
        ([ReadsWeights()], Module(), {"on_train_batch_end"}),
        ([MarkedFree()], Module(), set()),
        ([], ModuleWithHook(), {"on_train_batch_start"}),
        ([], ModuleMarkedFree(), set()),
    ],
)
def test_waits_only_before_hooks_that_may_read_parameters(
    callbacks: list[Callback], module: L.LightningModule, waits: set[str]
) -> None:
    barrier = _barrier(callbacks, module)
    assert {hook for hook in HOOKS if barrier.waits_before[hook]} == waits


def test_waits_before_every_phase_change() -> None:
    calls: list[str] = []
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    trainer.strategy.connect(Module())
    barrier = ParamReadBarrier(lambda: calls.append("wait"), trainer)
    for hook in ("on_validation_start", "on_test_start", "on_predict_start", "on_train_end"):
        getattr(barrier, hook)(trainer, trainer.lightning_module)
    barrier.on_save_checkpoint(trainer, trainer.lightning_module, {})
    assert calls == ["wait"] * 5
