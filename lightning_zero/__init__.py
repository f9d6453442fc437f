"""lightning-zero: ZeRO data parallelism for Lightning, stages 1, 2 and 3, flat or node-aware.

``import lightning_zero`` registers the Trainer strategies ``"zero"`` (stage 2), ``"zero1"``,
``"zero2"`` and ``"zero3"`` and the same names for ``lightning.fabric.Fabric``, and lets
``LightningModule.load_from_checkpoint`` read sharded checkpoint directories — as soon as Lightning
is imported (:mod:`lightning_zero.integrations.autoregister`), so that :class:`ShardedAdamW` on its
own, in a plain ``torch.distributed`` loop, does not import Lightning. :func:`gathered` gives a
stage-3 model (or a submodule) its full parameters for a block of code; :func:`unshard` makes a model
left sharded by stage 3 a plain module again.

Every public name, and every subpackage (``lightning_zero.engine``, ...), is imported on first access:
``import lightning_zero`` itself imports neither torch nor Lightning, only the registration hook, so
that ``lightning-zero estimate`` (a submodule's command) answers at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_zero._version import VERSION
from lightning_zero.integrations import autoregister as _autoregister

if TYPE_CHECKING:  # the lazy names below, for type checkers and IDEs
    from lightning_zero.config import ZeroConfig
    from lightning_zero.engine import NonFiniteGradientError, PlanMismatchError
    from lightning_zero.engine.parameters import gathered, unshard
    from lightning_zero.integrations.fabric.strategy import ZeroFabricStrategy
    from lightning_zero.integrations.trainer.grad_norm import grad_norm
    from lightning_zero.integrations.trainer.strategy import ZeroStrategy
    from lightning_zero.optim import ShardedAdamW

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
__version__ = VERSION

_LAZY = {
    "NonFiniteGradientError": "lightning_zero.engine",
    "PlanMismatchError": "lightning_zero.engine",
    "ShardedAdamW": "lightning_zero.optim",
    "ZeroConfig": "lightning_zero.config",
    "ZeroFabricStrategy": "lightning_zero.integrations.fabric.strategy",
    "ZeroStrategy": "lightning_zero.integrations.trainer.strategy",
    "gathered": "lightning_zero.engine.parameters",
    "grad_norm": "lightning_zero.integrations.trainer.grad_norm",
    "unshard": "lightning_zero.engine.parameters",
}
_SUBPACKAGES = ("checkpoint", "cli", "comm", "config", "engine", "integrations", "layout", "optim", "report")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBPACKAGES:  # ``import lightning_zero`` then ``lightning_zero.engine.x``
        value = importlib.import_module(f"lightning_zero.{name}")
    else:
        raise AttributeError(f"module 'lightning_zero' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


_autoregister.install()
