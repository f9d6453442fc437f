"""Lightning's ``WeightAveraging`` callbacks (``EMAWeightAveraging``, SWA, a subclass) on the shards.

Under ``"ddp"`` a ``WeightAveraging`` callback deep-copies the whole model into an ``AveragedModel``
at setup and averages every parameter after each optimizer step. Under the zero strategies the
strategy puts :class:`ShardedWeightAveraging` in its place (in ``setup_environment``, before any
callback's ``setup``), which keeps the same schedule and semantics with the average kept on the
shards (:mod:`lightning_zero.engine.averaging`): ``1/N`` of the fp32 weights per rank at every stage,
no deep copy, no gather to update it.

What stays the user's: ``should_update`` (a subclass's override too), ``avg_fn``/``multi_avg_fn``,
``device``, ``use_buffers``, and the update counters (``_latest_update_step``/``_latest_update_epoch``
are read and written on the user's instance; the checkpoint state is saved under its ``state_key``,
so a checkpoint resumes under ``"ddp"`` and back). What it does, hook by hook, as ``WeightAveraging``:

  * after an optimizer step (``on_train_batch_end``) and at an epoch's end, when ``should_update``
    says so: one update of the average (the first one copies the weights);
  * validation during ``fit`` (the sanity check too) runs with the averaged weights, swapped in and
    out; at the end of ``fit`` the average becomes the model's weights;
  * buffers (``use_buffers=True``, the default) are averaged with the same function, kept whole on
    every rank (they are not sharded); with ``use_buffers=False`` they are copied at each update;
  * checkpoints: a sharded one holds the average in its shard files and the averaged buffers in this
    callback's state, and reads back as Lightning's layout (``state_dict`` the average,
    ``current_model_state`` the weights: :mod:`lightning_zero.checkpoint.consolidate`); a standard
    file (``sharded_checkpoint=False``) is written in that layout directly; resuming from either
    restores the weights and the average apart.

Differences: the average of 16-bit parameters is taken of their fp32 masters (more precise than
``AveragedModel``'s 16-bit copy); ``callback._average_model`` does not exist (the average lives in the
optimizer: ``trainer.strategy.sharded_optimizer``); averaging functions must be elementwise (torch's
all are).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, EMAWeightAveraging, WeightAveraging
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from lightning_zero.checkpoint.format import BUFFER_AVERAGE
from lightning_zero.checkpoint.pipeline_layout import gather_extras
from lightning_zero.engine.averaging import average_into
from lightning_zero.engine.engine import ShardEngine

_AVERAGING_ARGUMENTS = ("avg_fn", "multi_avg_fn")


class ShardedWeightAveraging(Callback):
    """The sharded stand-in for the user's ``WeightAveraging`` callback ``user``.

    Args:
        user: the callback it replaces (its ``should_update``, arguments and counters are used).
        engine: the sharded optimizer's engine during ``fit`` (``None`` outside it).
        writes_shards: whether checkpoints are written as sharded directories.

    Raises:
        ValueError: an ``AveragedModel`` argument other than ``avg_fn``/``multi_avg_fn``, or both; a
            subclass that overrides a ``WeightAveraging`` hook other than ``should_update``.
    """

    reads_parameters_between_steps = False  # it reads the optimizer's masters, not the parameters

    def __init__(
        self,
        user: WeightAveraging,
        engine: Callable[[], ShardEngine | None],
        writes_shards: Callable[[], bool],
    ) -> None:
        kwargs = dict(user._kwargs)
        unknown = sorted(set(kwargs) - set(_AVERAGING_ARGUMENTS))
        if unknown:
            raise ValueError(
                f"{type(user).__name__}: AveragedModel arguments {unknown} are not supported by the zero "
                f"strategies' sharded weight average; valid: {list(_AVERAGING_ARGUMENTS)}, device, "
                "use_buffers"
            )
        if kwargs.get("avg_fn") is not None and kwargs.get("multi_avg_fn") is not None:
            raise ValueError(f"{type(user).__name__}: give avg_fn or multi_avg_fn, not both")
        overridden = _overridden_hooks(type(user))
        if overridden:
            raise ValueError(
                f"{type(user).__name__} overrides {overridden}: the zero strategies keep the average on "
                "the shards and run WeightAveraging's own hooks in place of its AveragedModel, so only "
                "should_update may be overridden"
            )
        self.user = user
        self.avg_fn = kwargs.get("avg_fn")
        self.multi_avg_fn = kwargs.get("multi_avg_fn")
        device = user._device
        self.device = torch.device("cuda", device) if isinstance(device, int) else device
        self._engine = engine
        self._writes_shards = writes_shards
        self._buffers: dict[str, Tensor] | None = None  # averaged buffers, whole, by name

    @property
    @override
    def state_key(self) -> str:
        return self.user.state_key  # the same key as under "ddp": checkpoints resume either way

    def engine(self) -> ShardEngine | None:
        """The engine that keeps the average, during ``fit``."""
        engine = self._engine()
        return engine if engine is not None and engine.averaging else None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # before a checkpoint is restored (the zero strategies restore after setup): the buffers now;
        # on_load_checkpoint and load_state_dict replace them
        self._buffers = {name: b.detach().clone() for name, b in pl_module.named_buffers()}

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        averaged = self._averaged_buffers()  # restored ones come on the CPU: to the chosen device; of a
        self._buffers = {  # pipeline's checkpoint, every stage's: this rank keeps its stages' own
            name: averaged[name].to(self.device or b.device) for name, b in pl_module.named_buffers()
        }

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        user, step = self.user, trainer.global_step
        if step > user._latest_update_step and user.should_update(step_idx=step - 1):
            self._update(pl_module)
            user._latest_update_step = step

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        user, epoch = self.user, trainer.current_epoch
        if epoch > user._latest_update_epoch and user.should_update(epoch_idx=epoch):
            self._update(pl_module)
            user._latest_update_epoch = epoch

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = self.engine()
        if engine is None:
            return
        engine.copy_weight_average()
        with torch.no_grad():
            for name, b in pl_module.named_buffers():
                b.copy_(self._averaged_buffers()[name])

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._swap(pl_module)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._swap(pl_module)

    @override
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"latest_update_step": self.user._latest_update_step}
        if self._buffers is not None:
            state[BUFFER_AVERAGE] = {name: b.detach().cpu().clone() for name, b in self._buffers.items()}
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.user._latest_update_step = state_dict["latest_update_step"]
        if BUFFER_AVERAGE in state_dict:
            self._buffers = dict(state_dict[BUFFER_AVERAGE])

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        engine = self.engine()
        if engine is None:
            return
        saved = checkpoint.get("callbacks", {}).get(self.state_key, {})
        if BUFFER_AVERAGE in saved:  # a pipeline's: every stage's averaged buffers, where rank 0 writes them
            saved[BUFFER_AVERAGE] = gather_extras(engine, saved[BUFFER_AVERAGE])
        if self._writes_shards():
            return  # the shard files hold the average (lightning_zero.checkpoint.format.AVERAGE)
        # a standard file: WeightAveraging's layout, the averaged weights gathered as the weights are
        self._swap(pl_module)
        try:
            averaged = trainer.strategy.lightning_module_state_dict()
        finally:
            self._swap(pl_module)
        checkpoint["current_model_state"] = checkpoint["state_dict"]
        checkpoint["state_dict"] = averaged
        checkpoint["averaging_state"] = {"n_averaged": torch.tensor(engine.n_averaged)}

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        engine = self.engine()
        if engine is None:
            return
        # the restored buffers; the callback's saved state, loaded next, replaces them if it has averages
        self._buffers = {name: b.detach().clone() for name, b in pl_module.named_buffers()}
        if engine.average_loaded:
            return  # a sharded directory restored the average with the weights
        # a standard file: the model holds its state_dict now — the average in WeightAveraging's
        # layout, else the weights, where the average starts (n_averaged 0), as under "ddp"
        engine.refresh_master()
        engine.keep_weight_average(engine.average_device)
        if "current_model_state" in checkpoint and "averaging_state" in checkpoint:
            engine.n_averaged = int(checkpoint["averaging_state"]["n_averaged"])
            pl_module.load_state_dict(checkpoint["current_model_state"])
            engine.refresh_master()

    def _update(self, pl_module: pl.LightningModule) -> None:
        engine = self.engine()
        if engine is None:
            return
        names = list(self._averaged_buffers())
        current = dict(pl_module.named_buffers())
        averaged = [self._averaged_buffers()[n] for n in names]
        if self.user._use_buffers:
            theirs = [current[n] for n in names]
            average_into(averaged, theirs, engine.n_averaged, self.avg_fn, self.multi_avg_fn)
        else:
            with torch.no_grad():
                for a, n in zip(averaged, names, strict=True):
                    a.copy_(current[n])
        engine.update_weight_average(self.avg_fn, self.multi_avg_fn)

    def _swap(self, pl_module: pl.LightningModule) -> None:
        engine = self.engine()
        if engine is None:
            return
        engine.swap_weight_average()
        averaged = self._averaged_buffers()
        with torch.no_grad():
            for name, b in pl_module.named_buffers():
                held = b.detach().clone()
                b.copy_(averaged[name])
                averaged[name].copy_(held)

    def _averaged_buffers(self) -> dict[str, Tensor]:
        assert self._buffers is not None, "on_fit_start keeps the buffers"
        return self._buffers


def _overridden_hooks(cls: type) -> list[str]:
    """Methods of ``WeightAveraging`` (its hooks, its swap and copy) that a subclass redefines, apart
    from ``should_update`` and ``state_key`` (which the stand-in uses)."""
    lightning = {c for c in WeightAveraging.__mro__} | {EMAWeightAveraging}
    known = {n for n in dir(WeightAveraging) if not n.startswith("__")} - {"should_update", "state_key"}
    found = {
        name
        for c in cls.__mro__
        if c not in lightning and issubclass(c, WeightAveraging)
        for name in vars(c)
        if name in known
    }
    return sorted(found)


def replace_weight_averaging(
    callbacks: list[Callback], engine: Callable[[], ShardEngine | None], writes_shards: Callable[[], bool]
) -> list[ShardedWeightAveraging]:
    """Put a :class:`ShardedWeightAveraging` in place of each ``WeightAveraging`` in ``callbacks`` (in
    place, same position); the ones now in the list."""
    for i, callback in enumerate(callbacks):
        if isinstance(callback, WeightAveraging):
            callbacks[i] = ShardedWeightAveraging(callback, engine, writes_shards)
    return [c for c in callbacks if isinstance(c, ShardedWeightAveraging)]


def restore_weight_averaging(callbacks: list[Callback]) -> None:
    """Put each user's ``WeightAveraging`` back in its stand-in's place (at teardown): a later ``fit``
    of the same Trainer, or one whose ``configure_callbacks`` returns a fresh callback, replaces it
    again."""
    for i, callback in enumerate(callbacks):
        if isinstance(callback, ShardedWeightAveraging):
            callbacks[i] = callback.user
