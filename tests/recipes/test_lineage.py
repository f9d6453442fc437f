"""The run's checkpoint series without a process group: which checkpoint is the newest complete one,
when a requeued job resumes from it, what `SlurmRequeue` refuses, and the tokenizer copy."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero.checkpoint import FORMAT_VERSION, META
from recipes.training.callbacks import (
    RunCheckpoint,
    SlurmRequeue,
    StopAgreement,
    TokenizerCopy,
    requeued_resume_path,
    unscheduled_save_problem,
)
from recipes.training.lineage import is_complete, newest_checkpoint


def sharded(path: Path, mtime: float, shard: bytes = b"shard", listed_size: int | None = None) -> Path:
    """A lightning-zero checkpoint directory whose meta.pt lists one shard of `listed_size` bytes."""
    path.mkdir()
    (path / "shard-00000-of-00001.pt").write_bytes(shard)
    files = {"shard-00000-of-00001.pt": {"size": listed_size or len(shard), "sha256": ""}}
    torch.save({"format_version": FORMAT_VERSION, "files": files}, path / META)
    os.utime(path, (mtime, mtime))
    return path


def saved_file(path: Path, mtime: float) -> Path:
    torch.save({"global_step": 1}, path)
    os.utime(path, (mtime, mtime))
    return path


def test_newest_complete_checkpoint_by_write_time(tmp_path: Path) -> None:
    saved_file(tmp_path / "step000010.ckpt", 100)
    newest = sharded(tmp_path / "step000020.ckpt", 200)
    sharded(tmp_path / "step000050.ckpt", 50)  # a higher step written earlier: an abandoned branch
    (tmp_path / ".step000030.ckpt.tmp-abc").mkdir()  # a save in progress is no *.ckpt
    (tmp_path / "notes.txt").write_text("x")
    assert newest_checkpoint(tmp_path) == newest


@pytest.mark.parametrize(
    "incomplete",
    ["no meta.pt", "a shard shorter than listed", "a file cut short", "a dangling last link", "not a zip"],
)
def test_an_incomplete_newer_checkpoint_is_skipped(incomplete: str, tmp_path: Path) -> None:
    complete = sharded(tmp_path / "step000010.ckpt", 100)
    path = tmp_path / "step000020.ckpt"
    if incomplete == "no meta.pt":
        path.mkdir()
        (path / "shard-00000-of-00001.pt").write_bytes(b"shard")
    elif incomplete == "a shard shorter than listed":
        sharded(path, 200, listed_size=1000)
    elif incomplete == "a file cut short":
        whole = saved_file(path, 200).read_bytes()
        path.write_bytes(whole[:-30])
    elif incomplete == "a dangling last link":
        path = tmp_path / "last.ckpt"
        path.symlink_to("step000011.ckpt")  # pruned
    else:
        path.write_bytes(b"garbage")
    assert not is_complete(path) and is_complete(complete)
    assert newest_checkpoint(tmp_path) == complete


def test_last_wins_a_tie_with_the_checkpoint_it_links_to(tmp_path: Path) -> None:
    sharded(tmp_path / "step000010.ckpt", 100)
    (tmp_path / "last.ckpt").symlink_to("step000010.ckpt")
    assert newest_checkpoint(tmp_path) == tmp_path / "last.ckpt"


def test_no_series_yet(tmp_path: Path) -> None:
    assert newest_checkpoint(tmp_path / "missing") is None and newest_checkpoint(tmp_path) is None
    callback = RunCheckpoint(dirpath=tmp_path)
    assert callback._find_last_checkpoints(None) == set()  # type: ignore[arg-type]  # "last": start afresh


def test_ckpt_path_last_resolves_through_the_series(tmp_path: Path) -> None:
    sharded(tmp_path / "step000010.ckpt", 100)
    saved_file(tmp_path / "last.ckpt", 50)  # older than the step file: a crash came between the two
    callback = RunCheckpoint(dirpath=tmp_path)
    assert callback._find_last_checkpoints(None) == {str(tmp_path / "step000010.ckpt")}  # type: ignore[arg-type]


def test_a_requeued_job_continues_its_series(tmp_path: Path) -> None:
    callbacks = [RunCheckpoint(dirpath=tmp_path)]
    assert requeued_resume_path("init.ckpt", callbacks, env={"SLURM_RESTART_COUNT": "1"}) == "init.ckpt"
    sharded(tmp_path / "step000010.ckpt", 100)
    assert requeued_resume_path(None, callbacks, env={"SLURM_RESTART_COUNT": "1"}) == "last"
    assert requeued_resume_path("init.ckpt", callbacks, env={"SLURM_RESTART_COUNT": "2"}) == "last"
    assert requeued_resume_path("init.ckpt", callbacks, env={"SLURM_RESTART_COUNT": "0"}) == "init.ckpt"
    assert requeued_resume_path(None, callbacks, env={}) is None


def test_requeue_refuses_a_checkpoint_callback_that_cannot_save_any_step(tmp_path: Path) -> None:
    requeue = SlurmRequeue()
    with pytest.raises(ValueError, match="no ModelCheckpoint callback"):
        requeue.setup(SimpleNamespace(checkpoint_callbacks=[]), None, "fit")  # type: ignore[arg-type]
    best_only = ModelCheckpoint(dirpath=tmp_path, monitor="val/loss", save_last=False)
    problem = unscheduled_save_problem(best_only)
    assert problem is not None and "monitor='val/loss'" in problem and "save_last=True" in problem
    with pytest.raises(ValueError, match="save_last=True"):
        requeue.setup(SimpleNamespace(checkpoint_callbacks=[best_only]), None, "fit")  # type: ignore[arg-type]
    for fine in (
        ModelCheckpoint(dirpath=tmp_path),
        ModelCheckpoint(dirpath=tmp_path, monitor="val/loss", save_last=True),
        ModelCheckpoint(dirpath=tmp_path, save_top_k=0, save_last="link"),
    ):
        assert unscheduled_save_problem(fine) is None


def test_one_process_agreement_is_the_flag_itself() -> None:
    agreement = StopAgreement()
    agreement.open()  # no process group: nothing to create
    assert agreement.poll(True) and not agreement.poll(False)


@pytest.mark.parametrize("rank_zero", [True, False])
def test_tokenizer_is_in_the_run_directory_at_setup(rank_zero: bool, tmp_path: Path) -> None:
    source = tmp_path / "cache" / "tokenizer.json"
    source.parent.mkdir()
    source.write_text('{"model": {}}')
    trainer = SimpleNamespace(
        is_global_zero=rank_zero, datamodule=SimpleNamespace(tokenizer=SimpleNamespace(path=source))
    )
    TokenizerCopy(tmp_path / "run").setup(trainer, None, "fit")  # type: ignore[arg-type]
    copied = tmp_path / "run" / "tokenizer.json"
    assert (copied.read_text() == source.read_text()) if rank_zero else not copied.exists()
    byte_level = SimpleNamespace(is_global_zero=True, datamodule=SimpleNamespace(tokenizer=object()))
    TokenizerCopy(tmp_path / "bytes").setup(byte_level, None, "fit")  # type: ignore[arg-type]
    assert not (tmp_path / "bytes").exists()


def fit_one_process(dirpath: Path, steps: int, resume: str | None = None) -> list[int]:
    """A 1-process fit with a `RunCheckpoint` every 4 steps; the step of every checkpoint dump."""
    from tests.distributed.resume_fit import fit
    from tests.recipes.requeue_fit import SaveLog

    saves = SaveLog()
    checkpoint = RunCheckpoint(
        dirpath,
        filename="step{step:06d}",
        auto_insert_metric_name=False,
        every_n_train_steps=4,
        save_last=True,
    )
    fit(steps=steps, resume=resume, callbacks=[saves, checkpoint])
    return saves.steps


def test_the_final_step_is_saved_once_and_a_finished_run_resumes_without_a_copy(tmp_path: Path) -> None:
    assert fit_one_process(tmp_path, steps=6) == [4, 4, 6]  # step 4 and its copy; `last` alone at 6
    assert fit_one_process(tmp_path, steps=6, resume="last") == []  # step 6 is on disk already


def test_the_recipe_under_slurm_requeues_into_its_series(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`build_run` in a requeued SLURM task (no process started): the requeue callback and the tokenizer
    copy are there, Lightning's auto-requeue is off, and the run resumes from its series."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from recipes.config.build import build_run
    from recipes.config.validation import validate
    from tests.conf.compose import compose_pretrain

    slurm = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_JOB_NAME": "lz"}
    slurm |= {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    slurm |= {"SLURM_NODEID": "0", "SLURM_NODELIST": "localhost", "SLURM_RESTART_COUNT": "1"}
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    cfg = compose_pretrain([f"output_root={tmp_path}", "run_name=requeued"])
    (tmp_path / "requeued" / "checkpoints").mkdir(parents=True)
    sharded(tmp_path / "requeued" / "checkpoints" / "last.ckpt", 100)
    run = build_run(cfg, validate(cfg))
    assert run.ckpt_path == "last"  # the command's ckpt_path is null
    kinds = {type(cb) for cb in run.trainer.callbacks}
    assert {SlurmRequeue, TokenizerCopy, RunCheckpoint} <= kinds
    environment = run.trainer._accelerator_connector.cluster_environment
    assert isinstance(environment, SLURMEnvironment) and not environment.auto_requeue
