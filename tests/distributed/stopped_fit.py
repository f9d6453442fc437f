"""A Lightning fit in which rank 1 is stopped (SIGSTOP) part-way, for the fault tests.

    python -m tests.distributed.stopped_fit --out-dir DIR --timeout-s 6

Two ranks (Lightning's launcher re-runs this file for rank 1), ``ZeroStrategy(timeout=...,
async_checkpoint=True)`` and a ``ModelCheckpoint`` every 2 steps into ``DIR/ckpt``. At the start of step
``STOP_AT`` rank 0 writes ``DIR/stop_at`` (its clock, ``time.time()``) and rank 1 stops itself, as a
process frozen by a dead NFS mount or a debugger would be; the step-4 save may still be in flight on both.
The process exits the way a user's script does (no ``os._exit``): the test measures when rank 0's process
ends and what it printed.

The strategy's timeout bounds Lightning's rendezvous too, and on a loaded machine the launched rank 1
can take longer than that to import everything and reach it: rank 0 therefore waits (up to
``STARTUP_S``) for rank 1's ``DIR/rank1_ready`` before its rendezvous, so that the timeout bounds the
fault, not the start-up.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_zero
from tests.distributed.lit_fit import TinyLit

STOP_AT = 5
STARTUP_S = 300.0
"""How long rank 0 waits for rank 1 to have started before its rendezvous."""


class _AfterRank1Started(lightning_zero.ZeroStrategy):
    """Rank 0 enters the rendezvous once rank 1 has started (its ready file exists)."""

    def __init__(self, ready: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._ready = ready

    def setup_environment(self) -> None:
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            deadline = time.monotonic() + STARTUP_S
            while not self._ready.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        super().setup_environment()


class StopRank1(Callback):
    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != STOP_AT:
            return
        if trainer.global_rank == 0:
            (self.out_dir / "stop_at").write_text(repr(time.time()))
        else:
            os.kill(os.getpid(), signal.SIGSTOP)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--timeout-s", type=float, required=True)
    args = parser.parse_args()
    ready = args.out_dir / "rank1_ready"
    if int(os.environ.get("LOCAL_RANK", "0")) == 1:  # Lightning's launcher started this process
        ready.write_text("")
    strategy = _AfterRank1Started(
        ready,
        timeout=timedelta(seconds=args.timeout_s),
        async_checkpoint=True,
        bucket_cap_mb=0.0004,
        first_bucket_cap_mb=0.0002,
        find_unused_parameters=True,
    )
    trainer = L.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        max_steps=20,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[
            StopRank1(args.out_dir),
            ModelCheckpoint(args.out_dir / "ckpt", every_n_train_steps=2, save_top_k=-1),
        ],
    )
    trainer.fit(TinyLit(unused_every=0))


if __name__ == "__main__":
    main()
