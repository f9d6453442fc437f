"""The int8 wire (experimental; issue 30) on gloo ranks, against the exact wire of the same run:

* ``reduce_dtype="int8"`` on 2 and 3 ranks at stages 1-3: every element of the averaged gradient shard
  is within the sum of the senders' quantization bounds (half a step of each sender's block) of the fp32
  wire's; the bytes that leave a rank are the stated formula and at most 0.30x the fp32 wire's;
* under node-aware sharding (4 ranks, groups of 2): fp32 inside the group, the hierarchical bound
  across, the replicas' shards bit-identical, the bytes the formula;
* ``error_feedback``: over repeated sends the error stays within one step's bound, and without it
  grows past it;
* ``gather_dtype="int8"`` at stage 3: forwards see the dequantized shards (the same on every rank),
  gradients are those of these weights, the masters and ``state_dict()`` stay exact, and the gathers'
  bytes are 260/1024 of the exact ones;
* a few training steps of each variant track the fp32 wire's losses.
"""

from __future__ import annotations

from typing import Any

import pytest

from lightning_zero.engine.quantize import BLOCK
from tests.distributed.harness import ranks, run_ranks_each
from tests.distributed.workers_int8 import (
    VARIANTS,
    int8_error_feedback,
    int8_feedback_after_skip,
    int8_gathers,
    int8_gradients,
    int8_hybrid_gradients,
    int8_training,
)

CASES = [(2, 1), (2, 2), (2, 3), (3, 2), (3, 3)]  # (world size, stage)


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for size in (2, 3, 4):
        calls: list[tuple[Any, tuple]] = []
        names: list[str] = []
        for world, stage in CASES:
            if world == size:
                calls += [(int8_gradients, (stage, 12, 0.0004)), (int8_gradients, (stage, 128, 25.0))]
                names += [f"{world}/{stage}/small", f"{world}/{stage}/large"]
        if size == 2:
            calls += [
                (int8_training, (8,)),
                (int8_error_feedback, (2, 8)),
                (int8_error_feedback, (3, 8)),
                (int8_feedback_after_skip, ("guard",)),
                (int8_feedback_after_skip, ("scaler",)),
            ]
            names += ["training", "feedback/2", "feedback/3", "feedback/guard", "feedback/scaler"]
        if size in (2, 3):
            calls.append((int8_gathers, ()))
            names.append(f"{size}/gathers")
        if size == 4:
            for stage in (1, 2, 3):
                calls += [
                    (int8_hybrid_gradients, (stage, 12, 0.0004)),
                    (int8_hybrid_gradients, (stage, 128, 25.0)),
                    (int8_hybrid_gradients, (stage, 12, 0.0004, 3, True)),
                    (int8_hybrid_gradients, (stage, 12, 0.0004, 3, False)),
                ]
                names += [f"hybrid/{stage}/{case}" for case in ("small", "large", "sharded", "local")]
        results.update(zip(names, run_ranks_each(calls, size), strict=True))
    return results


@pytest.mark.parametrize(("world", "stage"), CASES)
def test_int8_shard_gradients_are_within_the_stated_bound(
    runs: dict[str, Any], world: int, stage: int
) -> None:
    for size in ("small", "large"):
        for rank, result in enumerate(ranks(runs, f"{world}/{stage}/{size}")):
            assert result["moved"] > 1e-4 and result["checked"] > 0
            assert result["over"] <= 0.0, (size, rank, result["over"])


@pytest.mark.parametrize(("world", "stage"), CASES)
def test_int8_bytes_are_the_formula_and_under_a_third_of_fp32(
    runs: dict[str, Any], world: int, stage: int
) -> None:
    """Gradient bytes: ``(N-1)`` rows of ``(1 + 4/256)`` bytes per element of a destination's part,
    padded to whole blocks, per bucket. Whatever else was sent (stage 3's parameter gathers, the same
    on both wires) is the fp32 run's bytes less its gradient formula."""
    for size in ("small", "large"):
        for result in ranks(runs, f"{world}/{stage}/{size}"):
            parameters = result["bytes_fp32"] - result["expected_fp32_gradients"]
            assert parameters >= 0 and (stage == 3 or parameters == 0)
            assert result["bytes_int8"] == result["expected_int8"] + parameters
    for result in ranks(runs, f"{world}/{stage}/large"):  # blocks of 256 padding is small here
        int8, fp32 = result["expected_int8"], result["expected_fp32_gradients"]
        assert int8 <= 0.30 * fp32, (int8, fp32)


