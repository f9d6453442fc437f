"""Gradient norms per parameter when gradients live in shards.

``lightning.pytorch.utilities.grad_norm`` reads ``param.grad``, which is ``None`` under the ``zero``
strategies: the averaged gradient of a parameter exists only as pieces in the ranks' gradient
shards. :func:`grad_norm` is a drop-in replacement that returns the same dictionary (same keys,
values within rounding of the summation order): each rank sums ``|g|^p`` over the pieces it owns,
one all-reduce of one value per parameter combines them. Under any other strategy it calls
Lightning's own function.
"""

from __future__ import annotations

import math

import torch
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import Tensor

from lightning_zero.engine.engine import ShardEngine
from lightning_zero.optim.sharded_adam import ShardedAdamW


@torch.no_grad()
def param_grad_norms(engine: ShardEngine, norm_type: float) -> Tensor:
    """``(num_params,)`` float64: the ``norm_type``-norm of each planned parameter's averaged gradient.

    Must be called on all ranks, after backward and before the optimizer step (one all-reduce).
    """
    engine.reducer.finalize()
    plan, rank = engine.plan, engine.comm.rank
    index, values = [], []
    for b, bucket in enumerate(plan.buckets):
        shard = engine.reducer.grad_shards[b]
        for seg in plan.segments(bucket, rank):
            piece = shard[seg.shard_offset : seg.shard_offset + seg.numel]
            index.append(seg.param_index)
            values.append(torch.linalg.vector_norm(piece, norm_type, dtype=torch.float64))
    local = torch.zeros(len(plan.params), dtype=torch.float64, device=engine.comm.device)
    if values:
        where = torch.tensor(index, device=engine.comm.device)
        norms = torch.stack(values).to(engine.comm.device)
        if math.isinf(norm_type):
            local.scatter_reduce_(0, where, norms, reduce="amax")
        else:
            local.index_add_(0, where, norms.pow(norm_type))
    op = "max" if math.isinf(norm_type) else "sum"
    engine.comm.wait(engine.comm.all_reduce(local, op=op, control=True))
    return local if math.isinf(norm_type) else local.pow(1.0 / norm_type)


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
    norms = param_grad_norms(opt.engine, norm_type)
    used = opt.reducer.finalize()  # a mask when unused parameters are tracked: those have no gradient
    position = {p: i for i, p in enumerate(opt.params_in_order)}
    out: dict[str, Tensor] = {}
    for name, param in module.named_parameters():
        i = position.get(param)
        if i is None or (used is not None and not used[i]):
            continue
        out[f"grad_{norm_type}_norm{group_separator}{name}"] = norms[i].to(param.device, param.dtype)
    if out:
        out[f"grad_{norm_type}_norm_total"] = torch.tensor(list(out.values())).norm(norm_type)
    return out
