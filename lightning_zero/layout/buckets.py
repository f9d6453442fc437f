"""Parameters -> buckets: the communication plan every rank must build identically.

Parameters are taken in *reverse registration order*, the order in which backward usually
produces their gradients, and packed greedily into buckets of at most ``bucket_cap_mb`` (the first
bucket is capped at ``first_bucket_cap_mb`` so that communication starts early in backward, as torch
DDP does). A bucket never mixes dtypes, nor *units* (stage 3 gathers and frees the parameters of one
unit, e.g. a transformer block, together: :mod:`lightning_zero.layout.units`); a parameter larger
than the cap gets a bucket of its own.
Each bucket is then padded (see :mod:`lightning_zero.layout.partition`) and laid out back to back in one
flat buffer per dtype.

The plan is pure data: :meth:`BucketPlan.fingerprint` is what ranks compare at start-up so that a
mismatch (different model, different ``requires_grad``, different settings) is an error, not a hang.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from lightning_zero.layout.partition import Segment, Slot, padded_numel, shard_segments

MB = 1024 * 1024


@dataclass(frozen=True)
class ParamSpec:
    """What the plan needs to know of a parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def element_size(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize


@dataclass(frozen=True)
class Bucket:
    """A contiguous range of one dtype's flat buffer, split into ``world_size`` equal shards."""

    index: int
    dtype: torch.dtype
    slots: tuple[Slot, ...]
    numel: int
    """Elements holding parameters."""
    padded_numel: int
    """``numel`` plus padding: a multiple of ``world_size * align_numel``."""
    buffer_offset: int
    """First element of the bucket in the flat buffer of its dtype."""
    unit: int = 0
    """The unit of gathering its parameters belong to (stage 3; ``0``, the root, otherwise)."""

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel


@dataclass(frozen=True)
class BucketPlan:
    """The full layout: which parameter sits where, in which bucket, owned by which rank."""

    params: tuple[ParamSpec, ...]
    buckets: tuple[Bucket, ...]
    world_size: int
    buffer_numel: dict[torch.dtype, int] = field(hash=False)
    """Total padded length of the flat buffer for each dtype."""

    def segments(self, bucket: Bucket, rank: int) -> list[Segment]:
        """Pieces of ``bucket``'s parameters owned by ``rank``."""
        return shard_segments(bucket.slots, bucket.padded_numel, self.world_size, rank)

    def shard_numel(self, bucket: Bucket) -> int:
        return bucket.padded_numel // self.world_size

    def locate(self) -> dict[int, tuple[int, Slot]]:
        """``param_index -> (bucket index, slot)``."""
        return {slot.param_index: (b.index, slot) for b in self.buckets for slot in b.slots}

    def describe(self) -> list[str]:
        """One line per bucket: readable, and what :meth:`fingerprint` hashes."""
        lines = [f"world_size={self.world_size}"]
        for b in self.buckets:
            names = ",".join(
                f"{self.params[s.param_index].name}{list(self.params[s.param_index].shape)}" for s in b.slots
            )
            unit = f" unit={b.unit}" if b.unit else ""
            lines.append(f"bucket {b.index} {b.dtype} numel={b.numel} padded={b.padded_numel}{unit}: {names}")
        return lines

    def fingerprint(self) -> int:
        """A 63-bit hash of :meth:`describe`, equal on every rank iff the plans are equal."""
        return fingerprint(self.describe())


def fingerprint(lines: Iterable[str]) -> int:
    """A 63-bit hash of ``lines`` (sha256; the same in every process, unlike ``hash``)."""
    digest = hashlib.sha256("\n".join(lines).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def plan_buckets(
    params: Sequence[ParamSpec],
    world_size: int,
    *,
    bucket_cap_mb: float,
    first_bucket_cap_mb: float,
    align_numel: int,
    units: Sequence[int] | None = None,
) -> BucketPlan:
    """Pack ``params`` (given in registration order) into buckets, last parameter first.

    Args:
        params: the trainable parameters, in registration (forward) order.
        world_size: number of ranks the buckets are split over.
        bucket_cap_mb: size cap of every bucket but the first, in MiB of parameter data.
        first_bucket_cap_mb: size cap of the first bucket (the last parameters), in MiB.
        align_numel: buckets are padded to a multiple of ``world_size * align_numel`` elements.
        units: the unit of gathering of each parameter (stage 3); a bucket holds one unit only.

    Returns:
        The plan. Buckets are numbered in the order their gradients are expected to be ready.

    Raises:
        ValueError: on a non-positive cap or world size, no parameters, or ``units`` of another length.
    """
    if bucket_cap_mb <= 0 or first_bucket_cap_mb <= 0:
        raise ValueError(
            f"bucket caps must be > 0 MB, got bucket_cap_mb={bucket_cap_mb}, "
            f"first_bucket_cap_mb={first_bucket_cap_mb}"
        )
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not params:
        raise ValueError("no trainable parameters to plan buckets for")
    if units is not None and len(units) != len(params):
        raise ValueError(f"units has {len(units)} entries for {len(params)} parameters")
    unit_of = list(units) if units is not None else [0] * len(params)
    groups: list[list[int]] = []  # parameter indices per bucket
    current_bytes = 0
    for index in reversed(range(len(params))):
        spec = params[index]
        nbytes = spec.numel * spec.element_size
        cap_mb = first_bucket_cap_mb if len(groups) <= 1 else bucket_cap_mb
        fits = bool(groups) and current_bytes + nbytes <= cap_mb * MB
        last = groups[-1][0] if groups else index
        if fits and params[last].dtype == spec.dtype and unit_of[last] == unit_of[index]:
            groups[-1].append(index)
            current_bytes += nbytes
        else:
            groups.append([index])
            current_bytes = nbytes
    return _layout(params, groups, world_size, align_numel, unit_of)


def _layout(
    params: Sequence[ParamSpec],
    groups: list[list[int]],
    world_size: int,
    align_numel: int,
    unit_of: list[int],
) -> BucketPlan:
    buckets = []
    buffer_numel: dict[torch.dtype, int] = {}
    for bucket_index, indices in enumerate(groups):
        dtype = params[indices[0]].dtype
        slots, offset = [], 0
        for i in indices:
            slots.append(Slot(param_index=i, bucket_offset=offset, numel=params[i].numel))
            offset += params[i].numel
        padded = padded_numel(offset, world_size, align_numel)
        start = buffer_numel.get(dtype, 0)
        unit = unit_of[indices[0]]
        buckets.append(Bucket(bucket_index, dtype, tuple(slots), offset, padded, start, unit))
        buffer_numel[dtype] = start + padded
    return BucketPlan(tuple(params), tuple(buckets), world_size, buffer_numel)
