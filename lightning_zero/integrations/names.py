"""The names the strategies are registered under, in the Trainer's and in Fabric's registry."""

from __future__ import annotations

from typing import Any

NAMES = (("zero", 2), ("zero1", 1), ("zero2", 2), ("zero3", 3))
"""``(name, stage)``: ``"zero"`` is stage 2."""


def register_names(strategy_cls: type, registry: Any, max_stage: int = 3) -> None:
    """Register every name of :data:`NAMES` up to ``max_stage`` for ``strategy_cls`` in a Trainer or
    Fabric strategy registry (names already there are left alone)."""
    for name, stage in NAMES:
        if stage <= max_stage and name not in registry:
            registry.register(
                name, strategy_cls, description=f"ZeRO stage {stage} (lightning-zero)", stage=stage
            )
