"""``skip_nonfinite_steps`` through ``Trainer(strategy="zero")`` and ``Fabric(strategy="zero")``: a loss
that becomes NaN on rank 1 at one micro-batch of one step gives the parameters of a run that dropped
that step's gradients on every rank (bit for bit, float64), ``zero/skipped_steps`` is logged (Trainer)
and ``optimizer.skipped_steps`` counts (Fabric), K skipped steps in a row raise on every rank naming
the step and the rank, and fp16 loss scaling's own overflow skip is unchanged and not counted.

One launch for the Trainer fits (``tests/distributed/lit_fit.py``) and one for the Fabric loops
(``tests/distributed/fabric_loop.py``), both on 2 ranks, as module fixtures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import test_fabric as fabric_launch
from tests.distributed import test_lightning_parity as trainer_launch

TRAINER = {"devices": 2, "accum": 2, "steps": 6, "unused_every": 0}
FP16 = {"devices": 2, "precision": "16-mixed-cpu", "steps": 6, "unused_every": 0, "inf_at_step": 3}
FABRIC = {"strategy": "zero", "steps": 8, "accum": 2, "clip": 0.05}


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("nonfinite_trainer")
    named = {
        "guarded": dict(TRAINER, skip_nonfinite_steps=3, nan_at=[[2, 1]], csv_dir=str(tmp)),
        "dropped": dict(TRAINER, skip_step=2),
        "raises": dict(TRAINER, skip_nonfinite_steps=2, nan_at=[[1, 0], [3, 1], [4, 0]], expect_error=True),
        "fp16_guarded": dict(FP16, skip_nonfinite_steps=1),
        "fp16": FP16,
        "first_steps": dict(TRAINER, steps=3, save=str(tmp / "at3.ckpt")),
        "resumed_raises": dict(
            TRAINER,
            resume=str(tmp / "at3.ckpt"),
            skip_nonfinite_steps=2,
            nan_at=[[3, 0], [4, 1]],
            expect_error=True,
        ),
    }
    out = trainer_launch.launch(list(named.values()), tmp, timeout_s=300)
    return tmp, dict(zip(named, out, strict=True))


@pytest.fixture(scope="module")
def fabric_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    named = {
        "guarded": dict(FABRIC, skip_nonfinite_steps=3, nan_at=[[3, 1]]),
        "dropped": dict(FABRIC, skip_step=3),
        "raises": dict(
            FABRIC, skip_nonfinite_steps=2, nan_at=[[2, 0], [3, 1]], expect_error=True, every_rank=True
        ),
        "fp16_guarded": {
            "strategy": "zero",
            "precision": "16-mixed-cpu",
            "inf_at_step": 3,
            "skip_nonfinite_steps": 1,
        },
        "fp16": {"strategy": "zero", "precision": "16-mixed-cpu", "inf_at_step": 3},
    }
    out = fabric_launch.launch(list(named.values()), 2, tmp_path_factory.mktemp("nonfinite_fabric"))
    return dict(zip(named, out, strict=True))


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The two runs' parameters (``net.*``; the results also hold counters) are bit-identical."""
    keys = [k for k in a if k.startswith("net.")]
    assert keys and keys == [k for k in b if k.startswith("net.")]
    return all(torch.equal(a[k], b[k]) for k in keys)


def test_trainer_nan_on_one_rank_is_skipped_everywhere_and_logged(trainer_runs: tuple[Path, dict]) -> None:
    tmp, runs = trainer_runs
    assert all(bool(torch.isfinite(v).all()) for v in runs["guarded"].values())
    assert _equal(runs["guarded"], runs["dropped"]), "must equal the run that dropped step 2's gradients"
    assert int(runs["guarded"]["skipped_steps"]) == 1
    rows = (tmp / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    logged = {
        int(float(r.split(",")[header.index("step")])): float(
            r.split(",")[header.index("zero/skipped_steps")]
        )
        for r in rows[1:]
        if r.split(",")[header.index("zero/skipped_steps")]
    }
    assert logged == {0: 0.0, 1: 0.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0}, logged


def test_trainer_consecutive_skips_raise_on_every_rank(trainer_runs: tuple[Path, dict]) -> None:
    """NaN at steps 1, 3 and 4: step 1 is skipped, step 2 updates, steps 3 and 4 are two in a row."""
    error = trainer_runs[1]["raises"]
    assert len(error["every_rank"]) == 2 and len(set(error["every_rank"])) == 1, error
    assert (
        "NonFiniteGradientError: non-finite gradients (inf/NaN) at optimizer step 4 on rank(s) 1"
        in error["error"]
    )
    assert "(steps 3 to 4)" in error["error"]


def test_trainer_error_names_the_global_step_after_a_resume(trainer_runs: tuple[Path, dict]) -> None:
    """Resumed at step 3, NaN at steps 3 and 4: the error names Lightning's step 4, not the fresh
    optimizer's second step."""
    error = trainer_runs[1]["resumed_raises"]
    assert len(set(error["every_rank"])) == 1, error
    assert "at optimizer step 4 on rank(s) 1" in error["error"] and "(steps 3 to 4)" in error["error"]


def test_trainer_fp16_loss_scaling_skip_is_unchanged_and_not_counted(trainer_runs: tuple[Path, dict]) -> None:
    """An fp16 overflow is the scaler's business: with the guard at 1 (raise at the first skip of its
    own) the run equals the unguarded one bit for bit, backs the scale off, and counts nothing."""
    runs = trainer_runs[1]
    assert _equal(runs["fp16_guarded"], runs["fp16"])
    # 2**10, doubled every 2 good steps (growth_interval=2): x2 after step 1, halved at step 3's
    # overflow, x2 after step 5; 2**13 had the scaler not skipped step 3
    assert float(runs["fp16_guarded"]["loss_scale"]) == float(runs["fp16"]["loss_scale"]) == 2.0**11
    assert int(runs["fp16_guarded"]["skipped_steps"]) == 0


def test_fabric_nan_on_one_rank_is_skipped_everywhere(fabric_runs: dict[str, Any]) -> None:
    """With norm clipping on: ``fabric.clip_gradients`` leaves the NaN norm to the skip (no raise)."""
    guarded, dropped = fabric_runs["guarded"], fabric_runs["dropped"]
    assert _equal(guarded, dropped), "must equal the loop that skipped step 3"
    assert guarded["recorded"]["lrs"] == dropped["recorded"]["lrs"], "the schedule steps on a skipped step"
    assert guarded["recorded"]["skipped"] == [0, 0, 0, 1, 1, 1, 1, 1]


def test_fabric_consecutive_skips_raise_on_every_rank(fabric_runs: dict[str, Any]) -> None:
    error = fabric_runs["raises"]
    assert len(error["every_rank"]) == 2 and len(set(error["every_rank"])) == 1, error
    assert "at optimizer step 3 on rank(s) 1" in error["error"] and "(steps 2 to 3)" in error["error"]


def test_fabric_fp16_loss_scaling_skip_is_unchanged_and_not_counted(fabric_runs: dict[str, Any]) -> None:
    guarded, plain = fabric_runs["fp16_guarded"], fabric_runs["fp16"]
    assert _equal(guarded, plain) and guarded["loss_scale"] == plain["loss_scale"] == 2.0**9
    assert guarded["recorded"]["skipped"] == [0] * 6
