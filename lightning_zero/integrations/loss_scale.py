"""Loss scaling on sharded gradients, shared by the Trainer's and Fabric's precision plugins.

Both strategies give their precision plugin a shard-aware mixin (:func:`with_mixin`): the plugin's
class is swapped for a subclass with the mixin in front, so every precision keeps its own behaviour.
With a ``GradScaler`` the shards are unscaled and overflow is agreed across ranks by the engine
(:meth:`~lightning_zero.engine.ShardEngine.unscale_`); :func:`update_scale` then applies torch's own
scale-update rule to the scaler's state, so the scaler checkpoints as usual. No Lightning import.
"""

from __future__ import annotations

import torch

_MIXED: dict[tuple[type, type], type] = {}


def with_mixin(mixin: type, precision_cls: type) -> type:
    """``precision_cls`` with ``mixin`` in front (one subclass per pair, named ``Zero<class>``)."""
    if issubclass(precision_cls, mixin):
        return precision_cls
    key = (mixin, precision_cls)
    if key not in _MIXED:
        _MIXED[key] = type(f"Zero{precision_cls.__name__}", (mixin, precision_cls), {})
    return _MIXED[key]


def update_scale(scaler: torch.amp.GradScaler, found_inf: bool) -> None:
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
