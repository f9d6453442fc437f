"""Callbacks the recipe adds to Lightning's defaults: one checkpoint series per run, and SLURM requeue.

`RunCheckpoint` is Lightning's `ModelCheckpoint` made the single series of a run (`<run_dir>/checkpoints`):

  * training that stops between two `every_n_train_steps` saves (at `max_steps`, or for a requeue)
    still saves its final step, with one full write (`save_step`), so the next command continues
    where this one ended;
  * `ckpt_path=last` resumes from the newest *complete* checkpoint of the directory, whichever
    callback wrote it (`recipes.training.lineage`), not only a `last*.ckpt`: a `last` left behind by a
    crash between the step file and its copy, a dangling `last` link or a half-written file is skipped.

`SlurmRequeue` is the recipe's one requeue mechanism under SLURM: on SIGUSR1 the ranks agree at an
optimizer-step boundary (`StopAgreement`, off the training path), save through `RunCheckpoint` (the
same series, pruned by the same `save_top_k`), rank 0 requeues the job and training stops. It also
requeues after a peer failure (a rank died or hung: `lightning_zero.comm.CommError` on the survivors,
`after_peer_failure`), a bounded number of times and never when a rank failed with an error of its own.
`requeued_resume_path` makes the requeued job resume from that series. `TokenizerCopy` puts the
run's tokenizer file in the run directory before the first step.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from lightning_zero.comm import CommError
from recipes.training.lineage import newest_checkpoint

EXIT_PEER_FAILURE = 75  # EX_TEMPFAIL (sysexits.h): a peer died or hung; the run resumes from a checkpoint


def peer_failure(error: BaseException | None) -> CommError | None:
    """The `CommError` behind `error` (itself, or along its causes and contexts), or None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, CommError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def slurm_job_id(env: Mapping[str, str] | None = None) -> str:
    """The id `scontrol requeue` takes: ``<array job>_<task>`` for an array task, else the job's."""
    env = os.environ if env is None else env
    job = env.get("SLURM_ARRAY_JOB_ID")
    return f"{job}_{env['SLURM_ARRAY_TASK_ID']}" if job else env.get("SLURM_JOB_ID", "")


