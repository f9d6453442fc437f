"""Host synchronisations per optimizer step, asserted against the table in docs/strategy.md.

On CUDA each one stalls the host until the device has caught up. Counted on 2 gloo ranks by
``tests.distributed.host_syncs`` (what would synchronise on CUDA), per optimizer step of 3
micro-batches (the first two under ``no_sync``), after a warm-up step. One launch.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.harness import run_ranks
from tests.distributed.workers_syncs import host_syncs

# (case, host synchronisations per optimizer step): docs/strategy.md, "Host synchronisations"
CASES: list[tuple[dict[str, Any], int]] = [
    ({"stage": 2}, 0),
    ({"stage": 1}, 0),
    ({"stage": 3, "net": "blocks"}, 0),
    ({"stage": 2, "clip": None}, 0),
    ({"stage": 2, "reduce_dtype": "fp32"}, 0),
    ({"stage": 2, "shard_group_size": 1}, 0),  # hybrid: 2 replica groups of 1 rank
    ({"stage": 2, "find_unused_parameters": True}, 1),  # the used-parameter mask, read once per step
    ({"stage": 2, "skip_nonfinite_steps": 3}, 1),  # the ranks' inf/NaN flags, read once per step
    (
        {"stage": 2, "find_unused_parameters": True, "skip_nonfinite_steps": 3},
        1,
    ),  # the flags ride on the mask
    ({"stage": 3, "net": "blocks", "find_unused_parameters": True}, 1),
]


@pytest.fixture(scope="module")
def results() -> list[list[dict[str, Any]]]:
    return run_ranks(host_syncs, 2, [case for case, _ in CASES])


@pytest.mark.parametrize("index", range(len(CASES)), ids=[str(c) for c, _ in CASES])
def test_host_synchronisations_per_optimizer_step_match_the_documented_table(
    index: int, results: list[list[dict[str, Any]]]
) -> None:
    case, expected = CASES[index]
    for rank, rank_results in enumerate(results):
        result = rank_results[index]
        assert result["per_step"] == [expected] * len(result["per_step"]), (rank, case, result)
        assert result["in_non_stepping_micro_batches"] == [0] * len(result["per_step"]), (rank, case, result)
