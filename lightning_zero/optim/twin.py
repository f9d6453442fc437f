"""The sharded twin of a user's ``torch.optim.Adam``/``AdamW``, shared by the Trainer and Fabric strategies.

The twin is a :class:`~lightning_zero.ShardedAdamW` subclass named like the user's class (what
Lightning derives from the class name, ``LearningRateMonitor``'s ``lr-AdamW/pg1``, is then what
``"ddp"`` shows). It takes over the user's param-group dicts, so LR schedulers built on the original
keep driving it; :func:`repoint_scheduler` also points each scheduler (and the children of
``SequentialLR``/``ChainedScheduler``) at the twin.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lightning_zero.comm.groups import CommGroups
from lightning_zero.config import ZeroConfig
from lightning_zero.optim.sharded_adam import ShardedAdamW

_TWINS: dict[type, type[ShardedAdamW]] = {}


def twin_class(optimizer_cls: type) -> type[ShardedAdamW]:
    """A ``ShardedAdamW`` subclass named like ``optimizer_cls`` (one per class)."""
    if optimizer_cls not in _TWINS:
        name = optimizer_cls.__name__
        _TWINS[optimizer_cls] = type(name, (ShardedAdamW,), {"__qualname__": name, "__module__": __name__})
    return _TWINS[optimizer_cls]


def make_twin(
    optimizer: torch.optim.Optimizer,
    config: ZeroConfig,
    named_parameters: Iterable[tuple[str, Any]],
    module: torch.nn.Module | None = None,
    device_mesh: Any = None,
    deferred_init: Any = None,
    pipeline_group: Any = None,
) -> ShardedAdamW:
    """The sharded twin of ``optimizer`` for a module with ``named_parameters`` (registration order);
    ``module``: the model, needed at stage 3; ``device_mesh``: hybrid sharding (a ``DeviceMesh``, or
    the :class:`~lightning_zero.comm.CommGroups` built for tensor parallelism); ``deferred_init``: a
    stage-3 model on the meta device, initialized unit by unit (see ShardedAdamW); ``pipeline_group``:
    the ranks of the other pipeline stages (``ShardedAdamW``'s).

    Must be called on all ranks (the bucket plans are compared).

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Adam``/``AdamW``.
        PlanMismatchError: the ranks do not build the same bucket plan.
    """
    named = list(named_parameters)
    groups = device_mesh if isinstance(device_mesh, CommGroups) else None  # groups built for the engine
    return twin_class(type(optimizer)).from_optimizer(
        optimizer,
        config=config,
        param_order=[p for _, p in named],
        param_names={p: n for n, p in named},
        module=module,
        device_mesh=None if groups is not None else device_mesh,
        groups=groups,
        deferred_init=deferred_init,
        pipeline_group=pipeline_group,
    )


def repoint_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Point ``scheduler`` and every scheduler it contains (``SequentialLR``, ``ChainedScheduler``)
    at ``optimizer``. The groups are shared already; this keeps torch's call-order check and any
    ``scheduler.optimizer`` reader right."""
    scheduler.optimizer = optimizer
    for child in getattr(scheduler, "_schedulers", ()):
        repoint_scheduler(child, optimizer)
