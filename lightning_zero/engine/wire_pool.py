"""The pool of gradient accumulation buffers a :class:`~lightning_zero.engine.reducer.GradReducer`
draws from, and which buckets need none (their gradient is adopted as the buffer).

Measured on the 46M-parameter benchmark GPT (fp32; an embedding and an output layer of 64 MiB each,
above the 25 MB bucket cap), 2 ranks, heap in use (glibc ``mallinfo2``) of rank 0: with three slots
as long as the longest bucket, the pool held 192 MiB for the whole run; with slots sized by the cap
and those two gradients adopted it holds 75 MiB. Between steps the heap went from 795 to 651 MiB,
its peak (in backward) from 1054 to 910 MiB; ddp's peak is 1239 MiB.

Stage 3 releases what it takes (``keep=False``): a slot's buffer is allocated at the bucket's first
gradient, as long as the bucket, and freed when the bucket is collected, as FSDP2 allocates its
reduce-scatter input. Between backward passes nothing is held then, and at the peak of a stage-3
step (a large unit's backward, e.g. the output layer's, where the pool's slots would sit idle) the
slots' memory is not counted. Measured on the 135.5M GPT-2-shaped benchmark model (2 ranks, fp32,
glibc's mmap threshold fixed at 1 MiB): the kept pool held 61 MiB; releasing it lowered the
training heap peak from 1821 to 1760 MiB (peak RSS 2080 to 2020 MB; docs/performance.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_zero.config import master_dtype
from lightning_zero.layout.buckets import BucketPlan


class WirePool:
    """Reusable accumulation buffers per dtype, in two size classes, allocated on first use.

    *Regular* slots (``slots`` of them) are as long as the longest bucket within the bucket cap;
    one *large* slot is as long as the longest bucket above the cap (a single parameter larger than
    ``bucket_cap_mb``, e.g. an embedding), if there is one. Sizing every slot by the longest bucket
    would hold three embeddings' worth of buffer for the whole run. A bucket's accumulation buffer
    is a view of a free slot of its class, taken at its first gradient and given back once its
    collective is collected, so nothing is allocated per step and the transient gradient memory of
    a step is at most ``slots`` buckets plus the largest one (more only while several buckets fill
    at once, e.g. across ``no_sync`` micro-batches: those get buffers of their own). At stage 3
    (``keep=False``), where a unit's buckets fill together and launch once its backward is done, a
    class has at least twice as many slots as one unit has buckets of it: one unit filling while the
    unit before it is in flight, as FSDP2 holds one unit's unsharded gradients while the last unit's
    reduce-scatter runs.
    """

    def __init__(
        self,
        plan: BucketPlan,
        slots: int,
        cap_bytes: float,
        device: torch.device,
        skip: set[int],
        keep: bool = True,
    ) -> None:
        """``skip``: indices of buckets that never take a slot (their gradient is adopted); ``keep``:
        buffers stay allocated once taken (``False``: each is freed when given back)."""
        self.device = device
        self.keep = keep
        self._length: dict[tuple[torch.dtype, bool], int] = {}  # (dtype, large) -> slot numel
        for bucket in plan.buckets:
            if bucket.index in skip:
                continue
            dtype = master_dtype(bucket.dtype)
            large = bucket.numel * bucket.dtype.itemsize > cap_bytes
            self._length[dtype, large] = max(self._length.get((dtype, large), 0), bucket.padded_numel)
        self._slots = {key: 1 if key[1] else slots for key in self._length}
        if not keep:  # stage 3: a unit's buckets fill together while the last unit's are in flight
            for key, most in self._most_per_unit(plan, skip).items():
                self._slots[key] = max(self._slots[key], 2 * most)
        self._buffers: dict[tuple[torch.dtype, bool], list[Tensor]] = {k: [] for k in self._length}
        self._free: dict[tuple[torch.dtype, bool], list[int]] = {k: [] for k in self._length}

    def _class(self, dtype: torch.dtype, numel: int) -> tuple[torch.dtype, bool]:
        regular = self._length.get((dtype, False), 0)
        return dtype, numel > regular

    def _most_per_unit(self, plan: BucketPlan, skip: set[int]) -> dict[tuple[torch.dtype, bool], int]:
        """The most buckets of each size class one unit holds."""
        count: dict[tuple[tuple[torch.dtype, bool], int], int] = {}
        for bucket in plan.buckets:
            if bucket.index not in skip:
                key = (self._class(master_dtype(bucket.dtype), bucket.padded_numel), bucket.unit)
                count[key] = count.get(key, 0) + 1
        most: dict[tuple[torch.dtype, bool], int] = {}
        for (size_class, _), n in count.items():
            most[size_class] = max(most.get(size_class, 0), n)
        return most

    def serves(self, dtype: torch.dtype, numel: int) -> bool:
        """Whether some slot of this pool can hold ``numel`` elements of ``dtype`` (once free)."""
        return self._class(dtype, numel) in self._length

    def take(self, dtype: torch.dtype, numel: int) -> tuple[tuple[torch.dtype, bool], int, Tensor] | None:
        """A free slot of the class fitting ``numel`` (allocated on first use) as a ``(numel,)``
        view, with its key and index for :meth:`give`; ``None`` if every slot of that class is busy."""
        key = self._class(dtype, numel)
        if key not in self._length:  # only adopted buckets are this long: a buffer of its own
            return None
        length = self._length[key] if self.keep else numel
        if self._free[key]:
            index = self._free[key].pop()
            if not self.keep:
                self._buffers[key][index] = torch.empty(length, dtype=dtype, device=self.device)
        elif len(self._buffers[key]) < self._slots[key]:
            index = len(self._buffers[key])
            self._buffers[key].append(torch.empty(length, dtype=dtype, device=self.device))
        else:
            return None
        return key, index, self._buffers[key][index][:numel]

    def give(self, key: tuple[torch.dtype, bool], index: int) -> None:
        self._free[key].append(index)
        if not self.keep:
            self._buffers[key][index] = _RELEASED

    def nbytes(self) -> int:
        """Bytes the pool holds (allocated slots)."""
        return sum(b.numel() * b.element_size() for buffers in self._buffers.values() for b in buffers)


_RELEASED = torch.empty(0)
"""What a released slot holds until it is taken again."""


def adoptable_params(plan: BucketPlan) -> set[int]:
    """Parameters whose gradient can *be* their bucket's accumulation buffer: alone in a bucket
    without padding, in the master dtype (e.g. an fp32 embedding or output layer)."""
    adoptable = set()
    for bucket in plan.buckets:
        dtype = bucket.dtype
        if len(bucket.slots) == 1 and bucket.padding == 0 and master_dtype(dtype) == dtype:
            adoptable.add(bucket.slots[0].param_index)
    return adoptable
