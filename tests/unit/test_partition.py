"""Partition and bucket-plan invariants, no process group."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_zero.layout.buckets import MB, ParamSpec, plan_buckets
from lightning_zero.layout.partition import Slot, padded_numel, shard_range, shard_segments


@pytest.mark.parametrize("world_size", range(1, 9))
@pytest.mark.parametrize("align", [1, 4])
def test_every_element_owned_once_and_padding_small(world_size: int, align: int) -> None:
    rng = random.Random(world_size * 31 + align)
    for _ in range(60):
        sizes = [rng.choice([1, 2, 3, 7, 64, 1000, rng.randint(1, 5000)]) for _ in range(rng.randint(1, 9))]
        slots, offset = [], 0
        for i, n in enumerate(sizes):
            slots.append(Slot(i, offset, n))
            offset += n
        padded = padded_numel(offset, world_size, align)
        assert padded % world_size == 0 and padded >= offset
        assert padded - offset < world_size * align
        owner = [-1] * offset
        shard_numels = set()
        for rank in range(world_size):
            start, end = shard_range(padded, world_size, rank)
            shard_numels.add(end - start)
            for seg in shard_segments(slots, padded, world_size, rank):
                assert 0 <= seg.shard_offset and seg.shard_offset + seg.numel <= end - start
                base = slots[seg.param_index].bucket_offset
                for e in range(base + seg.param_start, base + seg.param_end):
                    assert owner[e] == -1, "element owned twice"
                    owner[e] = rank
                    assert start <= e < end
        assert -1 not in owner, "element owned by no rank"
        assert len(shard_numels) == 1, "shards must be equal: balanced to within one element"


def test_padded_numel_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="numel"):
        padded_numel(-1, 2, 1)
    with pytest.raises(ValueError, match="world_size"):
        padded_numel(4, 0, 1)
    with pytest.raises(ValueError, match="rank 3"):
        shard_range(6, 3, 3)


CAPS = {"bucket_cap_mb": 25.0, "first_bucket_cap_mb": 1.0, "align_numel": 1}


def _specs(sizes: list[int], dtype: torch.dtype = torch.float32) -> list[ParamSpec]:
    return [ParamSpec(f"p{i}", (n,), dtype) for i, n in enumerate(sizes)]


def test_buckets_reverse_order_caps_and_first_bucket() -> None:
    quarter_mb = MB // 4 // 4  # elements of 0.25 MiB in fp32
    plan = plan_buckets(
        _specs([quarter_mb] * 12), world_size=2, bucket_cap_mb=1.0, first_bucket_cap_mb=0.5, align_numel=1
    )
    order = [s.param_index for b in plan.buckets for s in b.slots]
    assert order == list(reversed(range(12)))
    assert [len(b.slots) for b in plan.buckets] == [2, 4, 4, 2]
    for b in plan.buckets:
        assert b.padded_numel % 2 == 0 and b.padding < 2


def test_oversized_parameter_gets_its_own_bucket_and_dtypes_do_not_mix() -> None:
    specs = _specs([10, MB, 10]) + [ParamSpec("h", (5,), torch.bfloat16)]
    plan = plan_buckets(specs, world_size=3, bucket_cap_mb=1.0, first_bucket_cap_mb=1.0, align_numel=1)
    for b in plan.buckets:
        assert len({specs[s.param_index].dtype for s in b.slots}) == 1
    assert any(len(b.slots) == 1 and b.numel == MB for b in plan.buckets)
    offsets = {}
    for b in plan.buckets:
        assert b.buffer_offset == offsets.get(b.dtype, 0)
        offsets[b.dtype] = b.buffer_offset + b.padded_numel
    assert offsets == plan.buffer_numel


def test_every_parameter_in_exactly_one_bucket_over_random_plans() -> None:
    rng = random.Random(7)
    for world_size in range(1, 9):
        sizes = [rng.randint(1, 40_000) for _ in range(rng.randint(1, 30))]
        plan = plan_buckets(
            _specs(sizes), world_size, bucket_cap_mb=0.05, first_bucket_cap_mb=0.01, align_numel=1
        )
        seen = sorted(s.param_index for b in plan.buckets for s in b.slots)
        assert seen == list(range(len(sizes)))
        assert all(b.padding < world_size for b in plan.buckets)


def test_fingerprint_changes_with_plan() -> None:
    a = plan_buckets(_specs([3, 4]), 2, **CAPS)
    assert a.fingerprint() == plan_buckets(_specs([3, 4]), 2, **CAPS).fingerprint()
    assert a.fingerprint() != plan_buckets(_specs([4, 3]), 2, **CAPS).fingerprint()
    assert a.fingerprint() != plan_buckets(_specs([3, 4]), 3, **CAPS).fingerprint()


@pytest.mark.parametrize("bad", [0, -1.0])
def test_bad_caps_name_the_value(bad: float) -> None:
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        plan_buckets(_specs([3]), 2, **{**CAPS, "bucket_cap_mb": bad})
