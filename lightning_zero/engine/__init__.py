"""Layer 3, the engine: gradient hooks, wire buffers, per-bucket collectives, parameter gathers,
the shard state records, re-planning and the start-up plan check, behind :class:`ShardEngine`."""

from lightning_zero.engine.engine import ShardEngine
from lightning_zero.engine.nonfinite import NonFiniteGradientError
from lightning_zero.engine.plan_check import PlanMismatchError

__all__ = ["NonFiniteGradientError", "PlanMismatchError", "ShardEngine"]
