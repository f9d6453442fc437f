"""``ZeroFabricStrategy(shard_group_size=G)`` on 4 ranks: hybrid sharding equals the same Fabric loop
under "ddp" at every stage (float64, <= 1e-10, on every rank's result: no replica group falls
behind), fp16 overflow and non-finite skips agree across groups, the traffic across groups is the
formula's, and a checkpoint moves between layouts: 2x2 -> flat 3 ranks -> 1 rank equals one
uninterrupted run within 1e-10.

Three launches of ``tests/distributed/fabric_loop.py`` (4, 3 and 1 processes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_zero.checkpoint import read_meta
from tests.distributed.test_fabric import BASE, diff, launch

FP16 = {"precision": "16-mixed-cpu", "inf_at_step": 3}  # an overflow on rank 1 only


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp: Path = tmp_path_factory.mktemp("fabric_hybrid")
    first, second = str(tmp / "hybrid.ckpt"), str(tmp / "flat3.ckpt")
    named: dict[str, dict[str, Any]] = {
        "ddp": dict(BASE, strategy="ddp"),
        "zero_2x2": dict(BASE, strategy="zero", shard_group_size=2, save_at=4, save=first),
        "zero1_4x1": dict(BASE, strategy="zero1", shard_group_size=1),
        "zero3_2x2": dict(BASE, strategy="zero3", shard_group_size=2),
        "zero_1x4": dict(BASE, strategy="zero", shard_group_size=4),
        "zero_auto": dict(BASE, strategy="zero", shard_group_size="auto"),  # one node of 4 devices: flat
        "fp16_ddp": {**FP16, "strategy": "ddp"},
        "fp16_zero_2x2": {**FP16, "strategy": "zero", "shard_group_size": 2},
        "skip_ddp": {"strategy": "ddp", "skip_step": 3},
        "skip_zero_2x2": {
            "strategy": "zero",
            "skip_nonfinite_steps": 3,
            "nan_at": [[3, 0]],
            "shard_group_size": 2,
        },
        "bad_group": {"strategy": "zero", "shard_group_size": 3, "expect_error": True},
    }
    four = dict(zip(named, launch(list(named.values()), 4, tmp), strict=True))
    (three,) = launch([dict(BASE, strategy="zero", resume=first, save_at=6, save=second)], 3, tmp)
    one_stage3, one_stage2 = launch(
        [dict(BASE, strategy="zero3", resume=second), dict(BASE, strategy="zero", resume=first)], 1, tmp
    )
    return {"four": four, "three": three, "one_stage3": one_stage3, "one_stage2": one_stage2, "first": first}


def test_every_layout_and_stage_equals_ddp_on_every_rank(runs: dict[str, Any]) -> None:
    four = runs["four"]
    layouts = {"zero_2x2": "2x2", "zero1_4x1": "4x1", "zero3_2x2": "2x2", "zero_1x4": "1x4"}
    layouts["zero_auto"] = "1x4"  # Lightning's launcher: one node of 4 devices
    for name, layout in layouts.items():
        assert four[name]["recorded"]["layout"] == layout
        assert diff(four[name], four["ddp"]) <= 1e-10, name
        for rank, value in enumerate(four[name]["every_rank_max_diff"]):  # each rank against rank 0's
            assert value == 0.0, (name, rank, value)


def test_inter_group_elements_are_the_gradient_shards_all_reduce(runs: dict[str, Any]) -> None:
    four = runs["four"]
    for name in ("zero_2x2", "zero1_4x1", "zero3_2x2"):
        recorded = four[name]["recorded"]
        assert recorded["inter_group_min"] > 0
        assert recorded["inter_group"] == [recorded["inter_group_min"]] * len(recorded["inter_group"]), name
    assert set(four["zero_1x4"]["recorded"]["inter_group"]) == {0}, "flat: nothing across groups"


def test_fp16_overflow_and_nonfinite_skips_agree_across_groups(runs: dict[str, Any]) -> None:
    four = runs["four"]
    assert four["fp16_zero_2x2"]["loss_scale"] == four["fp16_ddp"]["loss_scale"] == 2.0**9
    assert diff(four["fp16_zero_2x2"], four["fp16_ddp"]) <= 2e-2
    assert four["skip_zero_2x2"]["recorded"]["skipped"][-1] == 1
    assert diff(four["skip_zero_2x2"], four["skip_ddp"]) <= 1e-10


def test_a_shard_group_size_that_does_not_divide_the_world_is_named(runs: dict[str, Any]) -> None:
    error = runs["four"]["bad_group"]["error"]
    assert "shard_group_size=3" in error and "[1, 2, 4]" in error, error


def test_a_hybrid_checkpoint_resumes_flat_on_three_ranks_then_on_one(runs: dict[str, Any]) -> None:
    """2x2 (saved at step 4, written by the first replica group: 2 shard files) -> 3 ranks flat (steps
    4-5, saved at 6) -> 1 rank at stage 3 (steps 6-7): the uninterrupted run's parameters."""
    meta = read_meta(runs["first"])
    assert meta["world_size"] == 2, "a 2x2 checkpoint holds the shard group's 2 shards"
    assert sorted(meta["files"]) == ["model_extra.pt", "shard-00000-of-00002.pt", "shard-00001-of-00002.pt"]
    four = runs["four"]
    assert diff(runs["one_stage3"], four["zero_2x2"]) <= 1e-10
    assert diff(runs["one_stage3"], four["ddp"]) <= 1e-10
    assert diff(runs["one_stage2"], four["ddp"]) <= 1e-10
