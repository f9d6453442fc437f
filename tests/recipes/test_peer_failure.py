"""What a rank does when another rank dies or hangs: the recipe's exit status and the SLURM requeue
decision (`recipes.training.callbacks`), with a recording `scontrol` on PATH. The real requeue of a job
whose rank is killed runs on the SLURM test cluster (`tests/cluster`)."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_zero.checkpoint import CheckpointError
from lightning_zero.comm import CommError
from recipes.training import EXIT_PEER_FAILURE, SlurmRequeue, peer_failure
from recipes.training.callbacks import after_peer_failure, record_own_error

FAILURE = CommError("rank 0 of 2: gradient reduce-scatter of 6 elements failed (Connection reset)")


@pytest.fixture
def scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake `scontrol` that appends its arguments to the returned file."""
    calls = tmp_path / "scontrol_calls"
    binary = tmp_path / "bin" / "scontrol"
    binary.parent.mkdir()
    binary.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{binary.parent}{os.pathsep}{os.environ['PATH']}")
    return calls


def job(restart: int, array: bool = False) -> dict[str, str]:
    env = {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": str(restart)}
    return {**env, "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"} if array else env


def requeues(calls: Path) -> list[str]:
    return calls.read_text().splitlines() if calls.exists() else []


def ignore(line: str) -> None:
    del line


def said_first(calls: Path, said: list[str]) -> Callable[[str], None]:
    """A `say` that keeps the lines in `said` and checks each is said before `scontrol requeue` runs:
    the requeue signals the job's processes, so a line printed after it can be lost."""

    def say(line: str) -> None:
        assert requeues(calls) == [], f"scontrol ran before the line was said: {line}"
        said.append(line)

    return say


def test_the_comm_error_is_found_behind_what_lightning_and_the_checkpoint_raise() -> None:
    try:
        try:
            raise FAILURE
        except CommError as err:
            raise CheckpointError("rank 0: the save was not committed") from err
    except CheckpointError as wrapped:
        assert peer_failure(wrapped) is FAILURE
    try:
        try:
            raise FAILURE
        except CommError:
            raise RuntimeError("teardown failed too")  # noqa: B904 - an implicit context, as in teardown
    except RuntimeError as chained:
        assert peer_failure(chained) is FAILURE
    assert peer_failure(ValueError("a bug of this rank")) is None
    assert EXIT_PEER_FAILURE == 75


def test_one_rank_requeues_an_attempt_and_the_others_say_so(tmp_path: Path, scontrol: Path) -> None:
    marks = tmp_path / ".requeue"
    said: list[str] = []
    first = after_peer_failure(marks, 0, FAILURE, requeues=3, say=said_first(scontrol, said), env=job(0))
    second = after_peer_failure(marks, 2, FAILURE, requeues=3, say=ignore, env=job(0))
    assert first.startswith("requeued SLURM job 41 after a peer failure (1 of at most 3)"), first
    assert "gradient reduce-scatter" in first
    assert second == "another rank requeues SLURM job 41"
    assert said == [first]
    assert requeues(scontrol) == ["requeue 41"]


def test_requeues_stop_at_the_bound_and_time_limit_restarts_do_not_count(
    tmp_path: Path, scontrol: Path
) -> None:
    marks = tmp_path / ".requeue"
    # restarts 0 and 3 failed; 1, 2 were time-limit requeues (SIGUSR1), which leave no mark here
    assert after_peer_failure(marks, 0, FAILURE, requeues=2, say=ignore, env=job(0)).startswith("requeued")
    assert after_peer_failure(marks, 1, FAILURE, requeues=2, say=ignore, env=job(3)).startswith("requeued")
    last = after_peer_failure(marks, 0, FAILURE, requeues=2, say=ignore, env=job(4))
    assert last == (
        "not requeueing SLURM job 41: 2 requeue(s) after peer failures already "
        "(cluster.peer_failure_requeues=2)"
    )
    assert requeues(scontrol) == ["requeue 41", "requeue 41"]


def test_a_rank_that_failed_on_its_own_error_stops_the_requeue(tmp_path: Path, scontrol: Path) -> None:
    """Rank 1 raised a bug of its own; rank 0 sees its exit as a peer failure. Requeueing would fail the
    same way again: no requeue, and the line names the rank and its error. Another attempt of the job is
    not affected by that attempt's record."""
    marks = tmp_path / ".requeue"
    record_own_error(marks, 1, ValueError("bad batch shape\nmore lines"), env=job(0))
    said = after_peer_failure(marks, 0, FAILURE, requeues=3, say=ignore, env=job(0))
    assert said == (
        "not requeueing SLURM job 41: a rank failed with its own error, not a peer's "
        "(rank1: ValueError: bad batch shape)"
    )
    assert requeues(scontrol) == []
    assert after_peer_failure(marks, 0, FAILURE, requeues=3, say=ignore, env=job(1)).startswith("requeued")


def test_an_array_task_is_requeued_by_its_own_id(tmp_path: Path, scontrol: Path) -> None:
    assert after_peer_failure(
        tmp_path, 0, FAILURE, requeues=1, say=ignore, env=job(0, array=True)
    ).startswith("requeued")
    assert requeues(scontrol) == ["requeue 40_3"]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_a_bad_bound_is_refused(bad: object) -> None:
    with pytest.raises(
        (TypeError, ValueError), match=f"peer_failure_requeues={bad!r}|peer_failure_requeues={bad}"
    ):
        SlurmRequeue(bad)  # type: ignore[arg-type]


def test_a_failure_to_record_never_replaces_the_exception_being_handled(
    tmp_path: Path, scontrol: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run directory cannot take the record (here a file stands where `.requeue` would go): Lightning's
    `on_exception` must return, so the user sees the exception that ended the run, plus one line."""
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    (tmp_path / ".requeue").write_text("not a directory")
    callback = SlurmRequeue(3)
    callback._checkpoint = SimpleNamespace(dirpath=str(tmp_path / "checkpoints"))  # type: ignore[assignment]
    trainer = SimpleNamespace(global_rank=1)
    for exception in (ValueError("a bug of this rank"), FAILURE):
        callback.on_exception(trainer, None, exception)  # type: ignore[arg-type]
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 2 and all(line.startswith("rank 1: no requeue decision (") for line in said), said
    assert requeues(scontrol) == []
