"""``CommStatsMonitor`` and ``SkippedStepsMonitor``: per-step figures of the ``zero`` strategy, as
logged metrics.

``SkippedStepsMonitor`` (added by ``skip_nonfinite_steps > 0``) logs ``zero/skipped_steps``: the
optimizer steps skipped for inf/NaN gradients so far (a host integer the step already agreed on:
no communication, no host synchronisation).

``CommStatsMonitor`` (added by ``log_comm_stats=True``):

Logged every training step (rank-local values; rank 0's reach the logger):
  * ``zero/comm_wait_s``: seconds the step blocked on collectives (what backward did not hide);
  * ``zero/comm_wait_frac``: that time over the step's wall time;
  * ``zero/elements_sent``: gradient and parameter elements this rank sent (ring cost model);
  * ``zero/bytes_sent``: the same in bytes of the wire dtype (``reduce_dtype="bf16"`` halves the
    gradients' share);
  * ``zero/elements_sent_vs_min``: elements over the stage-2 minimum ``2·Ψ·(N−1)/N``.
Steps that only accumulate send nothing, so their figures are zero.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_zero.engine import ShardEngine


class CommStatsMonitor(pl.Callback):
    """Added by ``ZeroStrategy(log_comm_stats=True)``; can also be passed to the Trainer directly."""

    reads_parameters_between_steps = False  # overlap_param_gather need not wait for it

    def __init__(self) -> None:
        self._start = 0.0

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        engine = _engine_of(trainer)
        if engine is not None:
            engine.time_device_waits()  # CUDA events under NCCL, where a host timer reads ~0
            engine.flush_timings()
            engine.comm_stats.reset()
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        engine = _engine_of(trainer)
        if engine is None:
            return
        engine.flush_timings()
        stats = engine.comm_stats
        step_s = max(time.perf_counter() - self._start, 1e-9)
        minimum = engine.min_elements_per_step()
        pl_module.log_dict(
            {
                "zero/comm_wait_s": stats.wait_s,
                "zero/comm_wait_frac": stats.wait_s / step_s,
                "zero/elements_sent": float(stats.elements_sent),
                "zero/bytes_sent": float(stats.bytes_sent),
                "zero/elements_sent_vs_min": stats.elements_sent / minimum if minimum else 0.0,
            },
            on_step=True,
            on_epoch=False,
        )


class SkippedStepsMonitor(pl.Callback):
    """Added by ``ZeroStrategy(skip_nonfinite_steps=K)``; logs ``zero/skipped_steps`` every batch."""

    reads_parameters_between_steps = False  # overlap_param_gather need not wait for it

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        engine = _engine_of(trainer)
        if engine is not None:
            pl_module.log("zero/skipped_steps", float(engine.skipped_steps), on_step=True, on_epoch=False)


def _engine_of(trainer: pl.Trainer) -> ShardEngine | None:
    optimizer = getattr(trainer.strategy, "sharded_optimizer", None)
    return None if optimizer is None else optimizer.engine
