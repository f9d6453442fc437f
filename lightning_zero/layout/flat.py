"""Parameters as views into one flat buffer per dtype (no ``torch.distributed``).

After :class:`FlatParams` binds them, every trainable parameter's ``.data`` is a view into the flat
buffer of its dtype at the place the :class:`~lightning_zero.buckets.BucketPlan` gives it. The
all-gather of updated parameters then writes straight into the parameters, and a rank's shard of
a bucket is a plain slice. Padding elements are zero and belong to no parameter.

Anything that replaces a parameter's storage afterwards (``module.to(other_device)``,
``module.half()``) unbinds it; bind after the model has its final device and dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_zero.layout.buckets import Bucket, BucketPlan
from lightning_zero.layout.partition import shard_range


class FlatParams:
    """Flat buffers holding the parameters of a plan, one per dtype."""

    def __init__(self, params: Sequence[torch.nn.Parameter], plan: BucketPlan, rank: int) -> None:
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(
                f"all trainable parameters must be on one device, found {sorted(map(str, devices))}"
            )
        self.device = devices.pop()
        self.plan = plan
        self.rank = rank
        self.buffers: dict[torch.dtype, Tensor] = {
            dtype: torch.zeros(numel, dtype=dtype, device=self.device)
            for dtype, numel in plan.buffer_numel.items()
        }
        with torch.no_grad():
            for bucket in plan.buckets:
                flat = self.bucket(bucket)
                for slot in bucket.slots:
                    param = params[slot.param_index]
                    view = flat[slot.bucket_offset : slot.bucket_offset + slot.numel]
                    view.copy_(param.detach().reshape(-1))
                    param.data = view.view_as(param)
        self._data_ptrs = [0] * len(params)
        for bucket in plan.buckets:
            for slot in bucket.slots:
                self._data_ptrs[slot.param_index] = params[slot.param_index].data_ptr()

    def is_bound(self, params: Sequence[torch.nn.Parameter]) -> bool:
        """Whether ``params`` (in plan order) still are the views this object bound."""
        return all(p.data_ptr() == ptr for p, ptr in zip(params, self._data_ptrs, strict=True))

    def bucket(self, bucket: Bucket) -> Tensor:
        """The whole bucket, padding included: ``(padded_numel,)``."""
        return self.buffers[bucket.dtype][bucket.buffer_offset : bucket.buffer_offset + bucket.padded_numel]

    def shard(self, bucket: Bucket) -> Tensor:
        """This rank's shard of the bucket: ``(padded_numel // world_size,)``."""
        start, end = shard_range(bucket.padded_numel, self.plan.world_size, self.rank)
        return self.bucket(bucket)[start:end]
