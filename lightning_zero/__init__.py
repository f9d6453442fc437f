"""lightning-zero: ZeRO-1/2 data parallelism for Lightning.

``import lightning_zero`` registers the Trainer strategies ``"zero"`` (stage 2), ``"zero1"`` and
``"zero2"``, and lets ``LightningModule.load_from_checkpoint`` read sharded checkpoint directories.
:class:`ShardedAdamW` also works on its own in a plain ``torch.distributed`` loop.
"""

from __future__ import annotations

from lightning_zero.config import ZeroConfig
from lightning_zero.grad_norm import grad_norm
from lightning_zero.plan_check import PlanMismatchError
from lightning_zero.sharded_adam import ShardedAdamW

__all__ = ["PlanMismatchError", "ShardedAdamW", "ZeroConfig", "grad_norm"]
__version__ = "0.1.0"

from lightning.pytorch.strategies import StrategyRegistry as _StrategyRegistry  # noqa: E402

from lightning_zero.strategy import ZeroStrategy  # noqa: E402

ZeroStrategy.register_strategies(_StrategyRegistry)

from lightning_zero.lightning_load import install as _install_loader  # noqa: E402

_install_loader()  # Model.load_from_checkpoint(DIR) reads sharded checkpoint directories
__all__ += ["ZeroStrategy"]

from lightning.fabric.strategies import STRATEGY_REGISTRY as _FabricRegistry  # noqa: E402

from lightning_zero.fabric import ZeroFabricStrategy  # noqa: E402

ZeroFabricStrategy.register_strategies(_FabricRegistry)  # Fabric(strategy="zero") too
__all__ += ["ZeroFabricStrategy"]
