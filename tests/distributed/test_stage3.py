"""Stage 3 (parameters sharded too) on 1, 2 and 3 gloo ranks equals torch.optim.AdamW on the same
global batch, and sends exactly the elements its schedule says. One launch per world size."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.harness import ranks, run_ranks, run_ranks_each
from tests.distributed.workers import parity, stage3_state_dict, stage3_sync

BLOCKS = {"stage": 3, "net": "blocks", "steps": 6, "bucket_cap_mb": 1.0}  # one bucket per unit
CASES = [
    {**BLOCKS, "accum": 1, "clip": None},
    {**BLOCKS, "accum": 4, "clip": 0.05},
    {**BLOCKS, "accum": 1, "clip": 0.05, "reshard": False},
    {**BLOCKS, "accum": 4, "clip": None, "reshard": False},
    {**BLOCKS, "accum": 3, "clip": 0.05, "no_sync": False, "prefetch": 0},
    {**BLOCKS, "accum": 2, "clip": 0.05, "prefetch": 2, "width": 12, "bucket_cap_mb": 0.0004},
]
ROOTED = {"stage": 3, "net": "rooted", "steps": 4, "bucket_cap_mb": 1.0, "clip": 0.05}  # a root unit
ROOTED_CASES = [{**ROOTED, "accum": 1}, {**ROOTED, "accum": 3}, {**ROOTED, "accum": 2, "reshard": False}]


@pytest.fixture(scope="module")
def runs() -> dict[str, list[Any] | RuntimeError]:
    runs: dict[str, list[Any] | RuntimeError] = {}
    for size in (1, 2, 3):
        rooted = [(parity, (ROOTED_CASES,))] if size > 1 else []
        extra = [(stage3_sync, ())] if size == 2 else []
        out = run_ranks_each([(parity, (CASES,)), *rooted, *extra], size)
        runs[f"stage3_{size}"] = out[0]
        if rooted:
            runs[f"rooted_{size}"] = out[1]
        if extra:
            runs["sync"] = out[2]
    return runs


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_stage3_float64_parity_with_accumulation_clipping_and_unused_parameters(
    world_size: int, runs: dict
) -> None:
    for rank_results in ranks(runs, f"stage3_{world_size}"):
        for case, result in zip(CASES, rank_results, strict=True):
            assert result["moved"] > 1e-2, f"parameters barely moved in {case}: the test would be vacuous"
            assert max(result["max_diff"]) <= 1e-10, (case, result["max_diff"])
            assert set(result["units"]) == {1, 2, 3, 4, 5}, "input layer, three blocks, output layer"
            assert len(result["units"]) > 4 if case["bucket_cap_mb"] < 1 else len(result["units"]) == 5


@pytest.mark.parametrize("world_size", [2, 3])
def test_stage3_sends_two_gathers_and_a_reduce_scatter_per_step(world_size: int, runs: dict) -> None:
    """One all-gather of every unit in forward, one more in backward of every unit but the output
    layer, which ran last and stays gathered for its backward (none with
    ``reshard_after_forward=False``), one reduce-scatter: ``(3Ψ - Ψ_root - Ψ_last)(N-1)/N`` elements,
    no more."""
    for rank_results in ranks(runs, f"stage3_{world_size}"):
        for case, result in zip(CASES, rank_results, strict=True):
            if case["accum"] == 1:  # every parameter of this model is in a unit: the root holds none
                last = sum(p for p, u in zip(result["bucket_padded"], result["units"], strict=True) if u == 5)
                assert 0 < last < result["padded"] / 4, "the output layer (unit 5) is a small part"
                again = result["padded"] - last if case.get("reshard", True) else 0
                expected = (2 * result["padded"] + again) * (world_size - 1) // world_size
                assert result["elements"] == [expected] * case["steps"], case
                assert result["min_elements"] == expected, case
    resharded, kept = ranks(runs, f"stage3_{world_size}")[0][0], ranks(runs, f"stage3_{world_size}")[0][2]
    assert resharded["min_elements"] > kept["min_elements"] > 0


@pytest.mark.parametrize("world_size", [2, 3])
def test_stage3_gathers_the_root_once_per_step(world_size: int, runs: dict) -> None:
    """A model whose root module holds a parameter itself: the root unit is gathered once per step (its
    first forward; it stays for the backward and the micro-batches after, until the step), every other
    unit in each micro-batch's forward and again in its backward (once with ``reshard_after_forward=False``),
    but the output layer, which runs last and stays gathered for its backward: once per micro-batch.
    Per step ``(Ψ_root + 2A(Ψ - Ψ_root - Ψ_last) + AΨ_last + AΨ)(N-1)/N`` elements for A micro-batches
    (the gradients reduce-scattered every micro-batch: stage 3 accumulates sharded by default):
    ``(3Ψ - Ψ_root - Ψ_last)(N-1)/N`` at A = 1."""
    for rank_results in ranks(runs, f"rooted_{world_size}"):
        for case, result in zip(ROOTED_CASES, rank_results, strict=True):
            assert result["moved"] > 1e-2, f"parameters barely moved in {case}: the test would be vacuous"
            assert max(result["max_diff"]) <= 1e-10, (case, result["max_diff"])
            units, padded = result["units"], result["bucket_padded"]
            assert sorted(units) == [0, 1, 2, 3, 4, 5], "one bucket per unit: the root, inp, 3 blocks, out"
            root, last = padded[units.index(0)], padded[units.index(5)]
            assert root >= 13 * 13, "the root's bucket holds the mixing matrix"
            total, accum = sum(padded), case["accum"]
            per_unit = 2 * accum if case.get("reshard", True) else accum
            gathers = {0: 1, **dict.fromkeys(range(1, 5), per_unit), 5: accum}  # 5: the output layer
            assert result["gathers"] == [gathers] * case["steps"], case
            # stage 3 accumulates sharded by default: a reduce-scatter of the gradients per micro-batch
            once = root + per_unit * (total - root - last) + accum * last
            expected = (once + accum * total) * (world_size - 1) // world_size
            assert result["elements"] == [expected] * case["steps"], case
            if accum == 1:  # the docstring's formula, and the engine's own figure
                assert expected == (3 * total - root - last) * (world_size - 1) // world_size
                assert result["min_elements"] == expected, case


def test_rank0s_parameters_everywhere_before_sharding_and_another_model_refused(runs: dict) -> None:
    for result in ranks(runs, "sync"):
        assert result["synced"] == 0.0, "every rank must start from rank 0's parameters"
        assert "rank 1 holds another model than rank 0: ('inp.weight', (14, 7)" in result["error"]


def test_state_dict_and_load_state_dict_of_a_sharded_model_one_unit_at_a_time() -> None:
    """``state_dict()`` of a stage-3 model returns its full values (copies), holding at most the root
    and one block gathered; ``load_state_dict()`` writes every rank's shards; a submodule holding root
    parameters runs on its own; ``assign=True`` is refused; ``unshard`` leaves a plain module."""
    for result in run_ranks(stage3_state_dict, 2):
        assert result["moved"] > 1e-2, "the model barely trained: the comparison would be vacuous"
        assert result["state_keys"]
        assert result["state_vs_full"] == 0.0
        assert result["state_peak"] == 2, "the root and one block gathered at once, no more"
        assert result["left_gathered"] == 0, "units gathered for state_dict() are freed after it"
        assert result["block_vs_full"] == 0.0
        assert result["load_vs_new"] == 0.0
        assert result["out_vs_plain"] <= 1e-12 and result["inp_vs_plain"] == 0.0
        assert "load_state_dict(assign=True) would replace the sharded parameters" in result["assign_error"]
        assert result["sharded_before"]
        assert result["plain_after_unshard"] == 0.0
