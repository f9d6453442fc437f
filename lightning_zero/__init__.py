"""lightning-zero: ZeRO-1/2 data parallelism for Lightning.

``import lightning_zero`` registers the Trainer strategies ``"zero"`` (stage 2), ``"zero1"`` and
``"zero2"``. :class:`ShardedAdamW` also works on its own in a plain ``torch.distributed`` loop.
"""

from __future__ import annotations

from lightning_zero.config import ZeroConfig
from lightning_zero.plan_check import PlanMismatchError
from lightning_zero.sharded_adam import ShardedAdamW

__all__ = ["PlanMismatchError", "ShardedAdamW", "ZeroConfig"]
__version__ = "0.1.0"

from lightning.pytorch.strategies import StrategyRegistry as _StrategyRegistry  # noqa: E402

from lightning_zero.strategy import ZeroStrategy  # noqa: E402

ZeroStrategy.register_strategies(_StrategyRegistry)
__all__ += ["ZeroStrategy"]
