"""``examples/fabric_pretrain.py`` as the README runs it (Lightning's launcher, two CPU processes)
trains and writes a complete sharded checkpoint. (torchrun: ``test_fabric.py``; SLURM:
``tests/cluster``.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
