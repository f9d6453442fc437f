"""Issue 39, item 4: ``load_parameters`` (Hugging Face safetensors, or any reader) into shards decides
on every rank together. A stored tensor larger or smaller than its parameter, or missing, ends on every
rank with the same ``CheckpointError`` naming the tensor and both shapes, within seconds, and the
model keeps its values; before, a larger tensor loaded in silence, and a short or missing one raised
only on the ranks whose shard touched it while the others waited in the next collective."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save_file

from tests.distributed.harness import run_ranks
from tests.distributed.workers_loaders import load_each, stored

EXPECTED = {
    ("larger_weight", "safetensors"): "2.weight: stored as shape [4, 3], the parameter has shape [3, 3]",
    ("larger_bias", "safetensors"): "0.bias: stored as shape [5], the parameter has shape [3]",
    ("smaller_weight", "safetensors"): "2.weight: stored as shape [2, 3], the parameter has shape [3, 3]",
    ("missing", "safetensors"): "0.bias: '0.bias' is not stored here",
    ("smaller_weight", "plain"): "2.weight: elements [",
    ("missing", "plain"): "0.bias: elements [",
    ("right", "safetensors"): None,
    ("right", "plain"): None,
}
CASES = [(case, kind, stage) for case, kind in EXPECTED for stage in (2, 3)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("stored")
    for case in {case for case, _ in EXPECTED}:
        save_file(stored(case), str(Path(directory) / f"{case}.safetensors"))
    return run_ranks(load_each, 2, str(directory), CASES, timeout_s=120)


def test_every_rank_ends_with_the_same_named_error_and_unchanged_values(
    results: list[list[dict[str, Any]]],
) -> None:
    for i, (case, kind, stage) in enumerate(CASES):
        errors = [rank[i]["error"] for rank in results]
        expected = EXPECTED[case, kind]
        assert errors[0] == errors[1], (case, kind, stage, errors)
        if expected is None:
            assert errors[0] is None, (case, kind, stage, errors)
            assert not any(rank[i]["unchanged"] for rank in results), "a right load changes the values"
            continue
        assert errors[0] is not None and expected in errors[0], (case, kind, stage, errors[0])
        assert all(rank[i]["unchanged"] for rank in results), (case, kind, stage, "values changed")
        assert max(rank[i]["seconds"] for rank in results) < 10, (case, kind, stage)


def test_a_short_or_missing_tensor_is_read_by_one_rank_only(results: list[list[dict[str, Any]]]) -> None:
    """The plain-reader cases are what they claim: only one rank's shard touches the bad part, so
    without the agreement the other rank would not have raised."""
    for i, (case, kind, stage) in enumerate(CASES):
        if kind == "plain" and EXPECTED[case, kind]:
            assert sorted(rank[i]["failed"] for rank in results) == [False, True], (case, stage)
