"""Fabric launch paths: ``examples/fabric_pretrain.py`` as the README runs it (Lightning's launcher,
two CPU processes) writes a complete sharded checkpoint, and ``torchrun`` gives the launcher's result
bit for bit. (SLURM: ``tests/cluster``.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from lightning_zero.checkpoint import read_meta, verify_files

ROOT = Path(__file__).resolve().parents[2]


def test_fabric_example_trains_and_saves(tmp_path: Path) -> None:
    out = tmp_path / "example.ckpt"
    args = ["--steps", "3", "--accum", "2", "--batch-size", "2", "--seq-len", "32", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "examples.fabric_pretrain", *args],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "step    2  loss" in proc.stdout and "tokens/s" in proc.stdout
    meta = read_meta(out)
    assert meta["world_size"] == 2 and meta["lightning"]["step"] == 3
    assert verify_files(out, meta) == []


def test_torchrun_matches_lightning_launcher(tmp_path: Path) -> None:
    case = [{"strategy": "zero", "steps": 4, "accum": 2, "clip": 0.05}]
    module = ["-m", "tests.distributed.fabric_loop", "--devices", "2", "--cases", json.dumps(case)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    results = []
    for name, command in (("launcher", [sys.executable]), ("torchrun", torchrun)):
        out = tmp_path / f"{name}.pt"
        proc = subprocess.run(
            [*command, *module, "--out", str(out)],
            cwd=ROOT,
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        results.append(torch.load(out, weights_only=False)[0])
    launcher, torchrun_result = results
    for name, value in launcher.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, torchrun_result[name]), name
    assert launcher["recorded"]["elements"] == torchrun_result["recorded"]["elements"]
