"""The checks of :class:`~lightning_zero.optim.sharded_adam.ShardedAdamW`'s arguments and param groups,
made before any state is built (at construction, ``add_param_group`` and ``replan``), each error naming
the bad value and what is valid."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

REFUSED_FLAGS = ("differentiable", "capturable")
"""torch AdamW flags the sharded update does not run (refused when true)."""
FUSED_DEVICES = ("cpu", "cuda")
"""Where torch's fused Adam kernel runs."""


def check_hyper(*, lr: float, betas: Sequence[float], eps: float, weight_decay: float) -> None:
    """Raises ValueError naming the first hyperparameter out of its range (as ``torch.optim.AdamW``)."""
    if isinstance(lr, Tensor):
        lr = float(lr)
    if not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")


def check_group(group: dict[str, Any]) -> None:
    """Raises ValueError naming what a param group sets that the sharded update cannot run: a
    hyperparameter out of range, ``fused`` with ``foreach`` or off CPU/CUDA, a refused flag, a
    parameter that is not floating point, a tensor-valued step."""
    check_hyper(lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"])
    if group.get("fused") and group.get("foreach"):
        raise ValueError("fused=True and foreach=True cannot be set together (as in torch.optim.AdamW)")
    if group.get("fused"):
        devices = sorted({p.device.type for p in group["params"]} - set(FUSED_DEVICES))
        if devices:
            raise ValueError(
                f"fused=True needs parameters on {' or '.join(FUSED_DEVICES)}, got {devices}; "
                "pass fused=None for the foreach update"
            )
    for flag in REFUSED_FLAGS:
        if group.get(flag):
            raise ValueError(
                f"{flag}=True is not supported by lightning_zero's sharded Adam; set it to False"
            )
    for p in group["params"]:
        if not p.is_floating_point():
            raise ValueError(f"only floating point parameters can be sharded, got {p.dtype}")
    if "step" in group and isinstance(group["step"], Tensor):
        raise ValueError("tensor-valued group steps are not supported")
