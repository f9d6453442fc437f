"""Pure layout math for sharded flat buffers (no ``torch.distributed``, no tensors).

A *bucket* is a contiguous range of a flat buffer holding whole parameters back to back. Its length
is padded up to a multiple of ``world_size * align_numel`` so that it splits into ``world_size``
equal *shards*: rank ``r`` owns elements ``[r * shard_numel, (r + 1) * shard_numel)`` of **every**
bucket (Megatron-style). One ``reduce_scatter`` per bucket then hands each rank exactly its shard
of the averaged gradient, and one ``all_gather`` per bucket brings the updated parameters back.

Invariants (tested in ``tests/unit/test_partition.py``):
  * every element of a bucket is owned by exactly one rank;
  * shards of a bucket differ in size by zero elements (padding absorbs the remainder), so the
    partition is balanced to within one element per bucket, whatever the parameter sizes;
  * padding is below ``world_size * align_numel`` elements per bucket.

A parameter may straddle a shard boundary; :func:`shard_segments` cuts it into the pieces each
rank owns, which is what the optimizer steps and what checkpoint consolidation stitches back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def padded_numel(numel: int, world_size: int, align_numel: int) -> int:
    """Smallest multiple of ``world_size * align_numel`` that is ``>= numel`` (and > 0).

    Raises:
        ValueError: on a negative ``numel`` or a non-positive ``world_size``/``align_numel``.
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if world_size < 1 or align_numel < 1:
        raise ValueError(f"world_size and align_numel must be >= 1, got {world_size}, {align_numel}")
    unit = world_size * align_numel
    return max(unit, -(-numel // unit) * unit)


def shard_range(bucket_padded_numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of the shard ``rank`` owns inside a bucket of ``bucket_padded_numel`` elements.

    Raises:
        ValueError: if the bucket does not split evenly or ``rank`` is out of range.
    """
    if bucket_padded_numel % world_size:
        raise ValueError(f"bucket of {bucket_padded_numel} elements does not split over {world_size} ranks")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    shard_numel = bucket_padded_numel // world_size
    return rank * shard_numel, (rank + 1) * shard_numel


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives inside its bucket."""

    param_index: int
    """Index of the parameter in the plan's parameter list."""
    bucket_offset: int
    """First element of the parameter inside the bucket."""
    numel: int
    """Number of elements of the parameter."""


@dataclass(frozen=True)
class Segment:
    """The piece of one parameter that falls inside one rank's shard."""

    param_index: int
    param_start: int
    """First element of the piece inside the (flattened) parameter."""
    param_end: int
    shard_offset: int
    """Where the piece starts inside the rank's shard."""

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


def shard_segments(
    slots: Sequence[Slot], bucket_padded_numel: int, world_size: int, rank: int
) -> list[Segment]:
    """Pieces of the bucket's parameters that ``rank`` owns, in bucket order.

    Padding is never part of a segment. Parameters outside the shard give no segment.
    """
    start, end = shard_range(bucket_padded_numel, world_size, rank)
    segments = []
    for slot in slots:
        lo = max(start, slot.bucket_offset)
        hi = min(end, slot.bucket_offset + slot.numel)
        if lo < hi:
            segments.append(
                Segment(
                    param_index=slot.param_index,
                    param_start=lo - slot.bucket_offset,
                    param_end=hi - slot.bucket_offset,
                    shard_offset=lo - start,
                )
            )
    return segments
