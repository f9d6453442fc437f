"""Issue 39, item 3: ``LZ_CHECK_COLLECTIVES=1`` compares every collective's signature across ranks
before issuing it: a program made to diverge (a unit that runs on one rank only, at stage 3; a
clipping all-reduce one rank issues and the other does not) ends on every rank with the same
``CommError`` naming both sides within 2 s, instead of hanging until the timeout; a program that does
not diverge trains as without the check, sending the same elements."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.distributed.workers_signatures import signature_cases

CASES = [
    (False, 3, None),
    (True, 3, None),
    (True, 2, None),
    (True, 3, "unit"),
    (True, 2, "clip"),
]


@pytest.fixture(scope="module")
def results() -> list[list[dict[str, Any]]]:
    return run_ranks(signature_cases, 2, CASES, timeout_s=120)


def test_a_program_that_does_not_diverge_trains_as_without_the_check(
    results: list[list[dict[str, Any]]],
) -> None:
    for rank in results:
        off, on = rank[CASES.index((False, 3, None))], rank[CASES.index((True, 3, None))]
        assert off["error"] is None and on["error"] is None and rank[2]["error"] is None
        assert on["elements"] == off["elements"] and len(on["elements"]) == 3
        for a, b in zip(on["values"], off["values"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ((True, 3, "unit"), ["unit 'blocks.2'", "unit 'blocks.1'"]),
        ((True, 2, "clip"), ["rank 0: all_gather", "rank 1: all_reduce_sum", "grad_math.py", "engine.py"]),
    ],
)
def test_a_divergent_program_names_both_sides_on_every_rank_within_2_s(
    case: tuple[bool, int, str], expected: list[str], results: list[list[dict[str, Any]]]
) -> None:
    errors = [rank[CASES.index(case)]["error"] for rank in results]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert "differs between ranks" in errors[0]
    for text in expected:
        assert text in errors[0], (text, errors[0])
    assert max(rank[CASES.index(case)]["seconds"] for rank in results) < 2.0
