"""``CommStatsMonitor``: per-step communication figures of the ``zero`` strategy, as logged metrics.

Logged every training step (rank-local values; rank 0's reach the logger):
  * ``zero/comm_wait_s``: seconds the step blocked on collectives (what backward did not hide);
  * ``zero/comm_wait_frac``: that time over the step's wall time;
  * ``zero/elements_sent``: gradient and parameter elements this rank sent (ring cost model);
  * ``zero/elements_sent_vs_min``: that over the stage-2 minimum ``2·Ψ·(N−1)/N``.
Steps that only accumulate send nothing, so their figures are zero.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override


class CommStatsMonitor(pl.Callback):
    """Added by ``ZeroStrategy(log_comm_stats=True)``; can also be passed to the Trainer directly."""

    reads_parameters_between_steps = False  # overlap_param_gather need not wait for it

    def __init__(self) -> None:
        self._start = 0.0

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        opt = getattr(trainer.strategy, "sharded_optimizer", None)
        if opt is not None:
            opt.comm.time_device_waits = True  # CUDA events under NCCL, where a host timer reads ~0
            opt.comm.flush_timings()
            opt.comm.stats.reset()
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        opt = getattr(trainer.strategy, "sharded_optimizer", None)
        if opt is None:
            return
        opt.comm.flush_timings()
        stats = opt.comm.stats
        step_s = max(time.perf_counter() - self._start, 1e-9)
        numel = sum(b.padded_numel for b in opt.plan.buckets)
        minimum = 2 * numel * (opt.comm.world_size - 1) // max(opt.comm.world_size, 1)
        pl_module.log_dict(
            {
                "zero/comm_wait_s": stats.wait_s,
                "zero/comm_wait_frac": stats.wait_s / step_s,
                "zero/elements_sent": float(stats.elements_sent),
                "zero/elements_sent_vs_min": stats.elements_sent / minimum if minimum else 0.0,
            },
            on_step=True,
            on_epoch=False,
        )
