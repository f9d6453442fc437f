"""A weight average (EMA, SWA) kept on the shards equals torch's ``AveragedModel`` of a single-process
``torch.optim.AdamW`` run on the same global batch, at stages 1, 2 and 3, on 2 and 3 ranks; it takes
``1/N`` of the fp32 (here fp64) weights per rank; a checkpoint restores it on another world size and
stage, and without an average kept the weights loaded are the average.

Runs go in one launch per world size (a module fixture); each test reads its own by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero.checkpoint.consolidate import consolidate, load_full_state_dict
from tests.distributed.harness import ranks, run_ranks_each
from tests.distributed.workers_average import averaged_parity, resumed_average

TOL = 1e-10  # float64: separates a logic error from rounding (STYLE.md)
PARITY = [(2, 1, "ema"), (2, 2, "ema_multi"), (2, 3, "swa"), (3, 3, "ema"), (3, 2, "swa")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("average")
    saved = str(tmp / "saved-2x-stage2")
    results: dict[str, Any] = {}
    calls_2 = [(averaged_parity, (stage, fn)) for size, stage, fn in PARITY if size == 2]
    calls_2.append((averaged_parity, (2, "ema", saved)))
    calls_2.append((averaged_parity, (1, "ema_multi", None, 2)))
    out = run_ranks_each(calls_2, 2)
    names = [f"{size}/{stage}/{fn}" for size, stage, fn in PARITY if size == 2] + ["saver", "unfrozen"]
    results.update(zip(names, out, strict=True))
    calls_3 = [(averaged_parity, (stage, fn)) for size, stage, fn in PARITY if size == 3]
    calls_3 += [(resumed_average, (saved, 3, "ema", True)), (resumed_average, (saved, 1, "ema", False))]
    out = run_ranks_each(calls_3, 3)
    names = [f"{size}/{stage}/{fn}" for size, stage, fn in PARITY if size == 3] + ["resumed", "not_kept"]
    results.update(zip(names, out, strict=True))
    results["path"] = saved
    return results


@pytest.mark.parametrize(("size", "stage", "fn"), PARITY)
def test_average_equals_averaged_model(runs: dict[str, Any], size: int, stage: int, fn: str) -> None:
    for rank, result in enumerate(ranks(runs, f"{size}/{stage}/{fn}")):
        assert result["moved"] > 1e-2, "the average barely moved: the comparison would be vacuous"
        assert max(result["weights"]) <= TOL, (rank, result["weights"])
        assert max(result["averages"]) <= TOL, (rank, result["averages"])
        assert result["n_averaged"] == 6


@pytest.mark.parametrize(("size", "stage", "fn"), PARITY)
def test_average_takes_one_shard_per_rank(runs: dict[str, Any], size: int, stage: int, fn: str) -> None:
    """8 bytes (fp64) per element of this rank's shards: 1/N of the trainable weights plus padding."""
    for result in ranks(runs, f"{size}/{stage}/{fn}"):
        assert result["average_nbytes"] == 8 * result["shard_numel"]
        assert result["shard_numel"] * size - result["total_numel"] < 64  # padding only


def test_a_replan_keeps_the_average_and_starts_new_ones_from_the_weights(runs: dict[str, Any]) -> None:
    """A frozen layer joins the optimizer after 2 steps (add_param_group, replan): the average of the
    parameters already trained is carried over to the new buckets, the new ones' starts at their
    (constant so far) weights, as AveragedModel's average of a constant is that constant."""
    for rank, result in enumerate(ranks(runs, "unfrozen")):
        assert max(result["weights"]) <= TOL, (rank, result["weights"])
        assert max(result["averages"]) <= TOL, (rank, result["averages"])


def test_checkpoint_restores_the_average_on_another_world_size_and_stage(runs: dict[str, Any]) -> None:
    """Saved on 2 ranks at stage 2 after 3 steps, loaded on 3 ranks at stage 3: the next 3 steps match
    the uninterrupted reference, weights and average, and the update count came back."""
    saver = ranks(runs, "saver")
    assert max(saver[0]["averages"]) <= TOL
    for rank, result in enumerate(ranks(runs, "resumed")):
        assert result["n_averaged_loaded"] == 3, rank
        assert max(result["weights"]) <= TOL, (rank, result["weights"])
        assert max(result["averages"]) <= TOL, (rank, result["averages"])


def test_without_an_average_kept_the_weights_loaded_are_the_average(runs: dict[str, Any]) -> None:
    """As Lightning's WeightAveraging writes ``state_dict``: the average is the checkpoint's weights."""
    for result in ranks(runs, "not_kept"):
        assert result["vs_average"] <= TOL
        assert result["vs_weights"] > 1e-3  # they differ: the check above is not vacuous


def test_consolidated_checkpoint_has_weight_averagings_layout(runs: dict[str, Any], tmp_path: Path) -> None:
    """``lightning-zero consolidate``: ``state_dict`` the average, ``current_model_state`` the weights,
    ``averaging_state`` the update count (what Lightning's WeightAveraging writes under "ddp")."""
    ranks(runs, "saver")
    saved = Path(runs["path"])
    out = tmp_path / "one.ckpt"
    consolidate(saved, out)
    checkpoint = torch.load(out, weights_only=True)
    assert int(checkpoint["averaging_state"]["n_averaged"]) == 3
    average, current = checkpoint["state_dict"], checkpoint["current_model_state"]
    assert average.keys() == current.keys()
    assert any(not torch.equal(average[k], current[k]) for k in average)
    whole = load_full_state_dict(saved)
    assert all(torch.equal(whole[k], average[k]) for k in average)
