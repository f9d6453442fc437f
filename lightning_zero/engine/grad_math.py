"""Global operations on gradient shards: norms, clipping, loss-scale unscaling.

Each rank holds only its shards of the averaged gradient, so a global quantity (the norm for
clipping, whether any element overflowed) is one small control all-reduce of a per-rank partial
result. Every function here must be called on all ranks. No host synchronisation except where a
Python bool is returned (:func:`unscale`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_zero.comm.communicator import Comm
from lightning_zero.layout.buckets import BucketPlan


@torch.no_grad()
def global_norm(
    comm: Comm,
    grads: list[Tensor],
    norm_type: float,
    also: Sequence[Comm] = (),
    device: torch.device | None = None,
) -> Tensor:
    """The ``norm_type``-norm of the whole gradient, on ``device`` (default ``grads[0]``'s; float64).
    ``also``: more groups the pieces are spread over, reduced over in turn (tensor parallelism:
    ``grads`` are then this rank's pieces that count, possibly none; pipeline parallelism: the other
    stages' parameters)."""
    device = device if device is not None else grads[0].device
    infinite = math.isinf(norm_type)
    if not grads:
        local = torch.zeros((), dtype=torch.float64, device=comm.device)
    elif infinite:
        local = torch.stack([g.abs().max() for g in grads]).max().to(comm.device, torch.float64)
    else:
        local = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float64) for g in grads])
        local = local.pow(norm_type).sum().to(comm.device)
    for group in (comm, *also):
        group.wait(group.all_reduce(local, op="max" if infinite else "sum", control=True))
    total = local if infinite else local.pow(1.0 / norm_type)
    return total.to(device)


@torch.no_grad()
def clip_by_norm(
    comm: Comm,
    grads: list[Tensor],
    max_norm: float,
    norm_type: float,
    also: Sequence[Comm] = (),
    counted: list[Tensor] | None = None,
) -> Tensor:
    """Scale ``grads`` so the global norm is at most ``max_norm`` (never up); returns the norm before.
    ``also`` and ``counted``: the norm is over ``counted`` (default ``grads``), reduced over ``comm``
    and ``also`` (:func:`global_norm`)."""
    pieces = grads if counted is None else counted
    total = global_norm(comm, pieces, norm_type, also, grads[0].device)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total


@torch.no_grad()
def unscale(comm: Comm, grads: list[Tensor], scale: float | Tensor, also: Sequence[Comm] = ()) -> bool:
    """Divide ``grads`` by a loss scale; True on every rank (of ``comm``, and of the groups ``also``)
    if any rank's gradients hold inf/NaN."""
    inv_scale = 1.0 / float(scale)
    for g in grads:
        g.mul_(inv_scale)
    local = torch.stack([~torch.isfinite(g).all() for g in grads]).any().to(comm.device, torch.float32)
    for group in (comm, *also):
        group.wait(group.all_reduce(local.reshape(1), op="max", control=True))
    return bool(local.item())


def owned_params(plan: BucketPlan, rank: int, device: torch.device) -> Tensor:
    """``(pieces,)`` int64 on ``device``: the parameter index of each piece ``rank`` owns, in plan order
    (what :func:`param_norms` scatters by). Build it once per plan: a host-to-device copy of Python
    data waits for the device."""
    index = [seg.param_index for bucket in plan.buckets for seg in plan.segments(bucket, rank)]
    return torch.tensor(index, dtype=torch.int64, device=device)


@torch.no_grad()
def param_norms(
    comm: Comm,
    plan: BucketPlan,
    grads: list[Tensor],
    norm_type: float,
    owned: Tensor | None = None,
    also: tuple[Comm, Tensor] | None = None,
) -> Tensor:
    """``(num_params,)`` float64: the ``norm_type``-norm of each planned parameter's gradient.
    ``owned``: :func:`owned_params` of the plan, this rank and the device (built here if not given).
    ``also``: tensor parallelism's group and its ``(num_params,)`` mask of the parameters counted on
    this rank (:meth:`~lightning_zero.engine.tensor_parallel.TensorParallel.counted_mask`).

    Each rank sums ``|g|^p`` over the pieces it owns; one all-reduce of one value per parameter
    combines them (and one more over ``also``'s group).
    """
    values = []
    for b, bucket in enumerate(plan.buckets):
        for seg in plan.segments(bucket, comm.rank):
            piece = grads[b][seg.shard_offset : seg.shard_offset + seg.numel]
            values.append(torch.linalg.vector_norm(piece, norm_type, dtype=torch.float64))
    local = torch.zeros(len(plan.params), dtype=torch.float64, device=comm.device)
    if values:
        where = owned if owned is not None else owned_params(plan, comm.rank, comm.device)
        norms = torch.stack(values).to(comm.device)
        if math.isinf(norm_type):
            local.scatter_reduce_(0, where, norms, reduce="amax")
        else:
            local.index_add_(0, where, norms.pow(norm_type))
    op = "max" if math.isinf(norm_type) else "sum"
    comm.wait(comm.all_reduce(local, op=op, control=True))
    if also is not None:
        group, counted = also
        if op == "sum":
            local.mul_(counted)
        group.wait(group.all_reduce(local, op=op, control=True))
    return local if math.isinf(norm_type) else local.pow(1.0 / norm_type)
