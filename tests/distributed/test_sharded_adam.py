"""ShardedAdamW on 1, 2 and 3 gloo ranks equals torch.optim.AdamW on the same global batch.

The runs go in one launch per world size (a module fixture); each test reads its own by name."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.distributed.harness import ranks, run_ranks_each
from tests.distributed.workers import bf16_accumulation, parity, user_grad_is_not_scratch

CASES = [
    {"stage": stage, "accum": accum, "clip": clip}
    for stage, accum, clip in itertools.product((1, 2), (1, 4), (None, 0.05))
]
AMSGRAD_CASES = [
    {"stage": 2, "accum": 2, "clip": None, "amsgrad": True},
    {"stage": 1, "accum": 1, "clip": 0.05, "overlap": False},
    {"stage": 2, "accum": 2, "clip": 0.05, "width": 12},
    {"stage": 1, "accum": 1, "clip": None, "width": 12},
]
EVERY_BACKWARD_CASES = [
    {"stage": stage, "accum": 3, "clip": 0.05, "no_sync": False, "steps": 6, "overlap": overlap}
    for stage, overlap in ((1, True), (2, False))
]
PARAM_OVERLAP_CASES = [
    {"stage": stage, "accum": accum, "clip": clip, "param_overlap": True, "steps": 6}
    for stage, accum, clip in ((2, 4, 0.05), (1, 2, None))
]
ALIGN_CASES = [  # buckets padded to a multiple of world_size * align_numel: more padding than needed
    {"stage": 2, "accum": 2, "clip": 0.05, "align_numel": 4},
    {"stage": 1, "accum": 1, "clip": None, "align_numel": 3, "width": 12},
]
FLOAT32_CASES = [{"stage": s, "accum": 2, "clip": 0.05, "dtype": "float32", "steps": 12} for s in (1, 2)]
BF16_WIRE_CASES = [
    {"stage": 2, "accum": 1, "clip": None, "dtype": "float32", "steps": 5, "reduce_dtype": "bf16"}
]

# name: (world size, worker, its arguments after rank and world size)
RUNS: dict[str, tuple[int, Callable[..., Any], tuple]] = {
    "float64_1": (1, parity, (CASES,)),
    "float64_2": (2, parity, (CASES,)),
    "float64_3": (3, parity, (CASES,)),
    "amsgrad": (3, parity, (AMSGRAD_CASES,)),
    "align": (3, parity, (ALIGN_CASES,)),
    "user_grad": (2, user_grad_is_not_scratch, ()),
    "every_backward_2": (2, parity, (EVERY_BACKWARD_CASES,)),
    "every_backward_3": (3, parity, (EVERY_BACKWARD_CASES,)),
    "param_overlap_2": (2, parity, (PARAM_OVERLAP_CASES,)),
    "param_overlap_3": (3, parity, (PARAM_OVERLAP_CASES,)),
    "float32": (2, parity, (FLOAT32_CASES,)),
    "bf16_wire": (2, parity, (BF16_WIRE_CASES,)),
    "bf16_accumulation_fp32_wire": (2, bf16_accumulation, (None,)),
    "bf16_accumulation_bf16_wire": (2, bf16_accumulation, ("bf16",)),
}


@pytest.fixture(scope="module")
def runs() -> dict[str, list[Any] | RuntimeError]:
    """Every run of this module, one launch per world size."""
    results: dict[str, list[Any] | RuntimeError] = {}
    for world_size in (1, 2, 3):
        names = [name for name, (size, _, _) in RUNS.items() if size == world_size]
        out = run_ranks_each([RUNS[name][1:] for name in names], world_size)
        results.update(zip(names, out, strict=True))
    return results


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_float64_parity_all_cases(world_size: int, runs: dict) -> None:
    results = ranks(runs, f"float64_{world_size}")
    for rank_results in results:
        for case, result in zip(CASES, rank_results, strict=True):
            assert result["moved"] > 1e-2, f"parameters barely moved in {case}: the test would be vacuous"
            assert max(result["max_diff"]) <= 1e-10, (case, result["max_diff"])
            assert result["buckets"] >= 3


def test_amsgrad_and_no_overlap_parity(runs: dict) -> None:
    """Width 12: most parameters fill an unpadded bucket of their own on 3 ranks, so their gradients
    become the communication buffers (adopted, not copied); width 13 pads every one."""
    for rank_results in ranks(runs, "amsgrad"):
        for case, result in zip(AMSGRAD_CASES, rank_results, strict=True):
            assert max(result["max_diff"]) <= 1e-10, (case, result["max_diff"])
            assert (result["adopted"] > 0) == (case.get("width") == 12), (case, result["adopted"])


def test_aligned_buckets_parity(runs: dict) -> None:
    """``align_numel > 1`` on 3 ranks: every bucket padded to a multiple of 12 (or 9) elements, so
    shards and pieces fall elsewhere than without it; the result is the same to 1e-10."""
    for rank_results in ranks(runs, "align"):
        for case, result in zip(ALIGN_CASES, rank_results, strict=True):
            assert max(result["max_diff"]) <= 1e-10, (case, result["max_diff"])
            assert result["adopted"] == 0, "padding must keep every gradient out of adoption"


def test_a_gradient_the_user_assigned_is_not_used_as_a_buffer(runs: dict) -> None:
    for result in ranks(runs, "user_grad"):
        assert result["adopted_fresh"] == 1
        assert result["adopted_after"] == 1, "the user's .grad was adopted"
        torch.testing.assert_close(result["held"], result["expected"], rtol=0, atol=1e-12)


def test_every_backward_communicating_sums_like_no_sync(runs: dict) -> None:
    """Several backward passes per step without ``no_sync`` (one round of collectives each, summed
    into the shards) equal the single-process reference, on uneven (3) and even (2) world sizes."""
    for world_size in (2, 3):
        for rank_results in ranks(runs, f"every_backward_{world_size}"):
            for case, result in zip(EVERY_BACKWARD_CASES, rank_results, strict=True):
                assert result["moved"] > 1e-2
                assert max(result["max_diff"]) <= 1e-10, (world_size, case, result["max_diff"])


def test_parameter_gather_overlapped_with_the_next_forward(runs: dict) -> None:
    """overlap_param_gather with gathers that only run when waited for: each module's forward waits
    for its own buckets, the step waits for the rest, and the result equals single-process AdamW."""
    for world_size in (2, 3):
        for rank_results in ranks(runs, f"param_overlap_{world_size}"):
            for case, result in zip(PARAM_OVERLAP_CASES, rank_results, strict=True):
                assert result["moved"] > 1e-2
                assert max(result["max_diff"]) <= 1e-10, (world_size, case, result["max_diff"])


def test_float32_parity(runs: dict) -> None:
    for rank_results in ranks(runs, "float32"):
        for case, result in zip(FLOAT32_CASES, rank_results, strict=True):
            assert max(result["max_diff"]) <= 1e-4, (case, result["max_diff"])


def test_bf16_wire_parity_within_bf16_rounding(runs: dict) -> None:
    """fp32 parameters, gradients reduced in bf16: close to the fp32 reference, not equal."""
    result = ranks(runs, "bf16_wire")[0][0]
    assert max(result["max_diff"]) <= 5e-2, result["max_diff"]


def test_bf16_micro_batches_accumulate_and_reduce_in_fp32(runs: dict) -> None:
    """bf16 parameters, 16 micro-batches on 2 ranks: the gradient shard equals the fp32 mean of the
    bf16 micro-batch gradients to fp32 rounding, far tighter than a bf16 running sum gets (what
    autograd's bf16 ``param.grad`` would hold); ``reduce_dtype="bf16"`` puts bf16 on the wire."""
    fp32_wire = ranks(runs, "bf16_accumulation_fp32_wire")
    bf16_wire = ranks(runs, "bf16_accumulation_bf16_wire")
    for rank in range(2):
        assert fp32_wire[rank]["ours"] <= 1e-6, fp32_wire[rank]
        assert fp32_wire[rank]["bf16_accumulation"] >= 1e-3, "the bf16 baseline must be visibly worse"
        assert 1e-5 < bf16_wire[rank]["ours"] <= 1e-2, bf16_wire[rank]