def test_int8_training_tracks_the_fp32_wire(runs: dict[str, Any]) -> None:
    for losses in ranks(runs, "training"):
        assert set(losses) == set(VARIANTS)
        for name, curve in losses.items():
            fp32 = losses["stage3 fp32" if name.startswith("stage3") else "fp32"]
            assert fp32[-1] < fp32[0]  # it trains
            assert all(abs(a - b) <= 0.02 * abs(a) for a, b in zip(fp32, curve, strict=True)), (name, curve)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_int8_under_node_aware_sharding_is_hierarchical(runs: dict[str, Any], stage: int) -> None:
    """fp32 inside each group of 2, int8 across the 2 groups: within the bound of both quantizations
    of the fp32 wire's shard, replicas identical, and the bytes the formula (in-group fp32 as before;
    across, an all-to-all and an all-gather of ``(R-1)`` rows of a chunk each)."""
    for size in ("small", "large"):
        for rank, result in enumerate(ranks(runs, f"hybrid/{stage}/{size}")):
            assert result["checked"] > 0 and result["identical"], (size, rank)
            assert result["over"] <= 0.0, (size, rank, result["over"])
            assert result["in_group_int8"] == result["in_group_fp32"]  # the same fp32 wire inside
            assert result["across_fp32"] == result["expected_across_fp32"]
            assert result["across_int8"] == result["expected_across_int8"]
    for result in ranks(runs, f"hybrid/{stage}/large"):
        assert result["across_int8"] <= 0.30 * result["across_fp32"]
    for accumulation in ("sharded", "local"):  # 3 micro-batches: folded into the shard, or summed locally
        for rank, result in enumerate(ranks(runs, f"hybrid/{stage}/{accumulation}")):
            assert result["checked"] > 0 and result["identical"], (accumulation, rank)
            assert result["over"] <= 0.0, (accumulation, rank, result["over"])


@pytest.mark.parametrize("stage", [2, 3])
def test_error_feedback_keeps_the_summed_error_within_one_step(runs: dict[str, Any], stage: int) -> None:
    """8 sends of the same gradients: with error feedback the summed error is within one step's bound
    (``over <= 0``); without it, it is several bounds (the errors add up), so the check can fail."""
    for result in ranks(runs, f"feedback/{stage}"):
        assert result["over"] <= 0.0, result
        assert result["feedback"] <= 1.01, result
        assert result["plain"] > 3.0, result


@pytest.mark.parametrize("how", ["guard", "scaler"])
def test_a_skipped_step_drops_the_error_feedback_residuals(runs: dict[str, Any], how: str) -> None:
    assert all(ranks(runs, f"feedback/{how}"))


@pytest.mark.parametrize("world", [2, 3])
def test_int8_parameter_gathers(runs: dict[str, Any], world: int) -> None:
    for result in ranks(runs, f"{world}/gathers"):
        assert result["same_everywhere"]
        assert 0.0 < result["max_off"] <= result["max_weight"] / 254 * (1 + 1e-6), result
        assert result["grad_error"] <= 1e-5, result  # the gradients of the dequantized weights
        assert result["grads_differ"] > 1e-6, result  # ... which are not the exact weights' gradients
        assert result["state_exact"] and result["shards_kept"], result
        int8 = result["bytes_int8"] - result["grad_bytes"]
        exact = result["bytes_exact"] - result["grad_bytes"]
        assert exact > 0 and int8 * 1024 == exact * (BLOCK + 4), (int8, exact)
        assert int8 <= 0.30 * exact
