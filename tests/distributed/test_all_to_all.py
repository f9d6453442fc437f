"""``Comm.all_to_all`` on real gloo ranks: rank ``s``'s chunk ``r`` lands in rank ``r``'s chunk ``s``
(int8 values and fp32 scales, what a quantized wire sends), counted as the ``(N-1)/N`` that leaves
the rank, recorded in the collective order; unequal chunks are refused before anything is sent."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_zero.comm import Comm
from tests.distributed.harness import run_ranks


def _value(sender: int, receiver: int, i: int) -> int:
    """Element ``i`` of what ``sender`` sends ``receiver`` (within int8, negative too)."""
    return 40 * sender - 12 * receiver + i - 30


def exchange(rank: int, world_size: int) -> dict[str, Any]:
    comm = Comm()
    chunk = 6
    values = torch.tensor(
        [_value(rank, r, i) for r in range(world_size) for i in range(chunk)], dtype=torch.int8
    )
    received = torch.empty_like(values)
    comm.wait(comm.all_to_all(received, values))
    scales = torch.arange(world_size, dtype=torch.float32) + rank * 0.5
    got_scales = torch.empty_like(scales)
    comm.wait(comm.all_to_all(got_scales, scales))
    try:
        comm.all_to_all(torch.empty(5, dtype=torch.int8), torch.zeros(5, dtype=torch.int8))
        refused = ""
    except ValueError as err:
        refused = str(err)
    return {
        "received": received.tolist(),
        "scales": got_scales.tolist(),
        "elements": comm.stats.elements_sent,
        "bytes": comm.stats.bytes_sent,
        "refused": refused,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_to_all_delivers_each_chunk_and_counts_what_leaves(world_size: int) -> None:
    chunk = 6
    for rank, result in enumerate(run_ranks(exchange, world_size)):
        assert result["received"] == [_value(s, rank, i) for s in range(world_size) for i in range(chunk)]
        assert result["scales"] == [rank + 0.5 * s for s in range(world_size)]
        left = (world_size - 1) * chunk  # values: every chunk but this rank's own
        assert result["elements"] == left + (world_size - 1)  # + the scales'
        assert result["bytes"] == left * 1 + (world_size - 1) * 4
        assert "equal chunks: 5 elements in and 5 out" in result["refused"]
