"""``reduce_dtype="int8"`` (experimental; issue 30, first step): on 2 and 3 gloo ranks at stages 1-3,
every element of the averaged gradient shard is within the sum of the senders' quantization bounds
(half a step of each sender's block) of the fp32 wire's; the bytes that leave a rank are the stated
formula and at most 0.30x the fp32 wire's; a few training steps track the fp32 wire's losses; node-aware
sharding is refused before any work."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.harness import ranks, run_ranks_each
from tests.distributed.workers_int8 import int8_gradients, int8_refused_under_hybrid, int8_training

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
            calls.append((int8_training, (8,)))
            names.append("training")
        if size == 4:
            calls.append((int8_refused_under_hybrid, ()))
            names.append("hybrid")
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
        fp32, int8 = losses["None"], losses["int8"]
        assert fp32[-1] < fp32[0]  # it trains
        assert all(abs(a - b) <= 0.02 * abs(a) for a, b in zip(fp32, int8, strict=True)), (fp32, int8)


def test_int8_is_refused_under_node_aware_sharding(runs: dict[str, Any]) -> None:
    for message in ranks(runs, "hybrid"):
        assert "reduce_dtype='int8' does not support node-aware sharding yet" in message
