"""SIGUSR1 on one of 2 ranks: both stop at the same step boundary, save once in the run's checkpoint
series, and `ckpt_path="last"` ends bit-identical to an uninterrupted fit; the series is pruned.

One launch of `tests.recipes.requeue_fit` (strategy "zero", float64, accumulate 2, saves every 4
steps, 12 steps) runs all cases in order: uninterrupted; stopped then resumed with `save_last=True`;
stopped then resumed with `save_last="link"`, with an incomplete directory and a truncated file planted
in the series before that resume. The real SLURM requeue is in `tests/cluster/`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from recipes.sbatch import ROOT
from tests.launch import launch_env, run_script
from tests.recipes.params import assert_same_parameters

STEPS, SIGNAL_AT = 12, 5
STOP = SIGNAL_AT + 2  # rank 1's flag goes out with the agreement launched at 6, read by all at 7
CASES = [
    {"name": "full", "steps": STEPS},
    {"name": "copy", "steps": STEPS, "signal_at": SIGNAL_AT},
    {"name": "copy", "steps": STEPS, "resume": "last"},
    {"name": "link", "steps": STEPS, "signal_at": SIGNAL_AT, "save_last": "link"},
    {"name": "link", "steps": STEPS, "resume": "last", "save_last": "link", "plant": True},
]
FULL, COPY_STOP, COPY_RESUME, LINK_STOP, LINK_RESUME = range(len(CASES))


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[dict[str, Any]]]]:
    """(series root, results[rank][case]) of one 2-rank launch of every case."""
    root = tmp_path_factory.mktemp("requeue")
    out = root / "result.pt"
    command = [
        sys.executable,
        "-m",
        "tests.recipes.requeue_fit",
        "--out",
        str(out),
        "--root",
        str(root / "runs"),
    ]
    run = run_script(
        [*command, "--cases", json.dumps(CASES)],
        2,
        cwd=ROOT,
        env=launch_env(),
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = [torch.load(f"{out}.rank{rank}", weights_only=False) for rank in (0, 1)]
    for rank_results in results:
        for case, result in zip(CASES, rank_results, strict=True):
            assert "error" not in result, (case, result.get("traceback"))
    return root / "runs", results


def test_one_signalled_rank_stops_every_rank_at_the_same_step(fits: tuple[Path, list[Any]]) -> None:
    _, results = fits
    for stopped in (COPY_STOP, LINK_STOP):
        assert [results[rank][stopped]["global_step"] for rank in (0, 1)] == [STOP, STOP]


def test_the_stop_is_one_save_and_nothing_follows_it(fits: tuple[Path, list[Any]]) -> None:
    _, results = fits
    for rank in (0, 1):
        # save_last=True: every periodic save writes the step and its copy; the stop writes `last` only
        assert results[rank][COPY_STOP]["saves"] == [4, 4, STOP]
        # save_last="link": one write per step throughout, the stop included
        assert results[rank][LINK_STOP]["saves"] == [4, STOP]
        assert results[rank][LINK_RESUME]["saves"] == [8, 12]


def test_agreement_costs_one_async_collective_per_optimizer_step(fits: tuple[Path, list[Any]]) -> None:
    _, results = fits
    for rank in (0, 1):
        assert results[rank][FULL]["agreements"] == STEPS  # not one per micro-batch (24)
        assert results[rank][COPY_STOP]["agreements"] == STOP - 1  # the one read at STOP launches none
        assert results[rank][COPY_RESUME]["agreements"] == STEPS - STOP


def test_resume_from_last_ends_as_the_uninterrupted_fit(fits: tuple[Path, list[Any]]) -> None:
    _, results = fits
    for rank in (0, 1):
        full = results[rank][FULL]
        for stopped, resumed in ((COPY_STOP, COPY_RESUME), (LINK_STOP, LINK_RESUME)):
            first, second = results[rank][stopped], results[rank][resumed]
            assert second["ckpt_path"] == "last.ckpt" and second["global_step"] == STEPS
            rows = [row for row in first["trained"] if row[0] < STOP] + second["trained"]
            assert rows == full["trained"], "samples trained twice, skipped or out of order"
            assert_same_parameters(second["params"], full["params"])


def test_the_series_is_pruned_like_periodic_saves(fits: tuple[Path, list[Any]]) -> None:
    root, results = fits
    assert results[0][COPY_STOP]["files"] == ["last.ckpt", "step000004.ckpt"]
    assert results[0][COPY_RESUME]["files"] == ["last.ckpt", "step000012.ckpt"]
    assert results[0][LINK_STOP]["files"] == ["last.ckpt", f"step{STOP:06d}.ckpt"]  # step 4 pruned by it
    planted = ["step000098.ckpt", "step000099.ckpt"]  # skipped by "last", not the callback's to delete
    assert results[0][LINK_RESUME]["files"] == sorted(["last.ckpt", "step000012.ckpt", *planted])
    assert (root / "link" / "last.ckpt").resolve() == (root / "link" / "step000012.ckpt").resolve()
