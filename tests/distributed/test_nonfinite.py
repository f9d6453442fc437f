"""``skip_nonfinite_steps`` on 2 and 3 gloo ranks: a NaN/inf on one rank, at one step and micro-batch,
is skipped on every rank, leaving parameters and optimizer state bit-identical to a twin that simply
skipped that step; never a hang; K skipped steps in a row raise on every rank, naming step and ranks.

One launch per world size (a module fixture, with a deadline); each test reads its own runs."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.harness import ranks, run_ranks_each
from tests.distributed.workers_nonfinite import collectives_per_step, consecutive_cases, skip_cases

DEADLINE_S = 240.0
"""A launch that hangs fails the tests instead of blocking them (the harness kills every rank)."""

# (bad rank, step, micro-batch): the twin skips that step; accumulation is on in every case
EXACT = {
    2: [
        {"stage": 1, "dtype": "float64", "accum": 2, "bad": (1, 2, 0)},
        {
            "stage": 2,
            "dtype": "float64",
            "accum": 3,
            "bad": (0, 1, 2),
            "kind": "inf_grad",
            "find_unused": False,
        },
        {
            "stage": 1,
            "dtype": "float32",
            "accum": 2,
            "bad": (0, 3, 1),
            "kind": "neg_inf_grad",
            "find_unused": False,
        },
        {"stage": 2, "dtype": "float32", "accum": 2, "bad": (1, 2, 1)},
    ],
    3: [
        {"stage": 1, "dtype": "float64", "accum": 2, "bad": (2, 2, 1), "find_unused": False},
        {"stage": 2, "dtype": "float64", "accum": 2, "bad": (1, 3, 0), "kind": "inf_grad"},
        {"stage": 1, "dtype": "float32", "accum": 3, "bad": (0, 1, 0), "kind": "neg_inf_grad"},
        {"stage": 2, "dtype": "float32", "accum": 2, "bad": (2, 2, 0), "find_unused": False},
    ],
}
# more ranks, steps (first and last), micro-batches, stages and precisions: bf16 parameters, 16-bit
# wires, every rank at once, fp16-wire sums that overflow although every rank sent finite values, and
# the int8 wire (a block holding inf/NaN arrives as NaN: detected, not hidden by a finite scale)
MATRIX = {
    2: [
        {"stage": 2, "dtype": "bfloat16", "accum": 2, "bad": (1, 0, 0)},
        {
            "stage": 1,
            "dtype": "bfloat16",
            "accum": 2,
            "bad": (0, 4, 1),
            "kind": "inf_grad",
            "find_unused": False,
        },
        {
            "stage": 2,
            "dtype": "float32",
            "accum": 2,
            "bad": (1, 2, 1),
            "kind": "neg_inf_grad",
            "reduce_dtype": "bf16",
        },
        {
            "stage": 2,
            "dtype": "float32",
            "accum": 1,
            "bad": (-1, 2, 0),
            "kind": "fp16_overflow",
            "reduce_dtype": "fp16",
        },
        {
            "stage": 1,
            "dtype": "float32",
            "accum": 2,
            "bad": (-1, 1, 1),
            "kind": "fp16_overflow",
            "reduce_dtype": "fp16",
            "find_unused": False,
        },
        {"stage": 2, "dtype": "float64", "accum": 2, "bad": (-1, 3, 1), "find_unused": False},
        {"stage": 1, "dtype": "float64", "accum": 2, "bad": None},
        {"stage": 2, "dtype": "float32", "accum": 2, "bad": (1, 2, 1), "reduce_dtype": "int8"},
        {
            "stage": 1,
            "dtype": "float32",
            "accum": 1,
            "bad": (0, 3, 0),
            "kind": "inf_grad",
            "reduce_dtype": "int8",
            "find_unused": False,
        },
    ],
    3: [
        {"stage": 2, "dtype": "bfloat16", "accum": 2, "bad": (2, 3, 1), "find_unused": False},
        {"stage": 1, "dtype": "bfloat16", "accum": 1, "bad": (1, 1, 0), "kind": "neg_inf_grad"},
        {
            "stage": 2,
            "dtype": "float32",
            "accum": 2,
            "bad": (-1, 2, 1),
            "kind": "fp16_overflow",
            "reduce_dtype": "fp16",
        },
        {"stage": 1, "dtype": "float32", "accum": 2, "bad": (-1, 0, 0), "find_unused": False},
        {"stage": 2, "dtype": "float64", "accum": 1, "bad": None, "find_unused": False},
        {
            "stage": 2,
            "dtype": "float32",
            "accum": 2,
            "bad": (2, 1, 0),
            "kind": "neg_inf_grad",
            "reduce_dtype": "int8",
        },
    ],
}
# NaN on the ranks bad_at[step]; the limit-th skipped step in a row raises (or none does)
CONSECUTIVE = {
    2: [
        {"limit": 2, "bad_at": {1: [1], 3: [1], 4: [1]}, "stage": 2, "find_unused": False},
        {"limit": 1, "bad_at": {2: [0, 1]}, "stage": 1, "find_unused": True},
        {"limit": 2, "bad_at": {1: [1], 3: [0], 5: [1]}, "stage": 2, "find_unused": True},
    ],
    3: [
        {"limit": 3, "bad_at": {2: [2], 3: [0], 4: [1]}, "stage": 2, "find_unused": True},
        {"limit": 2, "bad_at": {5: [1, 2], 6: [2]}, "stage": 1, "find_unused": False},
    ],
}
# (step, ranks, skipped so far, the run's first step) expected of each raising case; None: no raise
RAISES = {
    2: [(4, [1], 3, 3), (2, [0, 1], 1, 2), None],
    3: [(4, [1], 3, 2), (6, [2], 2, 5)],
}


@pytest.fixture(scope="module")
def runs() -> dict[str, list[Any] | RuntimeError]:
    results: dict[str, list[Any] | RuntimeError] = {}
    for world_size in (2, 3):
        calls = [
            (skip_cases, (EXACT[world_size],)),
            (skip_cases, (MATRIX[world_size],)),
            (consecutive_cases, (CONSECUTIVE[world_size],)),
            (collectives_per_step, ()),
        ]
        out = run_ranks_each(calls, world_size, timeout_s=DEADLINE_S)
        for name, result in zip(("exact", "matrix", "consecutive", "collectives"), out, strict=True):
            results[f"{name}_{world_size}"] = result
    return results


def _expected_ranks(case: dict[str, Any], world_size: int) -> list[int] | None:
    if case["bad"] is None:
        return []
    if case.get("kind") == "fp16_overflow":
        return None  # the rank that holds the overflowing element after the reduction
    return list(range(world_size)) if case["bad"][0] == -1 else [case["bad"][0]]


def _check_skipped_everywhere(case: dict[str, Any], per_rank: list[dict[str, Any]], world_size: int) -> None:
    expected = _expected_ranks(case, world_size)
    named = [r["ranks"] for r in per_rank]
    assert all(n == named[0] for n in named), (case, named)
    if expected is None:
        assert len(named[0]) == 1, (case, named)
    else:
        assert named[0] == expected, (case, named)
    for rank, result in enumerate(per_rank):
        where = (case, rank)
        assert result["skipped"] == (0 if case["bad"] is None else 1), where
        assert result["finite"], where
        assert result["moved"] > 1e-2, where  # the other steps did update
        assert result["params_equal"] and result["state_equal"], where
        if case["bad"] is not None:
            assert result["unchanged_over_bad_step"], where
            assert max(result["steps"]) == 4, where  # five steps, one skipped (the twin's counts: equal)


@pytest.mark.parametrize("world_size", [2, 3])
def test_skipped_step_is_bit_identical_to_a_twin_that_skipped_it(world_size: int, runs: dict) -> None:
    """float64 and fp32, stages 1 and 2, accumulation on, NaN or +-inf on one rank at one micro-batch,
    with and without find_unused_parameters (the flags ride on its mask, or get their own all-reduce)."""
    results = ranks(runs, f"exact_{world_size}")
    for index, case in enumerate(EXACT[world_size]):
        _check_skipped_everywhere(case, [results[r][index] for r in range(world_size)], world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_matrix_never_hangs_and_always_skips_on_every_rank(world_size: int, runs: dict) -> None:
    results = ranks(runs, f"matrix_{world_size}")
    for index, case in enumerate(MATRIX[world_size]):
        _check_skipped_everywhere(case, [results[r][index] for r in range(world_size)], world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_consecutive_skips_raise_on_every_rank_naming_step_and_ranks(world_size: int, runs: dict) -> None:
    results = ranks(runs, f"consecutive_{world_size}")
    for index, (case, expected) in enumerate(zip(CONSECUTIVE[world_size], RAISES[world_size], strict=True)):
        for rank in range(world_size):
            result, where = results[rank][index], (case, rank)
            if expected is None:
                assert result["message"] is None, where
                assert result["skipped"] == len(case["bad_at"]), where
                continue
            step, bad, skipped, first = expected
            assert (result["step"], result["ranks"], result["skipped"]) == (step, bad, skipped), where
            assert f"optimizer step {step} on rank(s) {', '.join(map(str, bad))}" in result["message"], where
            assert f"skip_nonfinite_steps={case['limit']}" in result["message"], where
            if first != step:
                assert f"(steps {first} to {step})" in result["message"], where
            assert result["unchanged"], where  # the state before the run of skipped steps
            assert not result["idle_after"], where  # the gradients were dropped


@pytest.mark.parametrize("world_size", [2, 3])
def test_one_small_control_collective_per_step_at_most(world_size: int, runs: dict) -> None:
    """The flags ride on find_unused_parameters' mask (no extra collective), take one small
    all-reduce otherwise, and none after ``unscale_`` found every shard finite."""
    for counts in ranks(runs, f"collectives_{world_size}"):
        for unscale in (False, True):
            on = counts[f"unused=True,unscale={unscale},guard=True"]
            assert on == counts[f"unused=True,unscale={unscale},guard=False"], counts
        assert (
            counts["unused=False,unscale=False,guard=True"]
            == counts["unused=False,unscale=False,guard=False"] + 1
        )
        assert (
            counts["unused=False,unscale=True,guard=True"] == counts["unused=False,unscale=True,guard=False"]
        )
