"""The collective-order recorder's comparison (no process group): what it must call a violation, what
not, and how it names one. The recording itself runs in every multi-process test (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_zero.comm import recorder
from lightning_zero.comm.recorder import Entry, compare_ranks


def _rs(group: tuple[int, ...], numel: int = 8, role: str = "shard") -> Entry:
    return Entry(role, group, "reduce_scatter", numel, "float32")


def _ar(group: tuple[int, ...], numel: int = 4, role: str = "replicas") -> Entry:
    return Entry(role, group, "all_reduce_sum", numel, "float32")


def _hybrid(order_of_rank: dict[int, str]) -> dict[int, list[Entry]]:
    """2x2: shard groups (0, 1), (2, 3); replica groups (0, 2), (1, 3). ``"early"``: the replica
    all-reduce of bucket 0 before bucket 1's reduce-scatter; ``"late"``: after it."""
    shard = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    replicas = {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}
    out = {}
    for rank, order in order_of_rank.items():
        rs0, rs1, ar0 = _rs(shard[rank], 8), _rs(shard[rank], 6), _ar(replicas[rank], 4)
        out[rank] = [rs0, ar0, rs1] if order == "early" else [rs0, rs1, ar0]
    return out


def test_the_same_program_on_every_rank_is_consistent() -> None:
    assert compare_ranks("x", _hybrid({0: "early", 1: "early", 2: "early", 3: "early"})) == []


def test_a_timing_dependent_interleaving_is_named_with_ranks_position_and_both_entries() -> None:
    """Each group's own sequence agrees (rank 0 and 2 both issue rs, rs / ar), but rank 2 interleaves
    the groups otherwise: what a completion check that happens to be true on one rank does."""
    problems = compare_ranks("L", _hybrid({0: "early", 1: "early", 2: "late", 3: "late"}))
    assert problems == [
        "launch L, order across groups: collective 1: rank 0 issued all_reduce_sum of 4 x float32 on its "
        "replicas group, rank 2 issued reduce_scatter of 6 x float32 on its shard group"
    ]


def test_a_different_sequence_inside_one_group_is_named_with_the_group() -> None:
    ranks = {0: [_rs((0, 1), 8), _rs((0, 1), 6)], 1: [_rs((0, 1), 8), _rs((0, 1), 5)]}
    problems = compare_ranks("L", ranks)
    assert problems[0] == (
        "launch L, process group [0, 1] (shard): collective 1: rank 0 issued reduce_scatter of 6 x "
        "float32 on the shard group [0, 1], rank 1 issued reduce_scatter of 5 x float32 on the shard "
        "group [0, 1]"
    )


def test_a_rank_that_issues_fewer_collectives_is_a_violation_unless_faults_are_expected() -> None:
    ranks = {0: [_rs((0, 1)), _rs((0, 1))], 1: [_rs((0, 1))]}
    problems = compare_ranks("L", ranks)
    assert any("rank 1 issued nothing (it stopped)" in p for p in problems)
    assert compare_ranks("L", ranks, prefix_only=True) == []
    ranks[1].append(_ar((0, 1), role="shard"))  # a difference before the end still counts
    assert compare_ranks("L", ranks, prefix_only=True) != []


def test_a_background_groups_collectives_are_checked_per_group_but_not_interleaved() -> None:
    bg = ("background", (0, 1), "all_gather_object", -1, "object", False)
    ranks = {
        0: [Entry(*bg), _rs((0, 1))],
        1: [_rs((0, 1)), Entry(*bg)],
    }
    assert compare_ranks("L", ranks) == []
    ranks[1].append(Entry(*bg))
    assert compare_ranks("L", ranks) != []


def test_logs_written_by_recorders_are_read_back_per_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(recorder.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(recorder.ENV_LAUNCH, "one")
    for rank, numel in ((0, 8), (1, 9)):
        rec = recorder.recorder_for(rank, [0, 1], "world")
        assert rec is not None
        rec.record("all_gather", numel, "torch.int64")
    problems = recorder.compare_logs(tmp_path)
    assert problems[0].startswith(
        "launch one, process group [0, 1] (world): collective 0: rank 0 issued all_gather of 8 x int64"
    )
    monkeypatch.delenv(recorder.ENV_DIR)
    assert recorder.recorder_for(0, [0, 1], "world") is None


def test_two_groups_over_the_same_ranks_are_compared_apart() -> None:
    """Two process groups over ranks (0, 1) with the same role (e.g. two flat ShardedAdamW over their
    own groups): a rank that swaps which group carries which collective is caught by the groups' names."""
    a = Entry("group", (0, 1), "all_reduce_sum", 4, "float32", True, "1")
    b = Entry("group", (0, 1), "all_reduce_sum", 4, "float32", True, "2")
    c = Entry("group", (0, 1), "all_reduce_sum", 6, "float32", True, "1")
    d = Entry("group", (0, 1), "all_reduce_sum", 6, "float32", True, "2")
    assert compare_ranks("L", {0: [a, d], 1: [a, d]}) == []
    problems = compare_ranks("L", {0: [a, d], 1: [b, c]})
    assert any("process group [0, 1] (group)" in p for p in problems), problems
