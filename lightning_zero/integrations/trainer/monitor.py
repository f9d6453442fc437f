"""``CommStatsMonitor`` and ``SkippedStepsMonitor``: figures of the ``zero`` strategy, as logged metrics.

``SkippedStepsMonitor`` (added by ``skip_nonfinite_steps > 0``) logs ``zero/skipped_steps``: the
optimizer steps skipped for inf/NaN gradients so far (a host integer the step already agreed on:
no communication, no host synchronisation).

``CommStatsMonitor`` (added by ``log_comm_stats=True``):

Logged at Lightning's logging steps (``log_every_n_steps``), as means per training batch over the
batches since the previous log (rank-local values; rank 0's reach the logger):
  * ``zero/comm_wait_s``: seconds a batch blocked on collectives (what backward did not hide);
  * ``zero/comm_wait_frac``: that time over the batches' wall time;
  * ``zero/elements_sent``: gradient and parameter elements this rank sent per batch (ring cost model);
  * ``zero/bytes_sent``: the same in bytes of the wire dtype (``reduce_dtype="bf16"`` halves the
    gradients' share);
  * ``zero/elements_sent_vs_min``: elements per optimizer step over the minimum
    (``ShardEngine.min_elements_per_step``: ``2·Ψ·(N−1)/N``, at stage 3 its gathers too);
  * hybrid sharding (``shard_group_size``): the three above count the traffic inside the shard group
    (``N`` is then ``G``), and ``zero/inter_group_elements_sent``, ``zero/inter_group_bytes_sent`` and
    ``zero/inter_group_elements_vs_min`` (over ``2·(Ψ/G)·(R−1)/R`` per step) the all-reduces across
    the replica groups;
  * stragglers, the same on every rank (one small all-gather per logged step, none in between):
    ``zero/step_time_{min,median,max}_s``, each rank's mean batch time across ranks (close to each
    other: ranks wait for one another at every collective), and ``zero/busy_time_{min,median,max}_s``,
    each rank's mean time outside communication waits, with ``zero/slowest_rank``, the rank of the
    largest: a straggler is a max well above the median, on the same rank interval after interval.
Batches that only accumulate send nothing; the figures are logged by the batch that steps. Under
NCCL the waits are timed with CUDA events, which are read (a device synchronisation) only at the
logging steps, never in the steps between.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_zero.engine import ShardEngine


class CommStatsMonitor(pl.Callback):
    """Added by ``ZeroStrategy(log_comm_stats=True)``; can also be passed to the Trainer directly."""

    reads_parameters_between_steps = False  # overlap_param_gather need not wait for it

    def __init__(self) -> None:
        self._start: float | None = None  # of the first batch since the last log
        self._batches = 0
        self._steps = 0  # optimizer steps among them
        self._step_before = 0  # the global step when the current batch started

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        engine = _engine_of(trainer)
        if engine is not None and self._start is None:
            engine.time_device_waits()  # CUDA events under NCCL, where a host timer reads ~0
            engine.reset_comm_stats()  # nothing pending: the last log read every recorded wait
            self._start, self._batches, self._steps = time.perf_counter(), 0, 0
        self._step_before = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        engine = _engine_of(trainer)
        if engine is None or self._start is None:
            return
        self._batches += 1
        stepped = trainer.global_step > self._step_before
        self._steps += trainer.global_step - self._step_before
        # Lightning's own rule (no public one); in an accumulation window, the batch that steps
        if not stepped or not trainer._logger_connector.should_update_logs:  # noqa: SLF001
            return
        engine.flush_timings()  # the device synchronisation, once per logged step
        stats, wait_s = engine.comm_stats, engine.comm_wait_s()
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        minimum = engine.min_elements_per_step() * max(self._steps, 1)
        rows = engine.gather_floats([elapsed / self._batches, (elapsed - wait_s) / self._batches])
        step_times, busy_times = [row[0] for row in rows], [row[1] for row in rows]
        pl_module.log_dict(
            {
                **straggler_figures(step_times, busy_times),
                "zero/comm_wait_s": wait_s / self._batches,
                "zero/comm_wait_frac": wait_s / elapsed,
                "zero/elements_sent": stats.elements_sent / self._batches,
                "zero/bytes_sent": stats.bytes_sent / self._batches,
                "zero/elements_sent_vs_min": stats.elements_sent / minimum if minimum else 0.0,
                **_inter_group(engine, self._batches, self._steps),
            },
            on_step=True,
            on_epoch=False,
        )
        self._start = None  # the next batch starts a new interval


def _inter_group(engine: ShardEngine, batches: int, steps: int) -> dict[str, float]:
    """The traffic across replica groups, per batch (nothing under flat sharding)."""
    minimum = engine.min_replica_elements_per_step() * max(steps, 1)
    if not minimum:  # flat sharding: one group, nothing across
        return {}
    stats = engine.replica_comm_stats
    return {
        "zero/inter_group_elements_sent": stats.elements_sent / batches,
        "zero/inter_group_bytes_sent": stats.bytes_sent / batches,
        "zero/inter_group_elements_vs_min": stats.elements_sent / minimum,
    }


def straggler_figures(step_times: list[float], busy_times: list[float]) -> dict[str, float]:
    """``zero/step_time_*``, ``zero/busy_time_*`` and ``zero/slowest_rank`` from every rank's mean batch
    time and mean busy time (indexed by rank): the slowest rank is the one busy longest (the first of
    equals), since every rank's batch time includes waiting for it."""
    return {
        **_spread("zero/step_time", step_times),
        **_spread("zero/busy_time", busy_times),
        "zero/slowest_rank": float(busy_times.index(max(busy_times))),
    }


def _spread(name: str, values: list[float]) -> dict[str, float]:
    return {
        f"{name}_min_s": min(values),
        f"{name}_median_s": statistics.median(values),
        f"{name}_max_s": max(values),
    }


class SkippedStepsMonitor(pl.Callback):
    """Added by ``ZeroStrategy(skip_nonfinite_steps=K)``; logs ``zero/skipped_steps`` after every
    optimizer step (not on the other micro-batches of an accumulation window), as a device tensor made
    by a fill kernel: a Python float would be copied to the device by Lightning, a host
    synchronisation per batch."""

    reads_parameters_between_steps = False  # overlap_param_gather need not wait for it

    def __init__(self) -> None:
        self._logged_after = -1  # the engine's optimizer step count at the last log

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        engine = _engine_of(trainer)
        if engine is None or engine.optimizer_steps == self._logged_after:
            return
        self._logged_after = engine.optimizer_steps
        skipped = torch.full((), float(engine.skipped_steps), device=pl_module.device)
        pl_module.log("zero/skipped_steps", skipped, on_step=True, on_epoch=False)


def _engine_of(trainer: pl.Trainer) -> ShardEngine | None:
    optimizer = getattr(trainer.strategy, "sharded_optimizer", None)
    return None if optimizer is None else optimizer.engine
