"""`python -m recipes.pretrain` end to end: a short 2-rank run, its resume with `ckpt_path=last`, and the
bad inputs that must fail with one clear message, a non-zero status and earlier runs untouched.

Every run that trains goes through a separate process (a 2-process Lightning fit inside pytest would
re-run pytest as rank 1): rank 0 forked from a warm interpreter (`tests.launch`), the rank Lightning's
launcher starts a fresh one. Commands that end before any training (the refusals, `--cfg job`) run in this
interpreter the way `python -m` runs them (`runpy`, `sys.argv`, the exit status from `SystemExit`),
which saves a fresh interpreter's ~10 s of imports each; one refusal also runs as a real subprocess and
must give the same status and message, so the in-process runs stand for the command.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import runpy
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from recipes.training.module import lr_factor
from tests.conf.compose import flatten, group_file_values
from tests.launch import launch_env, run_script

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 150
LAUNCH_VARS = frozenset({"LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"})


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str


def pretrain(
    *overrides: str, timeout_s: int = TIMEOUT_S, without: tuple[str, ...] = (), fresh: bool = False
) -> Result:
    """`python -m recipes.pretrain OVERRIDES`, rank 0 forked from a warm interpreter (`tests.launch`;
    the ranks Lightning's launcher starts are fresh processes) unless `fresh`; `without`: in a fresh
    interpreter lacking those packages."""
    # A test run inside a SLURM job or a launcher must not make Lightning join that job instead.
    env = {k: v for k, v in launch_env(HYDRA_FULL_ERROR="0").items() if not k.startswith("SLURM_")}
    env = {k: v for k, v in env.items() if k not in LAUNCH_VARS}
    command = [sys.executable, "-m", "recipes.pretrain", *overrides]
    if not without and not fresh:
        proc = run_script(command, 1, cwd=REPO_ROOT, env=env, timeout=timeout_s)
        return Result(proc.returncode, proc.stdout, proc.stderr)
    if without:
        command[1:2] = ["-m", "tests.recipes.without_packages", ",".join(without)]
    proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def exit_status(code: object) -> int:
    """The status a process ends with after `sys.exit(code)`."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


@pytest.fixture
def pretrain_here(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Iterator[Callable]:
    """`pretrain` for commands that end before training, run in this interpreter as `python -m` runs the
    module, with the subprocess's environment (no launcher variables, `HYDRA_FULL_ERROR=0`, the
    repository as working directory); Hydra's global state is cleared by `@hydra.main` itself, the root
    logger (which Hydra configures) is restored afterwards."""
    for name in list(os.environ):
        if name.startswith("SLURM_") or name in LAUNCH_VARS:
            monkeypatch.delenv(name)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    monkeypatch.chdir(REPO_ROOT)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level

    def run(*overrides: str) -> Result:
        monkeypatch.setattr(sys, "argv", ["recipes.pretrain", *overrides])
        capsys.readouterr()
        try:
            runpy.run_module("recipes.pretrain", run_name="__main__", alter_sys=True)
            status = 0
        except SystemExit as stop:
            status = exit_status(stop.code)
        finally:
            root.handlers[:] = handlers
            root.setLevel(level)
        out, err = capsys.readouterr()
        return Result(status, out, err)

    yield run


def small_run(output_root: Path, cache_dir: Path, *extra: str) -> list[str]:
    """Overrides for a few-second 2-process run of a very small model on 0.2 MB of stdlib text, in
    `<output_root>/e2e` named with Hydra's own `hydra.run.dir` (Lightning re-runs the command for rank 1
    with the resolved directory, and `ckpt_path=last` must find it again)."""
    return [
        f"hydra.run.dir={output_root / 'e2e'}",
        f"data.cache_dir={cache_dir}",
        "data.max_corpus_mb=0.2",
        "data.seq_len=64",
        "data.batch_size=4",
        "model.n_layer=2",
        "model.d_model=64",
        "model.n_head=2",
        "trainer.devices=2",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "callbacks.model_checkpoint.every_n_train_steps=3",
        "optim.warmup_steps=2",
        "sample.max_new_tokens=16",
        *extra,
    ]


def read_metrics(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return [{k: v for k, v in row.items() if v} for row in csv.DictReader(handle)]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Result, Result]:
    """A 4-step 2-rank run, then the same command with ckpt_path=last up to step 6, at stage 3 (its
    units the blocks): a stage-2 checkpoint resumes there, and every rank samples from the model
    stage 3 leaves sharded after fit. The second traces its two steps (`callbacks=trace`)."""
    root = tmp_path_factory.mktemp("e2e")
    first = pretrain(*small_run(root / "outputs", root / "cache"))
    assert first.returncode == 0, first.stderr[-3000:]
    resume = ["ckpt_path=last", "trainer.max_steps=6", "strategy=zero3", "strategy.min_unit_numel=10000"]
    resume += ["callbacks=trace", "callbacks.trace.steps=[4,5]"]
    second = pretrain(*small_run(root / "outputs", root / "cache", *resume))
    assert second.returncode == 0, second.stderr[-3000:]
    return root / "outputs" / "e2e", first, second


def test_two_process_run_reports_sample_and_locations(two_runs: tuple[Path, Result, Result]) -> None:
    run_dir, first, second = two_runs
    assert "All distributed processes registered. Starting with 2 processes" in first.stderr
    assert [line.startswith("training ") for line in first.stdout.splitlines()].count(True) == 1  # rank 0
    assert "--- sample" in first.stdout and first.stdout.count("--- sample") == 1
    assert f"run directory: {run_dir.resolve()}" in first.stdout
    assert f"checkpoint: {(run_dir / 'checkpoints' / 'last.ckpt').resolve()}" in first.stdout
    assert f"loss curves: {(run_dir / 'loss.png').resolve()}" in first.stdout
    assert "--- sample" in second.stdout and second.stdout.count("--- sample") == 1  # stage 3
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = read_metrics(run_dir / "logs" / "version_0" / "metrics.csv")
    assert any("val/ppl" in row for row in metrics) and any("tokens_per_s" in row for row in metrics)


def test_ranks_share_one_run_directory(two_runs: tuple[Path, Result, Result]) -> None:
    run_dir, _, _ = two_runs
    assert [p.name for p in run_dir.parent.iterdir()] == ["e2e"]
    files = ["checkpoints", "config.yaml", "logs", "loss.png", "trace-rank0.json", "trace-rank1.json"]
    assert sorted(p.name for p in run_dir.iterdir()) == files
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["version_0", "version_1"]


def test_resume_continues_step_and_schedule(two_runs: tuple[Path, Result, Result]) -> None:
    run_dir, first, second = two_runs
    assert "from global step 0" in first.stdout and "from global step 4" in second.stdout
    last = run_dir / "checkpoints" / "last.ckpt"
    if last.is_dir():  # strategy "zero": a sharded checkpoint directory
        from lightning_zero.checkpoint import read_meta

        assert read_meta(last)["lightning"]["global_step"] == 6
    else:
        assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 6
    resumed = [
        row for row in read_metrics(run_dir / "logs" / "version_1" / "metrics.csv") if "train/loss" in row
    ]
    assert len(resumed) == 2  # steps 4 and 5 only: nothing of the first run is trained again
    first_lr = float(min(resumed, key=lambda row: int(row["step"]))["lr"])
    # scheduler state restored and re-evaluated for the new max_steps: step 4 of a 6-step cosine
    assert first_lr == pytest.approx(3e-3 * lr_factor(4, 2, 6, 0.1), rel=1e-5)


def test_a_trace_of_the_chosen_steps_names_the_schedule(two_runs: tuple[Path, Result, Result]) -> None:
    """`callbacks=trace callbacks.trace.steps=[4,5]` on the resumed stage-3 run: each rank's Chrome
    trace holds the two steps, every gradient bucket's launch and update, every block's gather and
    free."""
    run_dir, _, _ = two_runs
    for rank in (0, 1):
        events = json.loads((run_dir / f"trace-rank{rank}.json").read_text())["traceEvents"]
        names = {e["name"] for e in events if e.get("ph") == "X"}
        assert sum(n.startswith("ProfilerStep#") for n in names) == 2, sorted(names)[:20]
        ours = sorted(n for n in names if n.startswith("lightning_zero "))
        buckets = {n.split(":")[0] for n in ours if n.startswith("lightning_zero bucket ")}
        assert len(buckets) >= 2, ours
        for bucket in buckets:
            assert {f"{bucket}: launch", f"{bucket}: update"} <= names, (bucket, ours)
        for block in (0, 1):  # model.n_layer=2
            for verb in ("gather", "free"):
                assert any(
                    re.fullmatch(rf"lightning_zero unit \S*blocks\.{block}: {verb}", n) for n in ours
                ), ours


@pytest.fixture
def earlier_run(tmp_path: Path) -> tuple[Path, dict[str, tuple[float, bytes]]]:
    """A stand-in for a finished run named `e2e`, and a snapshot of its files."""
    run_dir = tmp_path / "outputs" / "e2e"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"earlier")
    (run_dir / "config.yaml").write_text("earlier: true\n")
    return run_dir, snapshot(run_dir)


def snapshot(directory: Path) -> dict[str, tuple[float, bytes]]:
    return {str(p): (p.stat().st_mtime, p.read_bytes()) for p in directory.rglob("*") if p.is_file()}


BAD_INPUTS = [
    (["model=gpt5"], "Could not find 'model/gpt5'"),
    (["data=wikipedia"], "Could not find 'data/wikipedia'"),
    (["data=text"], "missing mandatory value(s): data.path"),
    (["data.path=/nonexistent/*.txt"], "data.path='/nonexistent/*.txt': no file matches"),
    (["data.path=EMPTY"], "the corpus is empty"),
    (["data=tokens", "data.path=EMPTY"], "data.tokenizer=null needs data.path to be a directory written"),
    (["data.seq_len=512"], "data.seq_len=512 exceeds model.max_seq_len=256"),
    ([f"trainer.devices={len(os.sched_getaffinity(0)) + 1}"], "CPU cores"),
    (["model.n_layer=two"], "model.n_layer"),
    (["+optim.momentum=0.9"], "unknown key(s): optim.momentum"),
    (["+trainer.max_step=5"], "takes no argument 'max_step'; did you mean max_steps"),
    (["run_dir=ELSEWHERE"], "set hydra.run.dir=ELSEWHERE instead"),
    (["run_name=never_ran", "ckpt_path=last"], "ckpt_path=last: no checkpoint"),
    (
        ["callbacks=trace", "callbacks.trace.steps=[7,5]"],
        "callbacks.trace (recipes.training.trace.StepTrace): steps=[7, 5]",
    ),
]


def refuse(
    run: Callable[..., Result],
    overrides: list[str],
    expected: str,
    earlier_run: tuple[Path, dict[str, tuple[float, bytes]]],
) -> Result:
    """`run` (`pretrain` or `pretrain_here`) the bad input next to an earlier run; check the refusal."""
    run_dir, before = earlier_run
    empty = run_dir.parent.parent / "empty.txt"
    empty.write_text("")
    elsewhere = run_dir.parent.parent / "elsewhere"
    overrides = [o.replace("EMPTY", str(empty)) for o in overrides]
    expected = expected.replace("ELSEWHERE", str(elsewhere))
    overrides = [o.replace("ELSEWHERE", str(elsewhere)) for o in overrides]
    result = run(f"output_root={run_dir.parent}", "run_name=e2e", *overrides)
    assert result.returncode != 0
    assert expected in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert snapshot(run_dir) == before
    assert [p.name for p in run_dir.parent.iterdir()] == ["e2e"]  # no stray run directory
    assert not elsewhere.exists()
    return result


@pytest.mark.parametrize(("overrides", "expected"), BAD_INPUTS)
def test_bad_input_fails_clearly_and_leaves_earlier_runs(
    overrides: list[str],
    expected: str,
    earlier_run: tuple[Path, dict[str, tuple[float, bytes]]],
    pretrain_here: Callable[..., Result],
) -> None:
    refuse(pretrain_here, overrides, expected, earlier_run)


def test_a_refusal_through_the_command_line_is_the_one_run_in_process(
    earlier_run: tuple[Path, dict[str, tuple[float, bytes]]], pretrain_here: Callable[..., Result]
) -> None:
    """The real `python -m recipes.pretrain` with a bad input that Hydra rejects while composing: the same
    status and message as the in-process run the other cases use. (A refusal of ours, exit status 2
    after validation, runs as a real command in the missing-package test below.)"""
    overrides, expected = BAD_INPUTS[0]
    there = refuse(lambda *o: pretrain(*o, timeout_s=60, fresh=True), overrides, expected, earlier_run)
    here = refuse(pretrain_here, overrides, expected, earlier_run)
    assert there.returncode == here.returncode == 1, (there.returncode, here.returncode)
    assert here.stderr.strip() and here.stderr.strip() in there.stderr, (here.stderr, there.stderr)


def test_cfg_job_prints_the_config_without_running(
    tmp_path: Path, pretrain_here: Callable[..., Result]
) -> None:
    result = pretrain_here("--cfg", "job", f"output_root={tmp_path}", "model.n_layer=3")
    assert result.returncode == 0
    assert "n_layer: 3" in result.stdout and "_target_: lightning_zero.ZeroStrategy" in result.stdout
    assert not any(tmp_path.iterdir())


def test_cfg_job_of_user_choices_shows_their_values_and_the_groups_defaults(
    pretrain_here: Callable[..., Result],
) -> None:
    """`model=llama_1b trainer=gpu data=text`: every value of those group files, nothing of the demo."""
    choices = {"model": "llama_1b", "trainer": "gpu", "data": "text", "cluster": "slurm"}
    overrides = [f"{group}={option}" for group, option in choices.items()]
    result = pretrain_here("--cfg", "job", *overrides, "data.path=corpus.txt", "trainer.max_steps=77")
    assert result.returncode == 0, result.stderr[-2000:]
    shown = flatten(OmegaConf.to_container(OmegaConf.create(result.stdout), resolve=False))
    expected: dict[str, object] = {}
    for group, option in choices.items():
        expected.update(group_file_values(group, option))
    expected.update({"data.path": "corpus.txt", "trainer.max_steps": 77})
    assert {key: shown[key] for key in expected} == expected
    assert (
        shown["trainer.devices"] == "auto"
        and shown["optim.lr"] == 4e-4
        and shown["optim.warmup_steps"] == 2000
    )
    assert shown["run_name"] == "${recipe.run_name:}"  # llama_1b-text-gpu once resolved, not cpu_demo


def test_debug_fdr_runs_one_batch_in_one_process_writing_no_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "fdr"
    result = pretrain(
        "debug=fdr",
        f"hydra.run.dir={run_dir}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.max_corpus_mb=0.2",
        "sample.max_new_tokens=4",
        timeout_s=90,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Running in `fast_dev_run` mode: will run the requested loop using 1 batch(es)" in result.stderr
    assert "Starting with 1 processes" in result.stderr  # debug: one process
    assert "finished at step 1" in result.stdout
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]  # no checkpoints, no logs


def test_a_missing_optional_package_stops_the_run_before_its_first_step(tmp_path: Path) -> None:
    """Without matplotlib (as far as any code can tell: `tests.recipes.without_packages`) the default loss
    plot is refused before any process starts, naming the override that goes without it; that override
    then trains. (The recipe used to train to the end and fail drawing, before its final save.)"""
    run_dir = tmp_path / "e2e"
    overrides = small_run(tmp_path, tmp_path / "cache", "trainer.devices=1", "trainer.max_steps=2")
    refused = pretrain(*overrides, without=("matplotlib",), timeout_s=90)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "error: callbacks.loss_plot (recipes.training.plot.LossPlot): " in refused.stderr
    assert "matplotlib" in refused.stderr and "leave it out with callbacks.loss_plot=null" in refused.stderr
    assert "Traceback" not in refused.stderr and "Starting with" not in refused.stderr  # no process
    assert not run_dir.exists()  # not a step, not a log, not a config.yaml
    trained = pretrain(*overrides, "callbacks.loss_plot=null", without=("matplotlib",))
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "finished at step 2" in trained.stdout and "loss curves" not in trained.stdout
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "config.yaml", "logs"]
