"""lightning-zero: ZeRO data parallelism for Lightning, stages 1, 2 and 3, flat or node-aware.

``import lightning_zero`` registers the Trainer strategies ``"zero"`` (stage 2), ``"zero1"``,
``"zero2"`` and ``"zero3"`` and the same names for ``lightning.fabric.Fabric``, and lets
``LightningModule.load_from_checkpoint`` read sharded checkpoint directories — as soon as Lightning
is imported (:mod:`lightning_zero.integrations.autoregister`), so that :class:`ShardedAdamW` on its
own, in a plain ``torch.distributed`` loop, does not import Lightning. ``ZeroStrategy``,
``ZeroFabricStrategy`` and ``grad_norm`` are imported on first access. :func:`gathered` gives a
stage-3 model (or a submodule) its full parameters for a block of code; :func:`unshard` makes a model
left sharded by stage 3 a plain module again.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_zero.config import ZeroConfig
from lightning_zero.engine import NonFiniteGradientError, PlanMismatchError
from lightning_zero.engine.parameters import gathered, unshard
from lightning_zero.integrations import autoregister as _autoregister
from lightning_zero.optim import ShardedAdamW

if TYPE_CHECKING:  # the lazy names below, for type checkers and IDEs
    from lightning_zero.integrations.fabric.strategy import ZeroFabricStrategy
    from lightning_zero.integrations.trainer.grad_norm import grad_norm
    from lightning_zero.integrations.trainer.strategy import ZeroStrategy

__all__ = [
    "NonFiniteGradientError",
    "PlanMismatchError",
    "ShardedAdamW",
    "ZeroConfig",
    "ZeroFabricStrategy",
    "ZeroStrategy",
    "grad_norm",
    "gathered",
    "unshard",
]
__version__ = "0.1.0"

_LAZY = {
    "ZeroStrategy": "lightning_zero.integrations.trainer.strategy",
    "ZeroFabricStrategy": "lightning_zero.integrations.fabric.strategy",
    "grad_norm": "lightning_zero.integrations.trainer.grad_norm",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lightning_zero' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


_autoregister.install()
