"""Each bucket's accumulation buffer for one step: where it comes from, and what it costs.

A bucket's local gradients are summed in one ``(padded_numel,)`` buffer of the master dtype from its
first gradient of the step until its collective no longer reads it. The buffer is, in this order:

  * the gradient itself (*adopted*): a parameter alone in an unpadded bucket of its master dtype
    whose ``.grad`` autograd created into an empty slot (torch stores the incoming gradient then only
    if nothing else references it, so the tensor is ours; a ``.grad`` the user assigned is copied);
  * a slot of the :class:`~lightning_zero.engine.wire_pool.WirePool`, after the reducer has freed one
    if every slot of the size class is busy (its ``free_one`` callback);
  * a buffer of its own, counted in ``allocations_outside_pool`` (e.g. across ``no_sync``
    micro-batches, where every bucket holds data).

``peak_accumulating_bytes`` is the most bytes held by such buffers at once: the whole model's
gradients under ``no_sync``, a few buckets with sharded accumulation.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_zero.config import ZeroConfig, master_dtype
from lightning_zero.engine.wire_pool import WirePool, adoptable_params
from lightning_zero.layout.buckets import Bucket, BucketPlan


class Holder(Protocol):
    """A bucket's per-step record, as far as its buffer goes."""

    bucket: Bucket
    accum: Tensor | None
    slot: tuple[tuple[torch.dtype, bool], int] | None


class AccumBuffers:
    """The accumulation buffers of one reducer's buckets (see the module docstring).

    Args:
        params: the planned parameters (the ones that may be adopted get a hook here).
        plan: their buckets.
        config: bucket caps and stage (stage 3 frees each buffer when its bucket is collected).
        device: where the buffers live.
        slots: pool slots of bucket size (the reducer's buckets in flight plus one filling).
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        plan: BucketPlan,
        config: ZeroConfig,
        device: torch.device,
        slots: int,
    ) -> None:
        self.device = device
        self._where = plan.locate()
        self._adoptable = adoptable_params(plan)
        cap_bytes = max(config.bucket_cap_mb, config.first_bucket_cap_mb) * 2**20
        adopted_buckets = {self._where[i][0] for i in self._adoptable}
        keep = config.stage < 3  # stage 3 frees each buffer when its bucket is collected (wire_pool.py)
        self.pool = WirePool(plan, slots, cap_bytes, device, adopted_buckets, keep)
        self.allocations_outside_pool = 0
        """Accumulation buffers allocated because every pool slot was busy (e.g. ``no_sync``)."""
        self.adopted = 0
        """Gradients that became their bucket's accumulation buffer (no copy, no slot)."""
        self.peak_accumulating_bytes = 0
        """The most bytes of accumulation buffers holding gradients at once."""
        self._accumulating_bytes = 0
        self._fresh: dict[int, bool] = {}  # adoptable parameter -> its .grad was None as a gradient arrived
        self.hooks: list[Any] = [
            params[i].register_hook(self._make_fresh_check(params, i)) for i in self._adoptable
        ]

    def _make_fresh_check(self, params: Sequence[torch.nn.Parameter], index: int):  # noqa: ANN202
        # weakly: a hook the parameter holds must not keep the buffers alive once the optimizer is gone
        owner, param = weakref.ref(self), weakref.ref(params[index])

        def check(grad: Tensor) -> None:
            buffers, p = owner(), param()
            if buffers is not None and p is not None:
                buffers._fresh[index] = p.grad is None

        return check

    def adopt(self, holder: Holder, index: int, grad: Tensor) -> bool:
        """Make ``grad`` (parameter ``index``'s) ``holder``'s buffer, where that is safe (see the module
        docstring); False: the caller copies it into :meth:`take`'s buffer."""
        if index not in self._adoptable or not self._fresh.pop(index, False) or holder.accum is not None:
            return False
        if not grad.is_contiguous() or grad.device != self.device:
            return False
        holder.accum = grad.detach().view(-1)
        self.adopted += 1
        self._count(holder.accum)
        return True

    def take(self, holder: Holder, free_one: Callable[[], bool]) -> Tensor:
        """``holder``'s buffer, given one if it has none (padding zeroed); ``free_one()`` frees a pool
        slot by waiting for a bucket in flight, False if it cannot."""
        if holder.accum is None:
            bucket = holder.bucket
            dtype = master_dtype(bucket.dtype)
            taken = self.pool.take(dtype, bucket.padded_numel)
            while taken is None and self.pool.serves(dtype, bucket.padded_numel) and free_one():
                taken = self.pool.take(dtype, bucket.padded_numel)
            if taken is None:  # every slot holds a bucket being filled, or no slot is this long
                holder.accum = torch.empty(bucket.padded_numel, dtype=dtype, device=self.device)
                self.allocations_outside_pool += 1
            else:
                key, index, holder.accum = taken
                holder.slot = (key, index)
            holder.accum[bucket.numel :].zero_()
            self._count(holder.accum)
        return holder.accum

    def drop(self, holder: Holder) -> None:
        """Give ``holder``'s buffer (and its pool slot) back."""
        if holder.accum is not None:
            self._accumulating_bytes -= holder.accum.numel() * holder.accum.element_size()
        if holder.slot is not None:
            self.pool.give(*holder.slot)
            holder.slot = None
        holder.accum = None

    def _count(self, accum: Tensor) -> None:
        self._accumulating_bytes += accum.numel() * accum.element_size()
        self.peak_accumulating_bytes = max(self.peak_accumulating_bytes, self._accumulating_bytes)
