"""Shard-aware precision: gradient clipping and loss scaling on sharded gradients.

``ZeroStrategy`` swaps the class of the Trainer's precision plugin for a subclass with
:class:`_ShardAwarePrecision` mixed in (:func:`shard_aware`), so that every precision Lightning offers
keeps its own behaviour and gains:

  * clipping by the global norm (or value) over all ranks' gradient shards (one all-reduce);
  * with a ``GradScaler`` (``16-mixed``): unscaling the shards, agreeing on overflow across ranks (the
    step is skipped on every rank or none), and torch's own scale-update rule on the scaler's state.

No state of its own; the optimizer it acts on is the strategy's :class:`~lightning_zero.ShardedAdamW`.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision

from lightning_zero.optim.sharded_adam import ShardedAdamW


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a ``LightningOptimizer`` (or ``optimizer`` itself)."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class _ShardAwarePrecision:
    """Mixed into the Trainer's precision plugin: clipping and loss scaling on sharded gradients.

    Clipping uses the global norm over all ranks' shards. With a ``GradScaler`` (``16-mixed``) the
    shard gradients are unscaled, overflow is agreed across ranks, the step is skipped on every
    rank or none, and the scale is updated by torch's own rule.
    """

    scaler: torch.amp.GradScaler | None

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        _sharded_of(optimizer).clip_grad_norm_(float(clip_val))

    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        _sharded_of(optimizer).clip_grad_value_(float(clip_val))

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        scaler = getattr(self, "scaler", None)
        if scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)  # type: ignore[misc]
        sharded = _sharded_of(optimizer)
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
        _update_scale(scaler, found_inf)
        return closure_result


def _update_scale(scaler: torch.amp.GradScaler, found_inf: bool) -> None:
    """torch's dynamic loss-scale rule (backoff on overflow, growth after ``growth_interval`` good steps),
    applied to the scaler's own state so that it checkpoints as usual."""
    scale, tracker = scaler._scale, scaler._growth_tracker  # noqa: SLF001 - no public hook for external inf checks
    if scale is None or tracker is None:
        return
    found = torch.full((1,), float(found_inf), device=scale.device)
    torch._amp_update_scale_(
        scale,
        tracker,
        found,
        scaler.get_growth_factor(),
        scaler.get_backoff_factor(),
        scaler.get_growth_interval(),
    )


def _sharded_of(optimizer: Any) -> ShardedAdamW:
    optimizer = unwrap_optimizer(optimizer)
    if not isinstance(optimizer, ShardedAdamW):
        raise TypeError(f"expected the sharded optimizer, got {type(optimizer).__name__}")
    return optimizer


_MIXED: dict[tuple[type, type], type] = {}


def with_mixin(mixin: type, precision_cls: type) -> type:
    """``precision_cls`` with ``mixin`` in front (one subclass per pair, named ``Zero<class>``)."""
    if issubclass(precision_cls, mixin):
        return precision_cls
    key = (mixin, precision_cls)
    if key not in _MIXED:
        _MIXED[key] = type(f"Zero{precision_cls.__name__}", (mixin, precision_cls), {})
    return _MIXED[key]


def shard_aware(precision_cls: type[Precision]) -> type[Precision]:
    """``precision_cls`` with shard-aware clipping and loss scaling (one subclass per plugin class)."""
    return with_mixin(_ShardAwarePrecision, precision_cls)
