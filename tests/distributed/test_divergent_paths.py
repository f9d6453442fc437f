"""Issue 39: ranks that use different parameters inside a unit (a gate used on some ranks, a
mixture-of-experts layer whose router sends each rank's samples to different experts, an auxiliary
head in the root used on some batches) train as torch DDP (``find_unused_parameters=True``) does, in
float64, at stages 1, 2 and 3, with and without ``find_unused_parameters``, flat and 2 x 2
node-aware; and every rank issues the same collectives (the recorder of tests/conftest.py compares
them after each test: at stage 3 the order used to follow which gradients arrived)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.harness import ranks, run_ranks
from tests.distributed.paths_models import KINDS
from tests.distributed.workers_paths import divergent_paths

CASES = [
    {"kind": kind, "stage": stage, "find_unused": find_unused}
    for kind in KINDS
    for stage in (1, 2, 3)
    for find_unused in (True, False)
]


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    runs: dict[str, Any] = {}
    for layout, size, group in (("flat", 2, None), ("2x2", 4, 2)):
        try:
            runs[layout] = run_ranks(
                divergent_paths, size, [{**c, "group": group} for c in CASES], timeout_s=300
            )
        except RuntimeError as error:  # each test that reads it fails with every rank's traceback
            runs[layout] = error
    return runs


@pytest.mark.parametrize("layout", ["flat", "2x2"])
def test_divergent_paths_train_as_ddp_does(layout: str, runs: dict[str, Any]) -> None:
    results = ranks(runs, layout)
    for rank_results in results:
        for case, result in zip(CASES, rank_results, strict=True):
            assert result["moved"] > 1e-2, f"parameters barely moved in {case}: the test would be vacuous"
            assert max(result["max_diff"]) <= 1e-10, (layout, case, result["max_diff"])


@pytest.mark.parametrize("layout", ["flat", "2x2"])
def test_the_ranks_did_take_different_paths(layout: str, runs: dict[str, Any]) -> None:
    """The cases are what they claim: the optional path differs between ranks in some micro-batch, and
    the router sends some rank's samples to experts another rank's do not reach."""
    results = ranks(runs, layout)
    paths = [r[0]["paths"] for r in results]
    assert any(len({p[i] for p in paths}) == 2 for i in range(len(paths[0])))
    moe = CASES.index({"kind": "moe", "stage": 3, "find_unused": True})
    experts = [r[moe]["experts"] for r in results]  # per rank: the experts each forward ran
    assert any(len({frozenset(e[i]) for e in experts}) > 1 for i in range(len(experts[0])))
    assert any(len(e[i]) < 4 for e in experts for i in range(len(e))), "some expert unused in a forward"
