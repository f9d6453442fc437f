"""Shard-aware precision for the Trainer: gradient clipping and loss scaling on sharded gradients.

``ZeroStrategy`` swaps the class of the Trainer's precision plugin for a subclass with
:class:`ShardAwarePrecision` mixed in (:func:`shard_aware`), so that every precision Lightning offers
keeps its own behaviour and gains:

  * clipping by the global norm (or value) over all ranks' gradient shards (one all-reduce);
  * with a ``GradScaler`` (``16-mixed``): unscaling the shards, agreeing on overflow across ranks (the
    step is skipped on every rank or none), and torch's own scale-update rule on the scaler's state.

No state of its own; the optimizer it acts on is the strategy's :class:`~lightning_zero.ShardedAdamW`.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision

from lightning_zero.integrations.frontend import sharded_of
from lightning_zero.integrations.loss_scale import update_scale, with_mixin


class ShardAwarePrecision:
    """Mixed into the Trainer's precision plugin: clipping and loss scaling on sharded gradients.

    Clipping uses the global norm over all ranks' shards. With a ``GradScaler`` (``16-mixed``) the
    shard gradients are unscaled, overflow is agreed across ranks, the step is skipped on every
    rank or none, and the scale is updated by torch's own rule.
    """

    scaler: torch.amp.GradScaler | None

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        sharded_of(optimizer).clip_grad_norm_(float(clip_val))

    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        sharded_of(optimizer).clip_grad_value_(float(clip_val))

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        scaler = getattr(self, "scaler", None)
        if scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)  # type: ignore[misc]
        sharded = sharded_of(optimizer)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            sharded.zero_grad()  # backward was skipped: nothing to step, keep ranks in lockstep
            return None
        found_inf = sharded.unscale_(scaler.get_scale())
        self._after_closure(model, optimizer)  # type: ignore[attr-defined]  # hooks, then clipping (unscaled)
        if found_inf:
            sharded.zero_grad()
        else:
            sharded.step(**kwargs)
        update_scale(scaler, found_inf)
        return closure_result


def shard_aware(precision_cls: type[Precision]) -> type[Precision]:
    """``precision_cls`` with shard-aware clipping and loss scaling (one subclass per plugin class)."""
    return with_mixin(ShardAwarePrecision, precision_cls)
