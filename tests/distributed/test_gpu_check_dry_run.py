"""benchmarks/gpu_check.py is the one prepared run for a GPU machine (no CI has one): its dry run on
CPU keeps every part of it working, so the device time of a future session is not lost to a typo."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.launch import launch_env, run_script

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_runs_on_cpu(tmp_path: Path) -> None:
    cmd = [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--quick", "--steps", "4"]
    proc = run_script([*cmd, "--out", str(tmp_path)], 1, cwd=ROOT, env=launch_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["parity"]["float32"]["max_abs_diff_after_20_steps"] <= 1e-6
    assert report["parity"]["bfloat16"]["max_abs_diff_after_20_steps"] <= 2e-2
    for key, run in report["train"].items():
        if isinstance(run, dict):
            assert "error" not in run, (key, run)
            assert run["tokens_per_s"] > 0 and run["test_after_fit_best"]["test/loss"] > 0, key
    assert report["two_processes"]["max_abs_diff_vs_adamw_rank0"] <= 1e-4
    parity = report["parity"]["float32"]
    assert parity["collectives"] > 0 and parity["comm_wait_s"] > 0.0  # the wait timing is read back
    # torch's AdamW keeps bf16 moments for bf16 parameters (8 bytes each); ours fp32 masters (18)
    ddp, zero = (
        report["train"][f"tiny/bf16-true/{name}"]["model_state_formula_gib"] for name in ("ddp", "zero")
    )
    assert abs(ddp / zero - 8 / 18) < 1e-12, (ddp, zero)
