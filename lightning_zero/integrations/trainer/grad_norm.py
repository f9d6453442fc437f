"""Gradient norms per parameter when gradients live in shards.

``lightning.pytorch.utilities.grad_norm`` reads ``param.grad``, which is ``None`` under the ``zero``
strategies: the averaged gradient of a parameter exists only as pieces in the ranks' gradient
shards. :func:`grad_norm` is a drop-in replacement that returns the same dictionary (same keys,
values within rounding of the summation order): each rank sums ``|g|^p`` over the pieces it owns,
one all-reduce of one value per parameter combines them. Under any other strategy it calls
Lightning's own function.
"""

from __future__ import annotations

import torch
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import Tensor

from lightning_zero.optim import ShardedAdamW


def _sharded_optimizer_of(module: torch.nn.Module) -> ShardedAdamW | None:
    trainer = getattr(module, "_trainer", None)
    strategy = getattr(trainer, "strategy", None)
    return getattr(strategy, "sharded_optimizer", None)


def grad_norm(
    module: torch.nn.Module, norm_type: float | int | str, group_separator: str = "/"
) -> dict[str, Tensor]:
    """``lightning.pytorch.utilities.grad_norm`` that also works under the ``zero`` strategies.

    Returns ``{"grad_{p}_norm/{name}": norm, ..., "grad_{p}_norm_total": norm of the norms}`` over the
    parameters that have a gradient in this step. Under ``zero`` it must be called on all ranks
    (e.g. from ``on_before_optimizer_step``, which Lightning calls on every rank).

    Raises:
        ValueError: if ``norm_type`` is not a positive number or ``"inf"``.
    """
    opt = _sharded_optimizer_of(module)
    if opt is None:
        return lightning_grad_norm(module, norm_type, group_separator)  # type: ignore[return-value]  # tensors, typed float
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    params, norms, used = opt.engine.grad_norms(norm_type)  # used: a mask when unused ones are tracked
    position = {p: i for i, p in enumerate(params)}
    out: dict[str, Tensor] = {}
    for name, param in module.named_parameters():
        i = position.get(param)
        if i is None or (used is not None and not used[i]):
            continue
        out[f"grad_{norm_type}_norm{group_separator}{name}"] = norms[i].to(param.device, param.dtype)
    if out:
        out[f"grad_{norm_type}_norm_total"] = torch.tensor(list(out.values())).norm(norm_type)
    return out
