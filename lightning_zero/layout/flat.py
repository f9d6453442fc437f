"""Parameters as views into flat buffers (no ``torch.distributed``).

Stages 1 and 2 (:class:`FlatParams` with ``sharded=False``): after binding, every trainable
parameter's ``.data`` is a view into the flat buffer of its dtype at the place the
:class:`~lightning_zero.layout.buckets.BucketPlan` gives it. The all-gather of updated parameters
then writes straight into the parameters, and a rank's shard of a bucket is a plain slice. Padding
elements are zero and belong to no parameter.

Stage 3 (``sharded=True``): each bucket has a buffer of its own, and this rank keeps its shard of
it in a separate, persistent ``(shard_numel,)`` tensor. The full buffer exists only while its unit
is gathered: :meth:`FlatParams.free` shrinks the buffer's storage to nothing (every view of it,
including those autograd saved for backward, loses the memory) and points the parameters at
*placeholders* (:mod:`lightning_zero.layout.placeholders`): the right shape, one NaN element of each
parameter's own broadcast, so a read outside the unit's forward gives NaN instead of freed memory,
and any write into the parameter raises, naming it. :meth:`FlatParams.materialize` gives the storage
back (contents undefined until an all-gather fills it) and points the parameters at their views
again, the same storage object as before, so a tensor saved in forward sees the gathered values in
backward.

A tensor-parallel parameter (a ``DTensor``) is bound through its local shard
(:func:`~lightning_zero.layout.local.local`): the plan holds local shapes, and the views,
placeholders and ``.data`` assignments are the local tensor's.

Anything that replaces a parameter's storage afterwards (``module.to(other_device)``,
``module.half()``) unbinds it; bind after the model has its final device and dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_zero.layout.buckets import Bucket, BucketPlan
from lightning_zero.layout.local import local
from lightning_zero.layout.partition import shard_range
from lightning_zero.layout.placeholders import allow_writes, name_parameter, refuse_writes


class FlatParams:
    """Flat buffers holding the parameters of a plan: one per dtype, or one per bucket (stage 3)."""

    def __init__(
        self, params: Sequence[torch.nn.Parameter], plan: BucketPlan, rank: int, sharded: bool = False
    ) -> None:
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(
                f"all trainable parameters must be on one device, found {sorted(map(str, devices))}"
            )
        self.device = devices.pop()
        self.plan = plan
        self.rank = rank
        self.sharded = sharded
        self.params = list(params)
        self.buffers: dict[torch.dtype, Tensor] = {}
        """Stages 1 and 2: the flat buffer of each dtype."""
        self.full: list[Tensor] = []
        """Stage 3: ``(padded_numel,)`` per bucket; its storage is empty while the bucket is freed."""
        self.shards: list[Tensor] = []
        """Stage 3: ``(shard_numel,)`` per bucket, this rank's persistent shard."""
        if not sharded:
            self.buffers = {
                dtype: torch.zeros(numel, dtype=dtype, device=self.device)
                for dtype, numel in plan.buffer_numel.items()
            }
        self._views: list[Tensor] = [torch.empty(0)] * len(self.params)
        self._nan: list[Tensor] = []
        """Stage 3: ``(len(slots),)`` per bucket, one NaN element for each of its parameters."""
        self._placeholders: list[Tensor] = [torch.empty(0)] * len(self.params)
        """Stage 3: each parameter's NaN element broadcast to its shape (while its bucket is freed)."""
        self._gathered = [True] * len(plan.buckets)
        self.gathered_nbytes = 0
        """Stage 3: the bytes of the full buffers with storage now."""
        self.gathered_peak_nbytes = 0
        """Stage 3: the most :attr:`gathered_nbytes` since the last :meth:`reset_gathered_peak` (two
        integer operations per gather: the step profiler reads it)."""
        with torch.no_grad():
            for bucket in plan.buckets:
                if sharded:
                    self.full.append(torch.zeros(bucket.padded_numel, dtype=bucket.dtype, device=self.device))
                    self.gathered_nbytes += self._full_nbytes(bucket)  # freed below
                    nan = torch.full(
                        (len(bucket.slots),), float("nan"), dtype=bucket.dtype, device=self.device
                    )
                    self._nan.append(nan)
                    for j, slot in enumerate(bucket.slots):
                        shape = local(params[slot.param_index]).shape
                        self._placeholders[slot.param_index] = nan[j].expand(shape)
                        name_parameter(params[slot.param_index], plan.params[slot.param_index].name)
                flat = self.bucket(bucket)
                for slot in bucket.slots:
                    param = params[slot.param_index]
                    allow_writes(param)  # a parameter another (stage 3) FlatParams left freed
                    values = local(param)
                    view = flat[slot.bucket_offset : slot.bucket_offset + slot.numel].view_as(values)
                    view.copy_(values.detach())
                    values.data = view  # the parameter's own storage is released here
                    self._views[slot.param_index] = view
                if sharded:  # keep this rank's slice, free the rest at once: one bucket at a time
                    start, end = shard_range(bucket.padded_numel, plan.world_size, rank)
                    self.shards.append(flat[start:end].clone())
                    self.free(bucket)

    def is_bound(self, params: Sequence[torch.nn.Parameter]) -> bool:
        """Whether ``params`` (in plan order) still are the views (or placeholders) this object bound."""
        if len(params) != len(self.params):
            return False
        for param, view, placeholder, ours in zip(
            params, self._views, self._placeholders, self.params, strict=True
        ):
            if param is not ours:
                return False
            values = local(param)
            if values.data_ptr() != view.data_ptr() and not self._is_placeholder(values, placeholder):
                return False
        return True

    def bucket(self, bucket: Bucket) -> Tensor:
        """The whole bucket, padding included: ``(padded_numel,)`` (stage 3: only while gathered)."""
        if self.sharded:
            return self.full[bucket.index]
        return self.buffers[bucket.dtype][bucket.buffer_offset : bucket.buffer_offset + bucket.padded_numel]

    def shard(self, bucket: Bucket) -> Tensor:
        """This rank's shard of the bucket: ``(padded_numel // world_size,)``."""
        if self.sharded:
            return self.shards[bucket.index]
        start, end = shard_range(bucket.padded_numel, self.plan.world_size, self.rank)
        return self.bucket(bucket)[start:end]

    def is_gathered(self, bucket: Bucket) -> bool:
        """Whether the bucket's full buffer holds storage (always, below stage 3)."""
        return self._gathered[bucket.index]

    @torch.no_grad()
    def free(self, bucket: Bucket) -> None:
        """Stage 3: release the bucket's full buffer; its parameters become placeholders that refuse
        writes."""
        if not self._gathered[bucket.index]:
            return
        self.full[bucket.index].untyped_storage().resize_(0)
        self.gathered_nbytes -= self._full_nbytes(bucket)
        self._nan[bucket.index].fill_(float("nan"))  # undoes a write that got past the refusal
        for slot in bucket.slots:
            param = self.params[slot.param_index]
            local(param).data = self._placeholders[slot.param_index]
            refuse_writes(param)
        self._gathered[bucket.index] = False

    def _full_nbytes(self, bucket: Bucket) -> int:
        return bucket.padded_numel * self.full[bucket.index].element_size()

    def reset_gathered_peak(self) -> None:
        """:attr:`gathered_peak_nbytes` starts again from what is gathered now."""
        self.gathered_peak_nbytes = self.gathered_nbytes

    def materialize(self, bucket: Bucket) -> None:
        """Stage 3: storage for the bucket's full buffer again (to be filled by an all-gather), and its
        parameters pointed back at their views of it."""
        if self._gathered[bucket.index]:
            return
        full = self.full[bucket.index]
        full.untyped_storage().resize_(full.numel() * full.element_size())
        self.gathered_nbytes += self._full_nbytes(bucket)
        self.gathered_peak_nbytes = max(self.gathered_peak_nbytes, self.gathered_nbytes)
        for slot in bucket.slots:
            param = self.params[slot.param_index]
            allow_writes(param)
            local(param).data = self._views[slot.param_index]
        self._gathered[bucket.index] = True

    @torch.no_grad()
    def keep_own_slices(self, buckets: Sequence[Bucket] | None = None) -> None:
        """Stage 3: this rank's slice of the full buffer of every bucket (or of ``buckets``; each must be
        gathered) becomes its shard, e.g. after the full parameters were written on every rank alike."""
        for bucket in self.plan.buckets if buckets is None else buckets:
            start, end = shard_range(bucket.padded_numel, self.plan.world_size, self.rank)
            self.shards[bucket.index].copy_(self.full[bucket.index][start:end])

    def _is_placeholder(self, param: Tensor, placeholder: Tensor) -> bool:
        return (
            self.sharded and param.data_ptr() == placeholder.data_ptr() and param.dtype == placeholder.dtype
        )
