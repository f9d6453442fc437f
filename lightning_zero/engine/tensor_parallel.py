"""Tensor parallelism in the engine: parameters that are ``DTensor``s of a 1-D tensor-parallel mesh.

A model parallelized with ``torch.distributed.tensor.parallel.parallelize_module`` has ``DTensor``
parameters: a column- or row-parallel weight holds its slice of the matrix on each rank of the
tensor-parallel group (``Shard``), a norm weight or a row-parallel bias the whole of it (``Replicate``).
The engine treats each parameter's local tensor as the parameter (:mod:`lightning_zero.layout.local`):
buckets, shards, Adam state and collectives are over the data-parallel ranks only, as Megatron's
distributed optimizer shards over data-parallel ranks. What the tensor-parallel dimension adds
(:class:`TensorParallel`):

  * **Partial gradients are summed over the tensor-parallel group before the data-parallel
    reduction.** Under sequence parallelism a replicated weight used on a sequence shard (a norm)
    gets a ``Partial(sum)`` gradient: each rank's part of the sum. FSDP2 all-reduces these over the
    tensor-parallel group before its reduce-scatter (pytorch PR #136237); here each bucket's ranges
    of such parameters are all-reduced over the tensor-parallel group just before the bucket's
    data-parallel collective (:meth:`TensorParallel.reduce_partial`; counted in ``zero/elements_sent``
    under the ``tensor`` group). Without it those weights would train on one rank's part, silently.
    A gradient is recognised as partial by its placement when it arrives (the same on every rank of
    the group: the same graph runs there).
  * **A replicated gradient of a sharded parameter** (an embedding under ``RowwiseParallel``) is cut
    to the parameter's placement locally (no communication).
  * **Norms count every element once**: the norm for clipping sums the local shards over the
    data-parallel group, then over the tensor-parallel group, counting a parameter that is replicated
    across it on tensor-parallel rank 0 only (Megatron's ``param_is_not_tensor_parallel_duplicate``).
    A loss-scale overflow check (``unscale_``) and the non-finite guard's flags
    (``skip_nonfinite_steps``) agree over both groups: one rank's non-finite slice skips the step on
    every rank.

Checkpoints record each parameter's placement and hold every tensor-parallel rank's slices
(:mod:`lightning_zero.checkpoint.tensor_layout`). Refused, with an error naming the parameter:
``DTensor`` parameters of more than one mesh or of a mesh of more than one dimension (data
parallelism is the engine's, not the mesh's), gradients whose placement the engine cannot bring to
the parameter's without communication other than the sum above, and the optimizer's torch-format
state dict (:meth:`TensorParallel.refuse`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_zero.comm.communicator import Comm
from lightning_zero.layout.buckets import Bucket, BucketPlan
from lightning_zero.layout.local import is_dtensor

Placement = tuple[str] | tuple[str, int]
"""A parameter's layout over the tensor-parallel group: ``("shard", dim)`` (each rank a slice along
``dim``, split as ``torch.chunk`` splits) or ``("replicate",)`` (every rank the whole of it)."""


def placement(param: Tensor) -> Placement:
    """The layout of ``param`` over the tensor-parallel group (a plain tensor is replicated)."""
    if not is_dtensor(param):
        return ("replicate",)
    (where,) = param.placements  # type: ignore[attr-defined]  # a 1-D mesh (checked by TensorParallel)
    return ("shard", int(where.dim)) if where.is_shard() else ("replicate",)


def bounds(length: int, size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s slice of a dimension of ``length`` split in ``size`` parts as
    ``torch.chunk`` (and ``DTensor``'s ``Shard``) split it: ``ceil(length / size)`` each, the last
    ones shorter or empty."""
    step = -(-length // size)
    start = min(rank * step, length)
    return start, min(start + step, length)


def cut(whole: Tensor, where: Placement, rank: int, size: int) -> Tensor:
    """Rank ``rank``'s slice of ``whole`` laid out as ``where`` over ``size`` ranks."""
    if where[0] != "shard" or size == 1:
        return whole
    dim = where[1]  # type: ignore[misc]
    start, end = bounds(whole.shape[dim], size, rank)
    return whole.narrow(dim, start, end - start)


def slice_of(param: Tensor, whole: Tensor) -> Tensor:
    """This rank's part of ``whole`` (a tensor of ``param``'s global shape) for the ``DTensor``
    parameter ``param``: what its local tensor holds."""
    mesh = param.device_mesh  # type: ignore[attr-defined]
    return cut(whole, placement(param), mesh.get_local_rank(), mesh.size())


class TensorParallel:
    """The tensor-parallel group of an engine's ``DTensor`` parameters (see the module docstring).

    Args:
        params: the engine's parameters in plan order (plain ones are replicated across the group).
        names: their names, for errors.
        data: the data-parallel ranks (global ranks): one of them, this one, may be in the group.

    Raises:
        ValueError: ``DTensor`` parameters on several meshes, or on a mesh of more than one dimension,
            or a tensor-parallel group sharing ranks with the data-parallel ones.
    """

    def __init__(
        self, params: Sequence[torch.nn.Parameter], names: Sequence[str], data: Sequence[int]
    ) -> None:
        meshes = {p.device_mesh for p in params if is_dtensor(p)}  # type: ignore[attr-defined]
        if len(meshes) != 1:
            raise ValueError(
                f"the tensor-parallel parameters lie on {len(meshes)} different device meshes; "
                "parallelize the whole model over one tensor-parallel mesh (e.g. mesh['tensor'])"
            )
        self.mesh = meshes.pop()
        if self.mesh.ndim != 1:
            raise ValueError(
                f"the tensor-parallel parameters lie on a {self.mesh.ndim}-D device mesh "
                f"{tuple(self.mesh.mesh_dim_names or ())}; pass parallelize_module the 1-D tensor-parallel "
                "sub-mesh (mesh['tensor']): lightning-zero shards over the data-parallel dimensions itself"
            )
        self.comm = Comm(self.mesh.get_group(), role="tensor")
        """The tensor-parallel group's communicator."""
        ranks = self.comm.backend.global_ranks()
        if len(set(ranks) & set(data)) != 1:
            raise ValueError(
                f"the tensor-parallel group (ranks {ranks}) and the data-parallel group (ranks {list(data)}) "
                f"share ranks {sorted(set(ranks) & set(data))}: a rank's tensor-parallel peers must hold "
                "the same data-parallel shard; build both from one mesh, (data, tensor), and pass "
                "parallelize_module mesh['tensor'] and the optimizer mesh['data']"
            )
        self.size = self.comm.world_size
        self.rank = self.comm.rank
        self.names = list(names)
        self.replicated = [
            not is_dtensor(p) or all(pl.is_replicate() for pl in p.placements)  # type: ignore[attr-defined]
            for p in params
        ]
        """Per parameter: the same whole values on every rank of the group."""
        self.placements = [placement(p) for p in params]
        """Per parameter: ``("shard", dim)`` or ``("replicate",)`` over the group (what a checkpoint
        records, :mod:`lightning_zero.checkpoint.tensor_layout`)."""
        self.shapes = [tuple(p.shape) for p in params]
        """Per parameter: its global (whole) shape."""
        self.partial = [False] * len(params)
        """Per parameter: its gradients arrive as partial sums over the group (seen so far)."""
        self.everyone: Comm | None = None
        """Every rank (data x tensor parallel), which saves and loads checkpoints together; set by
        :func:`lightning_zero.checkpoint.tensor_layout.checkpoint_comm` at the first checkpoint."""

    @classmethod
    def of(
        cls, params: Sequence[torch.nn.Parameter], names: Sequence[str], data: Sequence[int]
    ) -> TensorParallel | None:
        """The group of ``params`` if any is a ``DTensor``, else ``None``."""
        return cls(params, names, data) if any(is_dtensor(p) for p in params) else None

    @staticmethod
    def refuse(engine_tensor: TensorParallel | None, what: str) -> None:
        """Refuse ``what`` (a whole-state operation of the optimizer) for an engine with
        tensor-parallel parameters.

        Raises:
            NotImplementedError: ``engine_tensor`` is not ``None``.
        """
        if engine_tensor is not None:
            raise NotImplementedError(
                f"{what} does not handle tensor-parallel (DTensor) parameters: each rank of the "
                "tensor-parallel group holds a different slice of them, which a torch optimizer state "
                "dict would not tell apart. Save sharded checkpoint directories (the strategies' "
                "checkpoints, lightning_zero.checkpoint.save_sharded): they record the layout, resume on "
                "another one and consolidate to whole tensors"
            )

    def local_grad(self, index: int, param: torch.nn.Parameter, grad: Tensor) -> Tensor:
        """This rank's part of ``grad`` in the parameter's placement, noting a partial one.

        Raises:
            ValueError: a placement that needs communication other than the sum over the group.
        """
        if not is_dtensor(grad):
            return grad
        have, want = tuple(grad.placements), tuple(param.placements)  # type: ignore[attr-defined]
        if have == want:
            return grad._local_tensor  # type: ignore[attr-defined]
        if all(p.is_partial() for p in have) and self.replicated[index]:
            ops = {getattr(p, "reduce_op", "sum") for p in have}
            if ops == {"sum"}:
                self.partial[index] = True
                return grad._local_tensor  # type: ignore[attr-defined]
        elif all(p.is_replicate() for p in have):  # a local slice: no communication
            return grad.redistribute(param.device_mesh, want)._local_tensor  # type: ignore[attr-defined]
        raise ValueError(
            f"parameter {self.names[index]!r} ({want}) got a gradient placed {have}; lightning-zero takes "
            "gradients in the parameter's placement, replicated ones of a sharded parameter, and partial "
            "sums of a replicated one (sequence parallelism's norms)"
        )

    @torch.no_grad()
    def reduce_partial(self, bucket: Bucket, accum: Tensor) -> None:
        """Sum the partial gradients in ``accum`` (the bucket's buffer) over the group, in place: one
        all-reduce per run of adjacent partial parameters."""
        runs: list[list[int]] = []
        for slot in bucket.slots:
            if not self.partial[slot.param_index]:
                continue
            start, end = slot.bucket_offset, slot.bucket_offset + slot.numel
            if runs and runs[-1][1] == start:
                runs[-1][1] = end
            else:
                runs.append([start, end])
        handles = [self.comm.all_reduce(accum[a:b], what="partial gradients") for a, b in runs]
        for handle in handles:
            self.comm.wait(handle)

    def counted(self, plan: BucketPlan, shard_rank: int, shards: Sequence[Tensor]) -> list[Tensor]:
        """The pieces of ``shards`` (this rank's gradient shard of each bucket) a norm counts here:
        all of them on tensor-parallel rank 0, elsewhere those of parameters sharded across the group."""
        if self.rank == 0 or not any(self.replicated):
            return list(shards)
        return [
            shards[b][seg.shard_offset : seg.shard_offset + seg.numel]
            for b, bucket in enumerate(plan.buckets)
            for seg in plan.segments(bucket, shard_rank)
            if not self.replicated[seg.param_index]
        ]

    def counted_mask(self, device: torch.device) -> Tensor:
        """``(num_params,)`` float64: 1 for a parameter a norm counts on this rank, else 0."""
        keep = [self.rank == 0 or not r for r in self.replicated]
        return torch.tensor(keep, dtype=torch.float64, device=device)