def after_peer_failure(
    marks: Path,
    rank: int,
    failure: CommError,
    requeues: int,
    say: Callable[[str], None],
    env: Mapping[str, str] | None = None,
) -> str:
    """On a rank that saw a peer fail: requeue the SLURM job unless a rank failed with its own error in
    this attempt, or `requeues` requeues after peer failures were already made for this job; `say` what
    is done (one line for the log) and return it. The line is said BEFORE `scontrol requeue` runs: the
    requeue signals this job's processes, this one included, and a line printed after it can be lost
    (seen in CI: the job requeued and resumed, its log without the line).

    `marks` (``<run_dir>/.requeue``, on the run's shared storage) holds one file per event, named by job
    and attempt (``SLURM_RESTART_COUNT``): ``error-<job>-<attempt>-rank<r>`` (`record_own_error`, written
    by a rank whose own exception ended it, before its exit breaks the connections the others notice)
    and ``requeue-<job>-<attempt>`` (created exclusively: one rank of the attempt requeues).
    """
    env = os.environ if env is None else env
    job, attempt = slurm_job_id(env), int(env.get("SLURM_RESTART_COUNT") or 0)
    marks.mkdir(parents=True, exist_ok=True)
    own = sorted(marks.glob(f"error-{job}-{attempt}-rank*"))
    requeue = False
    earlier = len(list(marks.glob(f"requeue-{job}-*")))
    if own:
        reasons = "; ".join(f"{p.name.rsplit('-', 1)[1]}: {p.read_text().strip()}" for p in own)
        line = f"not requeueing SLURM job {job}: a rank failed with its own error, not a peer's ({reasons})"
    elif earlier >= requeues:
        line = (
            f"not requeueing SLURM job {job}: {earlier} requeue(s) after peer failures already "
            f"(cluster.peer_failure_requeues={requeues})"
        )
    else:
        try:
            os.close(os.open(marks / f"requeue-{job}-{attempt}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            requeue = True
            line = (
                f"requeued SLURM job {job} after a peer failure ({earlier + 1} of at most {requeues}); it "
                f"resumes from the newest complete checkpoint of its series (rank {rank} saw: {failure})"
            )
        except FileExistsError:
            line = f"another rank requeues SLURM job {job}"
    say(line)
    if requeue:
        subprocess.run(["scontrol", "requeue", job], check=False)
    return line


def record_own_error(
    marks: Path, rank: int, error: BaseException, env: Mapping[str, str] | None = None
) -> None:
    """Leave word that this rank ends on an error of its own (not a peer's failure), for the ranks that
    will see its exit as a peer failure (`after_peer_failure`): they must not requeue a job that fails
    the same way every time."""
    env = os.environ if env is None else env
    job, attempt = slurm_job_id(env), int(env.get("SLURM_RESTART_COUNT") or 0)
    marks.mkdir(parents=True, exist_ok=True)
    text = f"{type(error).__name__}: {error}".splitlines()[0][:300]
    (marks / f"error-{job}-{attempt}-rank{rank}").write_text(text + "\n")


def unscheduled_save_problem(callback: ModelCheckpoint) -> str | None:
    """Why `callback` cannot save an arbitrary step (`save_step`), or None if it can."""
    if callback.monitor is None and callback.save_top_k != 0:
        return None  # a step checkpoint of its top-k series
    if callback.save_last is True or (callback.save_last == "link" and callback.save_top_k == 0):
        return None  # `last` written in full
    return (
        f"ModelCheckpoint(monitor={callback.monitor!r}, save_top_k={callback.save_top_k}, "
        f"save_last={callback.save_last!r}) has no place for a checkpoint of an arbitrary step: its top-k "
        "is off or keeps the best values of a monitored metric, and `last` is off or a link to one of "
        "those; use save_last=True (or monitor=None with save_top_k != 0)"
    )


def save_step(callback: ModelCheckpoint, trainer: pl.Trainer) -> str:
    """Save the current step into `callback`'s series with ONE full write; return the path written.

    Must be called on all ranks, at an optimizer-step boundary. With `save_last=True`: `last` in full
    (a step copy as well would be a second full write of the same state). With top-k by step and
    `save_last="link"` (or no `last`): a step checkpoint, which prunes older ones as every periodic save
    does, then `last` linked to it. See `unscheduled_save_problem` for the settings that cannot.
    """
    candidates = callback._monitor_candidates(trainer)
    if callback.monitor is None and callback.save_top_k != 0 and callback.save_last is not True:
        callback._save_topk_checkpoint(trainer, candidates)
    callback._save_last_checkpoint(trainer, candidates)
    return callback._last_checkpoint_saved


class RunCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` as the one checkpoint series of a run (see the module docstring)."""

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # replaces ModelCheckpoint's, which saves `last` only if this run saved nothing at all
        if self._should_skip_saving_checkpoint(trainer) or unscheduled_save_problem(self) is not None:
            return
        save_step(self, trainer)

    @override
    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        """What `ckpt_path="last"` chooses from: the newest complete checkpoint of `dirpath`."""
        if self.dirpath is None or not _is_local_file_protocol(self.dirpath):
            return super()._find_last_checkpoints(trainer)  # no dirpath yet (set at setup), or remote
        newest = newest_checkpoint(self.dirpath)
        return {os.path.normpath(newest)} if newest is not None else set()


class StopAgreement:
    """All ranks agree, at the same optimizer-step boundary, that some rank was asked to stop.

    `poll(requested)` is called by every rank at every optimizer-step boundary. It reads the agreement
    launched at the previous boundary and launches the next one: a one-element MAX all-reduce of this
    rank's flag, asynchronous, as a CPU tensor on a gloo process group of its own. Hence:

      * the step path never waits for it: no device tensor (no host-device synchronisation on GPU),
        and nothing enters the order of the training group, whose collectives (NCCL or gloo) the
        strategy issues from backward hooks; a 4-byte gloo exchange has long finished one step later;
      * every rank reads the same value at the same boundary, so all stop at the same step: one
        boundary after the first rank that saw its signal, whichever ranks saw it;
      * accumulation micro-batches cost nothing (the caller polls at optimizer steps only).

    The side group is created by `open` (on all ranks: `new_group` is collective) and pending work is
    waited for by `close`. Without a process group (one process) the flag is its own answer.
    """

    def __init__(self) -> None:
        self._group: dist.ProcessGroup | None = None
        self._pending: tuple[dist.Work, torch.Tensor] | None = None

    def open(self, timeout: timedelta | None = None) -> None:
        """Create the side group if running distributed. Call on all ranks.

        ``timeout``: the training group's (the strategy's), so that a dead or hung peer ends the wait
        for the agreement as it ends a training collective; ``None`` is torch's 30-minute default.
        """
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo", timeout=timeout)

    def poll(self, requested: bool) -> bool:
        """Whether all ranks stop at this boundary (some rank had `requested` at the previous one)."""
        if self._group is None:
            return requested
        agreed = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            agreed = bool(flag.item())
        self._pending = None
        if agreed:
            return True
        flag = torch.tensor([1 if requested else 0], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending = (work, flag)  # type: ignore[assignment]
        return False

    def close(self, wait: bool) -> None:
        """Wait for the agreement in flight (`wait`: all ranks reached the same boundaries) or drop it."""
        if self._pending is not None and wait:
            self._pending[0].wait()
        self._pending = None


class SlurmRequeue(Callback):
    """The one requeue mechanism under SLURM: agree at a step boundary, save in the series, requeue, stop.

    SIGUSR1 (``#SBATCH --signal=SIGUSR1@90`` before the time limit, sent to every task; or
    ``scancel --signal=USR1 JOB``) only sets a flag. The handler is installed when the callback is
    built, so a signal during data preparation is kept too. At optimizer-step boundaries (never
    inside an accumulation window: its gradient would not be in the checkpoint) the ranks agree on
    the flag through `StopAgreement`; once agreed, all ranks save the step through the trainer's
    checkpoint callback (`save_step`: the run's series in ``<run_dir>/checkpoints``, updating `last`,
    pruned by ``save_top_k`` like any periodic save), wait for the commit of an asynchronous save,
    rank 0 flushes the loggers and runs ``scontrol requeue``, and training stops. The requeued job
    resumes from the series (`requeued_resume_path`). Lightning's own SIGUSR1 handler is off
    (``SLURMEnvironment(auto_requeue=False)``): it saves from inside the signal handler, wherever
    each rank happens to be, where a sharded checkpoint's collectives could interleave with training's.

    A peer failure (a rank killed, out of memory, or hung past the strategy's timeout) ends the other
    ranks with a `CommError`; in `on_exception` the first of them requeues the job (`after_peer_failure`),
    at most `peer_failure_requeues` times per job, and not when a rank failed with an error of its own,
    which would only fail again. The requeued job resumes from the newest complete checkpoint.
    """

    reads_parameters_between_steps = False  # a save waits for parameter gathers by itself

    def __init__(self, peer_failure_requeues: int = 3) -> None:
        if isinstance(peer_failure_requeues, bool) or not isinstance(peer_failure_requeues, int):
            raise TypeError(f"peer_failure_requeues={peer_failure_requeues!r}: expected an int >= 0")
        if peer_failure_requeues < 0:
            raise ValueError(
                f"peer_failure_requeues={peer_failure_requeues}: expected an int >= 0 (0: never)"
            )
        self.peer_failure_requeues = peer_failure_requeues
        self._signalled = False
        self._agreement = StopAgreement()
        self._checkpoint: ModelCheckpoint | None = None
        self._boundary_step = -1
        signal.signal(signal.SIGUSR1, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signalled = True

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        checkpoint = next(
            (cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)), None
        )
        problem = (
            "there is no ModelCheckpoint callback (callbacks.model_checkpoint is null)"
            if checkpoint is None
            else unscheduled_save_problem(checkpoint)
        )
        if checkpoint is None or problem is not None:
            raise ValueError(f"SlurmRequeue saves through the run's checkpoint callback, but {problem}")
        self._checkpoint = checkpoint
        # lightning-zero's strategies say their timeout; Lightning's "ddp" keeps it private
        self._agreement.open(getattr(trainer.strategy, "timeout", None))
        if trainer.is_global_zero:
            print(
                f"SLURM job {os.environ.get('SLURM_JOB_ID')}: world size {trainer.world_size}; on SIGUSR1 "
                f"the ranks save the step in {checkpoint.dirpath} together and the job requeues",
                flush=True,
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._boundary_step = trainer.global_step  # restored by now when resuming

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: object,
        batch: object,
        batch_idx: int,
    ) -> None:
        if trainer.global_step == self._boundary_step:
            return  # no optimizer step in this micro-batch: inside an accumulation window
        self._boundary_step = trainer.global_step
        if self._agreement.poll(self._signalled):
            self._save_and_requeue(trainer)

    def _save_and_requeue(self, trainer: pl.Trainer) -> None:
        assert self._checkpoint is not None, "set in setup()"
        path = save_step(self._checkpoint, trainer)
        wait_for_checkpoint = getattr(trainer.strategy, "wait_for_checkpoint", None)
        if wait_for_checkpoint is not None:
            wait_for_checkpoint()  # committed before the requeue ends this job
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.save()
            job = slurm_job_id()
            print(
                f"SIGUSR1: saved {path} at step {trainer.global_step}; requeueing SLURM job {job}", flush=True
            )
            subprocess.run(["scontrol", "requeue", job], check=False)
        trainer.should_stop = True
        self._signalled = False

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._agreement.close(wait=True)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._agreement.close(wait=False)  # other ranks may never reach the boundary it belongs to
        if self._checkpoint is None or self._checkpoint.dirpath is None:
            return  # ended before setup: nothing trained, nothing to resume
        marks = Path(self._checkpoint.dirpath).parent / ".requeue"
        failure = peer_failure(exception)
        try:
            if failure is None:
                record_own_error(marks, trainer.global_rank, exception)
            elif self.peer_failure_requeues > 0:
                rank = trainer.global_rank
                after_peer_failure(
                    marks,
                    rank,
                    failure,
                    self.peer_failure_requeues,
                    lambda line: print(f"rank {rank}: {line}", flush=True),
                )
        except Exception as err:  # noqa: BLE001 - the exception being handled must stay the one raised
            print(f"rank {trainer.global_rank}: no requeue decision ({err!r})", flush=True)


def requeued_resume_path(
    ckpt_path: str | None, callbacks: Sequence[Callback], env: Mapping[str, str] | None = None
) -> str | None:
    """The checkpoint a SLURM job resumes from: ``"last"`` if it was requeued and its series holds a
    complete checkpoint, else `ckpt_path`.

    A requeued job runs the same command again, and the `ckpt_path` of that command (null, or the
    checkpoint the first attempt started from) would start over. SLURM counts restarts in
    ``SLURM_RESTART_COUNT``; a requeue before the first save keeps `ckpt_path`.
    """
    env = os.environ if env is None else env
    restarts = int(env.get("SLURM_RESTART_COUNT") or 0)
    if restarts == 0:
        return ckpt_path
    series = [cb.dirpath for cb in callbacks if isinstance(cb, ModelCheckpoint)]
    newest = next((path for path in map(newest_checkpoint, series) if path is not None), None)
    if newest is None:
        return ckpt_path
    if getattr(rank_zero_only, "rank", 0) == 0:
        print(f"requeued job (restart {restarts}): resuming from {newest} instead of ckpt_path={ckpt_path}")
    return "last"


class TokenizerCopy(Callback):
    """Copies the run's tokenizer file into the run directory (rank 0) once the data is set up.

    Before the first step, so every checkpoint of the run - a periodic save, a requeue, one left by a
    crash - can be exported or sampled from (`recipes.checkpoints.load.find_tokenizer` looks beside
    `checkpoints/`).
    Tokenizers without a file (bytes) have nothing to copy.
    """

    reads_parameters_between_steps = False

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        source = getattr(getattr(datamodule, "tokenizer", None), "path", None)
        if stage != "fit" or not trainer.is_global_zero or source is None:
            return
        target = self.run_dir / Path(source).name
        if not target.exists() or not target.samefile(source):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, target)
