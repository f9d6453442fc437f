"""What goes over the wire, counted at the torch.distributed calls themselves.

The runs go in one launch per world size (a module fixture); each test reads its own by name."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.harness import ranks, run_ranks_each
from tests.distributed.workers import count_collectives, mismatched_models

RING = {"reduce_scatter": 1, "all_gather": 1, "all_reduce": 2}  # times P·(N−1)/N per rank


def _as_collectives(calls: list[tuple[str, int]], world_size: int) -> list[tuple[str, int]]:
    """Read gloo's split collectives back as the ones they stand for: ``N`` consecutive ``reduce``
    calls of one chunk size are a reduce-scatter of ``N`` chunks, ``N`` ``broadcast`` calls an
    all-gather (lightning_zero.comm runs them so on gloo: no full-size temporaries)."""
    merged, i = [], 0
    while i < len(calls):
        name, numel = calls[i]
        run = calls[i : i + world_size]
        if name in ("reduce", "broadcast") and run == [(name, numel)] * world_size:
            merged.append(("reduce_scatter" if name == "reduce" else "all_gather", numel * world_size))
            i += world_size
        else:
            merged.append((name, numel))
            i += 1
    return merged


def _sent(calls: list[tuple[str, int]], world_size: int) -> int:
    total = 0
    for name, numel in calls:
        kind = next(k for k in RING if name.startswith(k))
        total += RING[kind] * numel * (world_size - 1) // world_size
    return total


@pytest.fixture(scope="module")
def runs() -> dict[str, list[Any] | RuntimeError]:
    """``count_collectives`` for both stages on 2 and 3 ranks (stage 2 also with a bf16 wire), then
    (2 ranks) ``mismatched_models``."""
    counts = [(count_collectives, (1, 4)), (count_collectives, (2, 4)), (count_collectives, (2, 4, "bf16"))]
    two = run_ranks_each([*counts, (mismatched_models, ())], 2, timeout_s=120)  # a hang fails
    three = run_ranks_each(counts, 3, timeout_s=120)
    names = [
        "count_2_1",
        "count_2_2",
        "count_2_2_bf16",
        "mismatched",
        "count_3_1",
        "count_3_2",
        "count_3_2_bf16",
    ]
    return dict(zip(names, two + three, strict=True))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
def test_elements_sent_per_step(world_size: int, stage: int, runs: dict) -> None:
    for result in ranks(runs, f"count_{world_size}_{stage}"):
        raw, padded, trainable = result["calls"], result["padded"], result["trainable"]
        calls = _as_collectives(raw, world_size)
        assert result["per_micro"][:3] == [0, 0, 0], "non-stepping micro-batches must send nothing"
        kinds = {name.split("_single")[0].removesuffix("_tensor").removesuffix("_into") for name, _ in calls}
        if stage == 2:
            assert kinds == {"reduce_scatter", "all_gather"}, calls
            expected = 2 * padded * (world_size - 1) // world_size  # 2Ψ(N−1)/N
        else:
            assert kinds == {"all_reduce", "all_gather"}, calls
            expected = 3 * padded * (world_size - 1) // world_size
        assert _sent(calls, world_size) == expected
        assert result["reported"] == expected, "the strategy's own counter must match the wire"
        assert len(calls) == 2 * result["buckets"], "one gradient and one parameter collective per bucket"
        assert 0 <= padded - trainable < world_size * result["buckets"], "padding below N per bucket"
        launched = _as_collectives(raw[: result["launched_before_last_grad"]], world_size)
        assert len(launched) >= result["buckets"] - 2, "buckets must start during backward"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("wire", ["", "_bf16"])
def test_bytes_sent_per_step(world_size: int, wire: str, runs: dict) -> None:
    """Bytes as well as elements: a bf16 wire halves the gradient half of stage 2's traffic, and the
    counter the ``zero/bytes_sent`` metric reads agrees with the bytes at the torch.distributed calls."""
    for result in ranks(runs, f"count_{world_size}_2{wire}"):
        ring = result["padded"] * (world_size - 1) // world_size  # Ψ(N−1)/N, each of the two collectives
        gradient_itemsize = 2 if wire else 4
        assert _sent(_as_collectives(result["wire_bytes"], world_size), world_size) == ring * (
            gradient_itemsize + 4
        )
        assert result["reported_bytes"] == ring * (gradient_itemsize + 4)
        assert result["reported"] == 2 * ring, "elements are the same whatever the wire dtype"


def test_plan_mismatch_is_an_error_on_every_rank(runs: dict) -> None:
    messages = ranks(runs, "mismatched")
    for message in messages:
        assert "different gradient bucket plans" in message
        assert "rank 1 differs from rank 0" in message and "[14, 7]" in message
