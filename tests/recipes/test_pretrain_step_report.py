"""The recipe's end of run writes the step report when its log directory holds a step profile
(`strategy.profile_steps` was set), and prints where and the three lines; without one it writes and
prints nothing of it. `recipes.pretrain.report` is called as `main` calls it, on rank 0, with a stand-in
for the finished run (no training)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from lightning_zero.report import PROFILE_FILE
from recipes.pretrain import report
from tests.unit.test_report import profile_json


def finished_run(run_dir: Path) -> SimpleNamespace:
    trainer = SimpleNamespace(global_step=4, callback_metrics={}, loggers=[], callbacks=[])
    return SimpleNamespace(trainer=trainer, run_dir=run_dir, checkpoint_callback=None)


@pytest.mark.parametrize("profiled", [True, False], ids=["profiled", "not_profiled"])
def test_the_run_ends_with_the_step_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], profiled: bool
) -> None:
    log_dir = tmp_path / "logs" / "version_0"
    log_dir.mkdir(parents=True)
    if profiled:
        (log_dir / PROFILE_FILE).write_text(json.dumps(profile_json()))
    cfg = OmegaConf.create({"sample": {"max_new_tokens": 8, "prompt": "def "}})
    report(finished_run(tmp_path), cfg, "def x", log_dir)  # type: ignore[arg-type]
    printed = capsys.readouterr().out.splitlines()
    written = sorted(p.name for p in log_dir.iterdir())
    if not profiled:
        assert written == [] and not any("step report" in line for line in printed)
        return
    assert written == sorted(
        [PROFILE_FILE, "step_report.md", "step_parts.png", "comm_share.png", "memory.png"]
    )
    at = printed.index(f"step report: {(log_dir / 'step_report.md').resolve()}")
    assert printed[at + 1].startswith("  step ") and printed[at + 3].startswith("  look at first: ")
