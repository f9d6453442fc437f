"""Callbacks the recipe adds to Lightning's defaults.

`RunCheckpoint` is Lightning's `ModelCheckpoint` plus one guarantee: when training stops at
`max_steps` between two `every_n_train_steps` saves, it still writes `last.ckpt` for the final step, so
`ckpt_path=last` always resumes from where the previous command ended. (The stock callback only saves
`last` at train end when it never saved anything during the run.) Saving runs on every rank, as
`trainer.save_checkpoint` requires for sharded strategies.

`SlurmRequeue` is the recipe's one requeue mechanism under SLURM (see its docstring).
"""

from __future__ import annotations

import os
import signal
import subprocess

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from typing_extensions import override


class RunCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` that also saves `last` at the end of training if the final step is unsaved."""

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.save_last and trainer.global_step > self._last_global_step_saved:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
            self._last_global_step_saved = trainer.global_step
        super().on_train_end(trainer, pl_module)


class SlurmRequeue(Callback):
    """The one requeue mechanism under SLURM: save together at a step boundary, requeue, stop.

    SIGUSR1 (``#SBATCH --signal=SIGUSR1@90`` before the time limit, or ``scancel -s USR1 JOB``) only
    sets a flag. After every optimizer step (the last micro-batch of ``accumulate_grad_batches``: no
    accumulated gradient is lost and the data position is a whole global batch) the ranks agree on
    it (a one-element max all-reduce);
    when set, all ranks save ``hpc_ckpt_N.ckpt`` in the run directory together, rank 0 runs
    ``scontrol requeue``, and training stops. The requeued job finds that checkpoint itself
    (Lightning resumes from the newest ``hpc_ckpt_*`` under SLURM when no ``ckpt_path`` is given).
    It replaces Lightning's own SIGUSR1 handler (``SLURMEnvironment(auto_requeue=False)``), which
    saves from inside the signal handler, wherever each rank happens to be: with a sharded
    checkpoint's collectives that could interleave with training's.
    """

    reads_parameters_between_steps = False  # a save waits for parameter gathers by itself

    def __init__(self) -> None:
        self._signalled = False

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signalled = True

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        signal.signal(signal.SIGUSR1, self._on_signal)
        if trainer.is_global_zero:
            print(f"SLURM job {os.environ.get('SLURM_JOB_ID')}: world size {trainer.world_size}; on SIGUSR1 "
                  "the ranks save hpc_ckpt_N.ckpt together and the job requeues", flush=True)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: object,
        batch: object,
        batch_idx: int,
    ) -> None:
        stepped = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        if not stepped and not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return  # inside an optimizer step: its accumulated gradient would not be in the checkpoint
        flag = torch.tensor([1.0 if self._signalled else 0.0], device=pl_module.device)
        if float(trainer.strategy.reduce(flag, reduce_op="max")) == 0.0:
            return
        path = trainer._checkpoint_connector.hpc_save_path(
            trainer.default_root_dir
        )  # where Lightning resumes
        trainer.save_checkpoint(path)
        if trainer.is_global_zero:
            job = os.environ.get("SLURM_ARRAY_JOB_ID")
            job = f"{job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if job else os.environ.get("SLURM_JOB_ID", "")
            print(
                f"SIGUSR1: saved {path} at step {trainer.global_step}; requeueing SLURM job {job}", flush=True
            )
            subprocess.run(["scontrol", "requeue", job], check=False)
        trainer.should_stop = True
        self._signalled = False
