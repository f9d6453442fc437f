"""Exact data-position resume across processes with strategy "zero" (float64, TinyNet, no dropout).

The samples carry their index (`tests.distributed.resume_fit`), so each test checks both the final
parameters and which samples every optimizer step trained. 40 steps of a global batch of 8 cross two
epoch ends (15 steps per epoch); the checkpoint at step 20 is mid-epoch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.resume_fit import expected_rows
from tests.distributed.test_lightning_parity import ROOT, max_diff
from tests.launch import launch_env, run_script

BATCH = 4  # per rank and micro-batch: G = 2 ranks x 1 x 4 = 1 rank x 2 x 4 = 8


def launch(cases: list[dict[str, Any]], tmp_path: Path, devices: int) -> list[list[dict[str, Any]]]:
    """Run the fits in one fresh launch of `devices` processes; results[rank][case]."""
    out = tmp_path / "result.pt"
    env = launch_env()
    cases = [{"strategy": "zero", "devices": devices, "batch_size": BATCH, **case} for case in cases]
    proc = run_script(
        [
            sys.executable,
            "-m",
            "tests.distributed.resume_fit",
            "--out",
            str(out),
            "--cases",
            json.dumps(cases),
        ],
        devices,
        cwd=ROOT,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [torch.load(f"{out}.rank{rank}", weights_only=False) for rank in range(devices)]


def steps_to_samples(results: list[dict[str, Any]]) -> dict[int, list[int]]:
    """{step: sorted sample indices over all ranks and micro-batches} of one or more fits."""
    seen: dict[int, list[int]] = {}
    for result in results:
        for step, *indices in result["trained"]:
            seen.setdefault(step, []).extend(indices)
    return {step: sorted(indices) for step, indices in seen.items()}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[dict[str, Any]]]]:
    """[rank][0]: 40 steps uninterrupted; [rank][1]: 20 steps, then `trainer.save_checkpoint`."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    runs = launch([{"steps": 40}, {"steps": 20, "save": str(tmp / "half.ckpt")}], tmp, devices=2)
    for rank in (0, 1):
        assert "error" not in runs[rank][0], runs[rank][0].get("traceback")
        assert runs[rank][0]["trained"] == expected_rows(40, 2, 1, BATCH, rank)
    return tmp, runs


def test_resume_on_the_same_world_size_is_bit_identical(
    two_rank_runs: tuple[Path, list[list[dict[str, Any]]]], tmp_path: Path
) -> None:
    tmp, runs = two_rank_runs
    resumed = launch([{"steps": 40, "resume": str(tmp / "half.ckpt")}], tmp_path, devices=2)
    for rank in (0, 1):
        full, first, second = runs[rank][0], runs[rank][1], resumed[rank][0]
        assert first["trained"] + second["trained"] == full["trained"], f"rank {rank}: samples differ"
        assert max_diff(second["params"], full["params"]) == 0.0


def test_resume_on_one_rank_with_accumulation_continues_the_same_global_batches(
    two_rank_runs: tuple[Path, list[list[dict[str, Any]]]], tmp_path: Path
) -> None:
    """2 ranks x 4 -> 1 rank x 2 micro-batches x 4: the same 8 samples per step; another global
    batch (1 x 1 x 4) is refused before training."""
    tmp, runs = two_rank_runs
    ckpt = str(tmp / "half.ckpt")
    one, refused = launch(
        [{"steps": 40, "accum": 2, "resume": ckpt}, {"steps": 40, "accum": 1, "resume": ckpt}], tmp_path, 1
    )[0]
    assert "error" not in one, one.get("traceback")
    assert max_diff(one["params"], runs[0][0]["params"]) <= 1e-10
    full = steps_to_samples(runs[0][0:1] + runs[1][0:1])
    assert steps_to_samples([runs[0][1], runs[1][1], one]) == full and sorted(full) == list(range(40))
    assert (
        "DataResumeError" in refused["error"]
        and "global batch of 8 samples (2 ranks x 1 micro-batches x 4)" in (refused["error"])
    )
