"""ShardedAdamW on 1, 2 and 3 gloo ranks equals torch.optim.AdamW on the same global batch."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.distributed.workers import bf16_accumulation, parity, user_grad_is_not_scratch

CASES = [
    {"stage": stage, "accum": accum, "clip": clip}
    for stage, accum, clip in itertools.product((1, 2), (1, 4), (None, 0.05))
]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_float64_parity_all_cases(world_size: int) -> None:
    results = run_ranks(parity, world_size, CASES)
    for rank_results in results:
        for case, result in zip(CASES, rank_results, strict=True):
            assert result["moved"] > 1e-2, f"parameters barely moved in {case}: the test would be vacuous"
            assert max(result["max_diff"]) <= 1e-10, (case, result["max_diff"])
            assert result["buckets"] >= 3


def test_amsgrad_and_no_overlap_parity() -> None:
    """Width 12: most parameters fill an unpadded bucket of their own on 3 ranks, so their gradients
    become the communication buffers (adopted, not copied); width 13 pads every one."""
    cases = [
        {"stage": 2, "accum": 2, "clip": None, "amsgrad": True},
        {"stage": 1, "accum": 1, "clip": 0.05, "overlap": False},
        {"stage": 2, "accum": 2, "clip": 0.05, "width": 12},
        {"stage": 1, "accum": 1, "clip": None, "width": 12},
    ]
    for rank_results in run_ranks(parity, 3, cases):
        for case, result in zip(cases, rank_results, strict=True):
            assert max(result["max_diff"]) <= 1e-10, (case, result["max_diff"])
            assert (result["adopted"] > 0) == (case.get("width") == 12), (case, result["adopted"])


def test_a_gradient_the_user_assigned_is_not_used_as_a_buffer() -> None:
    for result in run_ranks(user_grad_is_not_scratch, 2):
        assert result["adopted_fresh"] == 1
        assert result["adopted_after"] == 1, "the user's .grad was adopted"
        torch.testing.assert_close(result["held"], result["expected"], rtol=0, atol=1e-12)


def test_every_backward_communicating_sums_like_no_sync() -> None:
    """Several backward passes per step without ``no_sync`` (one round of collectives each, summed
    into the shards) equal the single-process reference, on uneven (3) and even (2) world sizes."""
    cases = [
        {"stage": stage, "accum": 3, "clip": 0.05, "no_sync": False, "steps": 6, "overlap": overlap}
        for stage, overlap in ((1, True), (2, False))
    ]
    for world_size in (2, 3):
        for rank_results in run_ranks(parity, world_size, cases):
            for case, result in zip(cases, rank_results, strict=True):
                assert result["moved"] > 1e-2
                assert max(result["max_diff"]) <= 1e-10, (world_size, case, result["max_diff"])


def test_parameter_gather_overlapped_with_the_next_forward() -> None:
    """overlap_param_gather with gathers that only run when waited for: each module's forward waits
    for its own buckets, the step waits for the rest, and the result equals single-process AdamW."""
    cases = [
        {"stage": stage, "accum": accum, "clip": clip, "param_overlap": True, "steps": 6}
        for stage, accum, clip in ((2, 4, 0.05), (1, 2, None))
    ]
    for world_size in (2, 3):
        for rank_results in run_ranks(parity, world_size, cases):
            for case, result in zip(cases, rank_results, strict=True):
                assert result["moved"] > 1e-2
                assert max(result["max_diff"]) <= 1e-10, (world_size, case, result["max_diff"])


def test_float32_parity() -> None:
    cases = [{"stage": s, "accum": 2, "clip": 0.05, "dtype": "float32", "steps": 12} for s in (1, 2)]
    for rank_results in run_ranks(parity, 2, cases):
        for case, result in zip(cases, rank_results, strict=True):
            assert max(result["max_diff"]) <= 1e-4, (case, result["max_diff"])


def test_bf16_wire_parity_within_bf16_rounding() -> None:
    """fp32 parameters, gradients reduced in bf16: close to the fp32 reference, not equal."""
    cases = [{"stage": 2, "accum": 1, "clip": None, "dtype": "float32", "steps": 5, "reduce_dtype": "bf16"}]
    result = run_ranks(parity, 2, cases)[0][0]
    assert max(result["max_diff"]) <= 5e-2, result["max_diff"]


def test_bf16_micro_batches_accumulate_and_reduce_in_fp32() -> None:
    """bf16 parameters, 16 micro-batches on 2 ranks: the gradient shard equals the fp32 mean of the
    bf16 micro-batch gradients to fp32 rounding, far tighter than a bf16 running sum gets (what
    autograd's bf16 ``param.grad`` would hold); ``reduce_dtype="bf16"`` puts bf16 on the wire."""
    fp32_wire = run_ranks(bf16_accumulation, 2, None)
    bf16_wire = run_ranks(bf16_accumulation, 2, "bf16")
    for rank in range(2):
        assert fp32_wire[rank]["ours"] <= 1e-6, fp32_wire[rank]
        assert fp32_wire[rank]["bf16_accumulation"] >= 1e-3, "the bf16 baseline must be visibly worse"
        assert 1e-5 < bf16_wire[rank]["ours"] <= 1e-2, bf16_wire[rank]
