"""Fits for the checkpoint-series tests: the recipe's `RunCheckpoint` and `SlurmRequeue` on 2 ranks.

SIGUSR1 reaches ONE rank at a chosen step (`SignalOneRank`); the ranks must still stop together at a
step boundary, save once in the run's series, and a second fit with `ckpt_path="last"` must end where
an uninterrupted fit ends. Each fit records what the tests read back: the final step and parameters,
the sample rows trained (`tests.distributed.resume_fit`), the step of every checkpoint dump, how many
stop agreements were launched, the resolved `ckpt_path`, and the series directory afterwards.

Run as a script; Lightning's launcher re-runs it for rank 1, and the cases run in order on both ranks::

    python -m tests.recipes.requeue_fit --out result.pt --root DIR --cases '[{"name": "full", "steps": 4}]'
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

import recipes.training.callbacks
from recipes.training.callbacks import RunCheckpoint, SlurmRequeue, StopAgreement
from tests.distributed import resume_fit


class SignalOneRank(Callback):
    """SIGUSR1 to this process after the batch that reaches `step`, on `rank` only."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGUSR1)


class SaveLog(Callback):
    """The global step of every checkpoint dump (one per full save), and the checkpoint resumed from."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.ckpt_path: str | None = None

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.ckpt_path = None if trainer.ckpt_path is None else Path(trainer.ckpt_path).name

    def on_save_checkpoint(self, trainer: L.Trainer, module: L.LightningModule, checkpoint: Any) -> None:
        self.steps.append(trainer.global_step)


class AgreementCount:
    """Counts the all-reduces launched on `StopAgreement`'s side group (patched in for one fit)."""

    def __init__(self) -> None:
        self.launched = 0
        self.groups: list[Any] = []
        self._all_reduce, self._open = dist.all_reduce, StopAgreement.open

    def __enter__(self) -> AgreementCount:
        count = self

        def recording_open(agreement: StopAgreement, *args: Any, **kwargs: Any) -> None:
            count._open(agreement, *args, **kwargs)
            count.groups.append(agreement._group)

        def counting_all_reduce(*args: Any, **kwargs: Any) -> Any:
            if any(kwargs.get("group") is group for group in count.groups):
                count.launched += 1
            return count._all_reduce(*args, **kwargs)

        StopAgreement.open = recording_open  # type: ignore[method-assign]
        recipes.training.callbacks.dist.all_reduce = counting_all_reduce  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        StopAgreement.open = self._open  # type: ignore[method-assign]
        recipes.training.callbacks.dist.all_reduce = self._all_reduce  # type: ignore[assignment]


def plant_incomplete(dirpath: Path) -> None:
    """Newer than any real checkpoint: a sharded directory without `meta.pt` (a save cut short before
    its commit) and a `torch.save` file cut in half."""
    dirpath.mkdir(parents=True, exist_ok=True)
    (dirpath / "step000098.ckpt").mkdir()
    (dirpath / "step000098.ckpt" / "shard-00000-of-00002.pt").write_bytes(b"partial")
    torch.save({"global_step": 99, "x": torch.zeros(1000)}, dirpath / "step000099.ckpt")
    whole = (dirpath / "step000099.ckpt").read_bytes()
    (dirpath / "step000099.ckpt").write_bytes(whole[: len(whole) // 2])


def fit(
    root: str,
    name: str,
    steps: int,
    signal_at: int | None = None,
    signal_rank: int = 1,
    resume: str | None = None,
    save_last: bool | str = True,
    every_n_steps: int = 4,
    plant: bool = False,
) -> dict[str, Any]:
    """A 2-rank `resume_fit.fit` (strategy "zero", float64, accumulate 2), its series in `<root>/<name>`."""
    dirpath = Path(root) / name
    if plant:
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            plant_incomplete(dirpath)
        dist.barrier()  # the group of the previous fit: both ranks resolve "last" after the planting
    saves = SaveLog()
    callbacks: list[Callback] = [
        SlurmRequeue(),
        saves,
        RunCheckpoint(
            dirpath,
            filename="step{step:06d}",
            auto_insert_metric_name=False,
            every_n_train_steps=every_n_steps,
            save_last=save_last,
        ),
    ]
    if signal_at is not None:
        callbacks.insert(1, SignalOneRank(signal_at, signal_rank))
    with AgreementCount() as count:
        result = resume_fit.fit(
            devices=2, strategy="zero", accum=2, batch_size=2, steps=steps, resume=resume, callbacks=callbacks
        )
    return {
        **result,
        "saves": saves.steps,
        "agreements": count.launched,
        "ckpt_path": saves.ckpt_path,
        "files": sorted(p.name for p in dirpath.iterdir()),
    }


def main() -> None:
    import lightning_zero  # noqa: F401  # registers "zero"

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--cases", required=True, help="JSON list of keyword-argument dicts for fit()")
    args = parser.parse_args()
    # no scontrol
    recipes.training.callbacks.subprocess.run = lambda *a, **k: subprocess.CompletedProcess(a, 0)
    results: list[Any] = []
    rank = int(os.environ.get("LOCAL_RANK", 0))
    for case in json.loads(args.cases):
        try:
            results.append(fit(args.root, **case))
        except Exception as error:  # noqa: BLE001 - reported to the test, which names the case
            results.append({"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()})
    torch.save(results, f"{args.out}.rank{rank}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
