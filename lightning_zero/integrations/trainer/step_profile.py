"""``StepProfiler``: where a window of optimizer steps spends its time and memory, per rank.

Added by ``ZeroStrategy(profile_steps=(first, last))``; ``None`` (the default) adds nothing, so an
unprofiled fit runs no code of it. For each optimizer step ``first`` to ``last`` (0-based, inclusive;
Lightning's ``global_step`` when the step's first batch starts) each rank times, on one host clock
(``time.perf_counter``), the intervals between Lightning's hooks of each of the step's batches:

  * ``data_wait_s``: the previous batch's end (or the epoch's start) to this batch's start: the data
    loader, and what Lightning does between batches;
  * ``forward_s``: batch start to ``on_before_backward`` (``training_step``, the loss, ``zero_grad``);
  * ``backward_s``: ``on_before_backward`` to ``on_after_backward`` (with the end-of-backward
    collection of the gradient buckets);
  * under pipeline parallelism the schedule runs every micro-batch's forward and backward inside
    ``training_step``: ``pipeline_s`` (batch start to ``on_after_backward``) in place of both (0), not split;
  * ``optimizer_s``: ``on_before_optimizer_step`` to the batch's end (clipping, the sharded step, its
    parameter all-gathers, Lightning's bookkeeping after the step);
  * ``other_s``: the step's time minus the parts above (between ``on_after_backward`` and the optimizer
    step, and the rest of the micro-batches that do not step), so the parts add up by construction;
  * ``step_s``: the data wait before the step's first batch plus first batch start to last batch end;
  * ``comm_exposed_s`` (a share of the parts above, not one more part): the seconds the host (under
    NCCL: the compute stream, timed with CUDA events) waited on collectives during the step's batches,
    the engine's :meth:`~lightning_zero.engine.ShardEngine.comm_wait_s`.

Under CUDA each phase boundary inside the window synchronises the device first (the engine's
``synchronize_device``), so that a host interval holds the device work of its phase; steps outside the
window pay one ``perf_counter`` per batch end. Each boundary also reads which stage-3 units are gathered
(the most bytes seen is ``gathered_peak_bytes``). When the batch after the window starts (outside the
window: in that step's data wait), every rank reads the engine's memory by kind
(:meth:`~lightning_zero.engine.ShardEngine.memory`) and its peak (device or process), one small
all-gather over the data-parallel ranks (under pipeline or tensor parallelism: rank 0's stage and
tensor rank) brings their figures to each of them, rank 0 writes ``step_profile.json`` in the
Trainer's ``log_dir`` (its fields: ``docs/strategy.md``) and every rank logs ``zero/profile/*``
(rank 0's reach the logger). A fit that ends inside or right after the window reports at its end.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_zero.engine import ShardEngine

PROFILE_FILE = "step_profile.json"
FORMAT = 1


@dataclass
class StepTimes:
    """One optimizer step on one rank, in seconds (see the module docstring)."""

    step: int
    data_wait_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    pipeline_s: float = 0.0
    optimizer_s: float = 0.0
    other_s: float = 0.0
    step_s: float = 0.0
    comm_exposed_s: float = 0.0
    batches: int = 0


_TIMES = [f.name for f in fields(StepTimes) if f.name not in ("step", "batches")]
_MEMORY = [
    "param_bytes",
    "grad_shard_bytes",
    "state_bytes",
    "gathered_bytes",
    "gathered_peak_bytes",
    "pool_bytes",
    "peak_accumulating_bytes",
    "peak_bytes",
]


class StepProfiler(pl.Callback):
    """Added by ``ZeroStrategy(profile_steps=(first, last))``; see the module docstring."""

    reads_parameters_between_steps = False  # overlap_param_gather need not wait for it

    def __init__(self, engine: ShardEngine, first: int, last: int, pipeline: bool = False) -> None:
        self.engine, self.first, self.last, self.pipeline = engine, first, last, pipeline
        self.steps: list[StepTimes] = []
        self.report: dict[str, Any] | None = None  # rank 0's JSON once written; every rank's figures
        self._mark = 0.0  # the last batch's end (or the epoch's start)
        self._open: StepTimes | None = None
        self._first_start = 0.0  # the open step's first batch start
        self._start = self._before_backward = self._before_step = 0.0
        self._wait_start = 0.0  # the engine's comm wait at the batch's start
        self._step_before = 0
        self._device_waits_before = False
        self._rank = 0  # the global rank, known at the window's end
        self._gathered_peak = 0  # the most bytes of gathered units seen at a phase boundary

    def _now(self) -> float:
        self.engine.synchronize_device()  # CUDA: the phase's device work is in its interval
        now = time.perf_counter()
        self._gathered_peak = max(self._gathered_peak, self.engine.gathered_bytes())  # stage 3's units
        return now

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark = time.perf_counter()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_before = trainer.global_step
        if self.report is None and self.steps and trainer.global_step > self.last:
            self._finish(trainer, pl_module)  # in the next step's data wait, outside the window
        if self.report is not None or not self.first <= trainer.global_step <= self.last:
            return
        self._start = now = self._now()
        if self._open is None:
            if not self.steps:  # the window's first batch
                self._device_waits_before = self.engine.time_device_waits()
            self._open, self._first_start = StepTimes(step=trainer.global_step), now
            self._open.step_s = now - self._mark
        self._open.data_wait_s += now - self._mark
        self._before_backward = self._before_step = 0.0
        self.engine.flush_timings()
        self._wait_start = self.engine.comm_wait_s()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        if self._open is not None:
            self._before_backward = self._now()

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._open is None:
            return
        now = self._now()
        if self.pipeline:  # the schedule ran forward and backward inside training_step
            self._open.pipeline_s += now - self._start
        else:
            self._open.forward_s += self._before_backward - self._start
            self._open.backward_s += now - self._before_backward

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if self._open is not None:
            self._before_step = self._now()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = self._open
        if step is None:
            self._mark = time.perf_counter()
            return
        now = self._now()
        self.engine.flush_timings()  # CUDA: the waits' events are read (the device is synchronised)
        step.comm_exposed_s += self.engine.comm_wait_s() - self._wait_start
        step.batches += 1
        if self._before_step:
            step.optimizer_s += now - self._before_step
        self._mark = time.perf_counter()
        if trainer.global_step == self._step_before:  # a micro-batch that only accumulates
            return
        step.step_s += now - self._first_start
        parts = step.data_wait_s + step.forward_s + step.backward_s + step.pipeline_s + step.optimizer_s
        step.other_s = step.step_s - parts
        self.steps.append(step)
        self._open = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.report is None and self.steps:  # the fit ended inside the window
            self._finish(trainer, None)

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule | None) -> None:
        """Every rank: gather the figures, rank 0 writes the file; all log."""
        self.engine.time_device_waits(self._device_waits_before)
        memory = self._memory()
        times = [getattr(s, name) for s in self.steps for name in _TIMES]
        row = [float(trainer.global_rank), *times, *(float(memory[k]) for k in _MEMORY)]
        rows = self.engine.gather_floats(row)  # every rank ran the same steps: rows of one length
        self.report = self._report(rows, memory["peak_kind"])
        self._rank = trainer.global_rank
        log_dir = trainer.log_dir  # a broadcast from rank 0 inside: every rank asks
        if trainer.is_global_zero and log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
            with open(os.path.join(log_dir, PROFILE_FILE), "w") as f:
                json.dump(self.report, f, indent=1)
        if pl_module is not None:
            pl_module.log_dict(self._metrics(), on_step=True, on_epoch=False)

    def _memory(self) -> dict[str, Any]:
        held = asdict(self.engine.memory())
        peak, kind = self.engine.peak_memory_bytes()
        figures = {k: held[k] for k in _MEMORY if k in held}
        return {**figures, "gathered_peak_bytes": self._gathered_peak, "peak_bytes": peak, "peak_kind": kind}

    def _report(self, rows: list[list[float]], peak_kind: str) -> dict[str, Any]:
        count = len(self.steps)
        ranks: list[dict[str, Any]] = []
        width = len(_TIMES)
        for rank, *row in rows:
            times = [dict(zip(_TIMES, row[i * width : (i + 1) * width], strict=True)) for i in range(count)]
            steps = [{"step": s.step, **t} for s, t in zip(self.steps, times, strict=True)]
            mean = {name: statistics.fmean(t[name] for t in times) for name in _TIMES}
            memory: dict[str, Any] = {k: int(v) for k, v in zip(_MEMORY, row[count * width :], strict=True)}
            memory["peak_kind"] = peak_kind
            ranks.append({"rank": int(rank), "mean": mean, "steps": steps, "memory": memory})
        busy = [r["mean"]["step_s"] - r["mean"]["comm_exposed_s"] for r in ranks]
        slowest, fastest = busy.index(max(busy)), busy.index(min(busy))  # the first of equals
        return {
            "format": FORMAT,
            "steps": [self.steps[0].step, self.steps[-1].step],
            "pipeline": self.pipeline,
            "world_size": len(rows),
            "ranks": ranks,
            "slowest_rank": ranks[slowest]["rank"],
            "fastest_rank": ranks[fastest]["rank"],
            "slowest_over_fastest": busy[slowest] / busy[fastest] if busy[fastest] > 0 else 1.0,
        }

    def _metrics(self) -> dict[str, float]:
        assert self.report is not None
        mine = next(r["mean"] for r in self.report["ranks"] if r["rank"] == self._rank)
        return {
            **{f"zero/profile/{name}": float(mine[name]) for name in _TIMES},
            "zero/profile/slowest_rank": float(self.report["slowest_rank"]),
            "zero/profile/slowest_over_fastest": float(self.report["slowest_over_fastest"]),
        }
