"""ZeroStrategy(async_checkpoint=True) under Lightning's ModelCheckpoint, on 2 ranks.

Training goes on while a save is written (the writer is slowed down by fault injection in the launched
script); what is finally committed equals what a blocking save of the same run commits; a failure in
the background is raised on every rank at the next save or at the end of fit, and the checkpoint it
was to replace is kept.

The fits of both tests run in one 2-rank launch (a module fixture), each test's in its own directories.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero.checkpoint import EXTRA, META
from lightning_zero.cli import main as cli
from tests.distributed.test_lightning_parity import ROOT
from tests.launch import launch_env, run_script


def run_fits(cases: list[dict[str, Any]], tmp_path: Path, timeout_s: float = 180) -> list[list[dict]]:
    """The fits of ``cases`` in one 2-rank launch of ``tests.distributed.async_fit``; per rank, per fit,
    its report."""
    out = tmp_path / "reports"
    out.mkdir()
    script = [sys.executable, "-m", "tests.distributed.async_fit"]
    proc = run_script(
        [*script, "--out-dir", str(out), "--cases", json.dumps(cases)],
        2,
        cwd=ROOT,
        env=launch_env(),
        timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def _same(a: Any, b: Any, renamed: tuple[str, str]) -> bool:
    """Equal containers, tensors equal in value and dtype, strings equal once ``renamed[0]`` reads
    ``renamed[1]`` (the two runs wrote to different directories)."""
    if isinstance(a, str):
        return a.replace(*renamed) == b
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        a = {(k.replace(*renamed) if isinstance(k, str) else k): v for k, v in a.items()}
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k], renamed) for k in a)
    if isinstance(a, list | tuple):
        same_length = type(a) is type(b) and len(a) == len(b)
        return same_length and all(_same(x, y, renamed) for x, y in zip(a, b, strict=True))
    return a == b


def assert_same_checkpoint(ours: Path, reference: Path, renamed: tuple[str, str]) -> None:
    """Every shard, the model extras and meta.pt (but for file checksums) are equal."""
    assert cli(["verify", str(ours)]) == 0
    names = sorted(p.name for p in ours.iterdir())
    assert names == sorted(p.name for p in reference.iterdir()), names
    for name in names:
        a, b = (torch.load(d / name, weights_only=True) for d in (ours, reference))
        if name == META:
            a, b = ({k: v for k, v in m.items() if k != "files"} for m in (a, b))
        assert _same(a, b, renamed), (ours.name, name)
    assert {EXTRA, META} < set(names) and len(names) == 4  # two shards


PROBES = [3, 5, 7]
FAILURES = {
    "next_save": {"steps": 6, "fail_save": 2},
    "end_of_fit": {"steps": 5, "fail_save": 2},
    "link": {"steps": 6, "fail_save": 2, "save_last": "link"},
    "removal": {"steps": 6, "fail_remove": True},
}


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[dict]]]:
    """The in-background and blocking fits, then the failure cases, in one launch: per rank, per fit,
    its report."""
    tmp = tmp_path_factory.mktemp("async_checkpoint")
    cases = [
        {"checkpoint_dir": str(tmp / "async"), "slow_write_s": 1.0, "probe_steps": PROBES},
        {"checkpoint_dir": str(tmp / "sync"), "async_checkpoint": False, "probe_steps": PROBES},
    ]
    cases += [{"checkpoint_dir": str(tmp / n), "save_top_k": 1, **case} for n, case in FAILURES.items()]
    return tmp, run_fits(cases, tmp, timeout_s=300)


def test_training_goes_on_while_a_save_is_written_and_the_commit_equals_a_blocking_save(
    fits: tuple[Path, list[list[dict]]],
) -> None:
    """Saves at steps 2, 4, 6 (top 2), each shard write slowed by 1 s: after steps 3, 5 and 7 the save
    just issued is still in flight and its directory absent; the checkpoint top-k drops stays until the
    save replacing it is committed; the committed checkpoints equal a blocking run's."""
    async_dir, sync_dir = fits[0] / "async", fits[0] / "sync"
    reports = [rank_reports[:2] for rank_reports in fits[1]]
    for rank, (in_background, blocking) in enumerate(reports):
        assert in_background["error"] is None and blocking["error"] is None, rank
        seen = {p["step"]: p for p in in_background["probes"]}
        for step, issued, kept in ((3, 2, None), (5, 4, 2), (7, 6, 2)):
            assert seen[step]["pending"], (rank, seen[step])
            assert f"epoch=0-step={issued}.ckpt" not in seen[step]["entries"], (rank, seen[step])
            if kept is not None:
                assert f"epoch=0-step={kept}.ckpt" in seen[step]["entries"], (rank, seen[step])
        # the probe does see a commit when there is one
        done = {p["step"]: p for p in blocking["probes"]}
        assert "epoch=0-step=2.ckpt" in done[3]["entries"] and not done[3]["pending"], done[3]
    names = sorted(p.name for p in async_dir.iterdir())  # no temporary directory left
    assert names == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt"]
    assert names == sorted(p.name for p in sync_dir.iterdir())
    for name in names:
        assert_same_checkpoint(async_dir / name, sync_dir / name, (str(async_dir), str(sync_dir)))


def test_a_background_failure_is_raised_on_every_rank_and_the_previous_checkpoint_is_kept(
    fits: tuple[Path, list[list[dict]]],
) -> None:
    """Top-1 saves at steps 2, 4 (, 6). Rank 1 fails to write the step-4 shard: raised on both ranks at
    the step-6 save, or at the end of a fit that stops at step 5, or at once when a save_last="link"
    would point at it; the step-2 checkpoint stays (top-k's removal of it is dropped), valid. Rank 0
    fails to remove step 2 after step 4 committed: raised on both ranks at the step-6 save."""
    cases = FAILURES
    dirs = {name: fits[0] / name for name in cases}
    reports = [rank_reports[2:] for rank_reports in fits[1]]
    expected = {  # where it is raised, at which step, what it names, what the directory then holds
        "next_save": ("save_checkpoint", 6, "rank 1: OSError: injected", ["epoch=0-step=2.ckpt"]),
        "end_of_fit": ("teardown", 5, "rank 1: OSError: injected", ["epoch=0-step=2.ckpt"]),
        "link": ("save_checkpoint", 4, "rank 1: OSError: injected", ["epoch=0-step=2.ckpt", "last.ckpt"]),
        "removal": (
            "save_checkpoint",
            6,
            "rank 0: PermissionError: injected",
            ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"],
        ),
    }
    for rank, rank_reports in enumerate(reports):
        for name, report in zip(cases, rank_reports, strict=True):
            where, step, text, _ = expected[name]
            error = report["error"]
            assert error is not None, (rank, name)
            assert error["type"] == "CheckpointError" and text in error["message"], (rank, name, error)
            assert where in error["functions"] and report["global_step"] == step, (rank, name, error)
    for name, (_, _, _, entries) in expected.items():
        assert sorted(p.name for p in dirs[name].iterdir()) == entries, name  # no temporary directory left
        assert cli(["verify", str(dirs[name] / "epoch=0-step=2.ckpt")]) == 0
    last = dirs["link"] / "last.ckpt"
    assert last.is_symlink() and last.resolve() == (dirs["link"] / "epoch=0-step=2.ckpt").resolve()
