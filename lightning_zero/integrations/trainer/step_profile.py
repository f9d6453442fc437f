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
    ``pipeline_idle_s``, a share of it, is its time outside this rank's stages' own work (each
    micro-batch's forward, loss and backward: :data:`~lightning_zero.comm.host_clock.STAGE_CLOCK`, on
    CUDA the device's time between events): the bubble, the waits for the neighbours' activations and
    gradients, the schedule's own Python;
  * ``optimizer_s``: ``on_before_optimizer_step`` to the batch's end (clipping, the sharded step, its
    parameter all-gathers, Lightning's bookkeeping after the step);
  * ``other_s``: the step's time minus the parts above (between ``on_after_backward`` and the optimizer
    step, and the rest of the micro-batches that do not step), so the parts add up by construction;
  * ``step_s``: the data wait before the step's first batch plus first batch start to last batch end;
  * ``comm_exposed_s`` (a share of the parts above, not one more part): the seconds the host (under
    NCCL: the compute stream, timed with CUDA events) waited on collectives during the step's batches,
    the engine's :meth:`~lightning_zero.engine.ShardEngine.comm_wait_s`;
  * ``gather_wait_s`` (a share of ``comm_exposed_s``): of those, the waits on parameter all-gathers
    (stage 3's unit gathers; stages 1 and 2: the gathers after the optimizer step), the engine's
    :meth:`~lightning_zero.engine.ShardEngine.comm_gather_wait_s`;
  * ``host_s`` (a share of the parts too): the seconds the host spent in lightning-zero's code during
    the step's batches (its hooks and the methods the optimizer and Lightning call), less its waits on
    collectives (:mod:`lightning_zero.comm.host_clock`, on only in the window). On a CPU that includes
    the work our code runs (the shards' update, the gradients' copies into buckets); on CUDA, where
    kernels are queued, it is the Python and the launches: a large share there is a launch-bound step.

Over the window each rank also counts its micro-batches' tokens and, by kind and group, the
collectives it issues and the bytes it sends (the engine's tally, on from the window's first batch
start to its last batch end; off, the default, it costs one test per collective); FLOPs per token
come from the LightningModule or are counted on the step before the window (as are the bytes autograd
saves in the forward of its first micro-batch, ``activation_bytes``:
:mod:`~lightning_zero.integrations.trainer.saved_activations`; not under a pipeline schedule, whose
micro-batches' forwards and backwards interleave), and the peak from a
table or ``profile_peak_tflops`` (:mod:`~lightning_zero.integrations.trainer.step_rates`). The report
adds the rates (``throughput``) and ``lightning-zero estimate``'s prediction of the memory by kind for
the same model, stage and layout (``estimate``: the engine's
:meth:`~lightning_zero.engine.ShardEngine.estimated_memory`; and ``activation_bytes``, the
LightningModule's ``activation_bytes`` of the micro-batch measured, where it states one).

Under CUDA each phase boundary inside the window synchronises the device first (the engine's
``synchronize_device``), so that a host interval holds the device work of its phase; steps outside the
window pay one ``perf_counter`` per batch end. ``gathered_peak_bytes`` is the engine's high-water
mark of stage-3 units gathered at once over the window (kept at each gather). When the batch after
the window starts (outside the window: in that step's data wait), every rank reads the engine's memory by kind
(:meth:`~lightning_zero.engine.ShardEngine.memory`) and its peak (device or process), one small
all-gather over the data-parallel ranks (under pipeline or tensor parallelism: rank 0's stage and
tensor rank) brings their figures to each of them (a second one their collective tally, whose kinds
every data-parallel rank shares: the collective sequence is the program's), rank 0 writes
``step_profile.json`` in the Trainer's ``log_dir`` (its fields: ``docs/strategy.md``) and every rank
logs ``zero/profile/*`` (rank 0's reach the logger). A fit that ends inside or right after the window
reports at its end.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import zlib
from dataclasses import asdict, dataclass, fields
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_zero.comm.host_clock import STAGE_CLOCK
from lightning_zero.engine import ShardEngine
from lightning_zero.integrations.trainer.saved_activations import SavedActivations
from lightning_zero.integrations.trainer.step_rates import (
    FlopCount,
    batch_tokens,
    given_activation_bytes,
    given_flops_per_token,
    peak_tflops,
    rates,
)

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
    pipeline_idle_s: float = 0.0
    optimizer_s: float = 0.0
    other_s: float = 0.0
    step_s: float = 0.0
    comm_exposed_s: float = 0.0
    gather_wait_s: float = 0.0
    host_s: float = 0.0
    batches: int = 0
    tokens: int = 0
    """This rank's tokens in the step's micro-batches; -1: unknown."""


_TIMES = [f.name for f in fields(StepTimes) if f.name not in ("step", "batches", "tokens")]
_MEMORY = [
    "param_bytes",
    "grad_shard_bytes",
    "state_bytes",
    "gathered_bytes",
    "gathered_peak_bytes",
    "pool_bytes",
    "peak_accumulating_bytes",
    "activation_bytes",
    "peak_bytes",
]


class StepProfiler(pl.Callback):
    """Added by ``ZeroStrategy(profile_steps=(first, last))``; see the module docstring."""

    reads_parameters_between_steps = False  # overlap_param_gather need not wait for it

    def __init__(
        self,
        engine: ShardEngine,
        first: int,
        last: int,
        pipeline: bool = False,
        peak_tflops: float | None = None,
        model_parallel: bool = False,
    ) -> None:
        self.engine, self.first, self.last, self.pipeline = engine, first, last, pipeline
        self.peak_tflops = peak_tflops  # profile_peak_tflops
        self.model_parallel = model_parallel  # tensor or pipeline parallel: a rank runs a part of the model
        self.steps: list[StepTimes] = []
        self.report: dict[str, Any] | None = None  # rank 0's JSON once written; every rank's figures
        self._mark = 0.0  # the last batch's end (or the epoch's start)
        self._open: StepTimes | None = None
        self._first_start = 0.0  # the open step's first batch start
        self._start = self._before_backward = self._before_step = 0.0
        self._wait_start = self._gather_start = 0.0  # the engine's comm waits at the batch's start
        self._host_start = 0.0  # the host's seconds in our code at the batch's start
        self._host_before: bool | None = None  # whether the host clock was on before the window
        self._stage_start = 0.0  # under a pipeline: the stages' own work so far, at the batch's start
        self._stage_before: bool | None = None  # whether the stage clock was on before the window
        self._counter = FlopCount()  # the step before the window's first micro-batch, when counted
        self._activations = SavedActivations()  # that micro-batch's forward too (not under a pipeline)
        self._activations_estimate: int | None = None  # the LightningModule's, for that micro-batch
        self._flops: tuple[float | None, str] = (None, "")  # FLOPs per token and where they come from
        self._comm: dict[str, tuple[int, int]] | None = None  # the window's collective tally
        self._gathered_peak = 0  # stage 3: the most bytes of units gathered at once in the window
        self._step_before = 0
        self._device_waits_before = False
        self._rank = 0  # the global rank, known at the window's end

    def _now(self) -> float:
        self.engine.synchronize_device()  # CUDA: the phase's device work is in its interval
        return time.perf_counter()

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark = time.perf_counter()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        first_batch = trainer.global_step != self._step_before or batch_idx == 0
        self._step_before = trainer.global_step
        if self.report is None and self.steps and trainer.global_step > self.last:
            self._finish(trainer, pl_module)  # in the next step's data wait, outside the window
        if trainer.global_step == self.first - 1 and first_batch and self._counter.flops_per_token is None:
            if not self.model_parallel and given_flops_per_token(pl_module, batch) is None:
                self._counter.start(batch_tokens(pl_module, batch))  # left in on_after_backward
        if trainer.global_step == self.first - 1 and first_batch and self._activations.bytes is None:
            if not self.pipeline and not self._activations.counting:
                self._activations_estimate = given_activation_bytes(pl_module, batch)
                self._activations.start()  # left before its backward
        if self.report is not None or not self.first <= trainer.global_step <= self.last:
            return
        self._start = now = self._now()
        if self._open is None:
            if not self.steps:  # the window's first batch
                self._device_waits_before = self.engine.time_device_waits()
                self._host_before = self.engine.time_host()
                if self.pipeline:
                    self._stage_before = STAGE_CLOCK.start()
                self.engine.start_collective_tally()
                self.engine.gathered_peak_bytes(reset=True)
            self._open, self._first_start = StepTimes(step=trainer.global_step), now
            self._open.step_s = now - self._mark
        self._open.data_wait_s += now - self._mark
        tokens = batch_tokens(pl_module, batch)
        self._open.tokens = -1 if tokens is None or self._open.tokens < 0 else self._open.tokens + tokens
        self._before_backward = self._before_step = 0.0
        self.engine.flush_timings()
        # counters no reset clears: the log_comm_stats monitor resets its own inside the window
        self._wait_start = self.engine.comm_wait_s(since_start=True)
        self._gather_start = self.engine.comm_gather_wait_s(since_start=True)
        self._host_start = self.engine.host_s()
        if self.pipeline:
            STAGE_CLOCK.flush()
            self._stage_start = STAGE_CLOCK.seconds

    def _flops_per_token(self, pl_module: pl.LightningModule, batch: Any) -> tuple[float | None, str]:
        given = given_flops_per_token(pl_module, batch)
        if given is not None:
            return given, f"the LightningModule's flops_per_token ({type(pl_module).__name__})"
        if self._counter.flops_per_token is not None:
            return self._counter.flops_per_token, (
                "counted by torch's FlopCounterMode over the forward and backward of the first micro-batch "
                f"of step {self.first - 1}, divided by its tokens"
            )
        why = "under tensor or pipeline parallelism" if self.model_parallel else "the window starts at step 0"
        return None, f"not counted ({why}): give the LightningModule a flops_per_token"

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self._activations.stop()  # a count started at this batch's start ends (once)
        if self._open is not None:
            self._before_backward = self._now()

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._counter.stop()  # a count started at this batch's start ends (once)
        if self._open is None:
            return
        now = self._now()
        if self.pipeline:  # the schedule ran forward and backward inside training_step
            self._open.pipeline_s += now - self._start
            STAGE_CLOCK.flush()  # CUDA: the device ran them (synchronised by _now)
            self._open.pipeline_idle_s += now - self._start - (STAGE_CLOCK.seconds - self._stage_start)
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
            self._counter.stop()  # a batch without a backward (manual optimization) ends a count too
            self._activations.stop()
            self._mark = time.perf_counter()
            return
        now = self._now()
        self.engine.flush_timings()  # CUDA: the waits' events are read (the device is synchronised)
        step.comm_exposed_s += self.engine.comm_wait_s(since_start=True) - self._wait_start
        step.gather_wait_s += self.engine.comm_gather_wait_s(since_start=True) - self._gather_start
        step.host_s += self.engine.host_s() - self._host_start
        step.batches += 1
        if self._before_step:
            step.optimizer_s += now - self._before_step
        if not self._flops[1]:  # the window's first batch: between two timed intervals (a model built)
            self._flops = self._flops_per_token(pl_module, batch)
        self._mark = time.perf_counter()
        if trainer.global_step == self._step_before:  # a micro-batch that only accumulates
            return
        step.step_s += now - self._first_start
        parts = step.data_wait_s + step.forward_s + step.backward_s + step.pipeline_s + step.optimizer_s
        step.other_s = step.step_s - parts
        self.steps.append(step)
        self._open = None
        if step.step == self.last:
            self._stop_counting()

    def _stop_counting(self) -> None:
        """The window's last batch has ended (or the fit, inside the window): the counters that run only
        in the window stop."""
        self._comm = self.engine.stop_collective_tally()
        self._gathered_peak = self.engine.gathered_peak_bytes()
        if self._host_before is not None:
            self.engine.time_host(self._host_before)
            self._host_before = None
        if self._stage_before is not None:
            STAGE_CLOCK.flush()
            STAGE_CLOCK.stop(keep=self._stage_before)
            self._stage_before = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.report is None and self.steps:  # the fit ended inside the window
            self._finish(trainer, None)

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule | None) -> None:
        """Every rank: gather the figures, rank 0 writes the file; all log."""
        self.engine.time_device_waits(self._device_waits_before)
        if self._comm is None:  # the fit ended inside the window
            self._stop_counting()
        assert self._comm is not None
        memory = self._memory()
        times = [getattr(s, name) for s in self.steps for name in _TIMES]
        tokens = [float(s.tokens) for s in self.steps]
        kinds = sorted(self._comm)
        agree = [float(len(kinds)), float(zlib.crc32("\n".join(kinds).encode()))]
        row = [float(trainer.global_rank), *times, *tokens, *(float(memory[k]) for k in _MEMORY), *agree]
        rows = self.engine.gather_floats(row)  # every rank ran the same steps: rows of one length
        comm: list[dict[str, dict[str, int]] | None] = [None] * len(rows)
        if kinds and all(r[-2:] == agree for r in rows):  # the same kinds everywhere (else: null)
            tallies = self.engine.gather_floats([float(v) for k in kinds for v in self._comm[k]])
            comm = [
                {k: {"count": int(t[2 * i]), "bytes": int(t[2 * i + 1])} for i, k in enumerate(kinds)}
                for t in tallies
            ]
        self.report = self._report([r[:-2] for r in rows], memory["peak_kind"], comm)
        self.report["throughput"] = self._throughput(trainer)
        self.report["estimate"] = self.engine.estimated_memory(str(trainer.precision))
        if self._activations_estimate is not None:
            self.report["estimate"]["activation_bytes"] = self._activations_estimate
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
        saved = -1 if self._activations.bytes is None else self._activations.bytes  # -1: not counted
        return {
            **figures,
            "gathered_peak_bytes": self._gathered_peak,
            "activation_bytes": saved,
            "peak_bytes": peak,
            "peak_kind": kind,
        }

    def _report(
        self, rows: list[list[float]], peak_kind: str, comm: list[dict[str, dict[str, int]] | None]
    ) -> dict[str, Any]:
        count = len(self.steps)
        ranks: list[dict[str, Any]] = []
        width = len(_TIMES)
        for (rank, *row), tally in zip(rows, comm, strict=True):
            times = [dict(zip(_TIMES, row[i * width : (i + 1) * width], strict=True)) for i in range(count)]
            tokens = [int(t) for t in row[count * width : count * (width + 1)]]
            steps = [
                {"step": s.step, **t, "tokens": n} for s, t, n in zip(self.steps, times, tokens, strict=True)
            ]
            mean = {name: statistics.fmean(t[name] for t in times) for name in _TIMES}
            held = row[count * (width + 1) :]
            memory: dict[str, Any] = {k: int(v) for k, v in zip(_MEMORY, held, strict=True) if v >= 0}
            memory["peak_kind"] = peak_kind
            ranks.append({"rank": int(rank), "mean": mean, "steps": steps, "memory": memory})
            if tally is not None:  # absent where the ranks' kinds differed
                ranks[-1]["comm"] = tally
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

    def _throughput(self, trainer: pl.Trainer) -> dict[str, Any]:
        assert self.report is not None
        tokens = [[s["tokens"] for s in r["steps"]] for r in self.report["ranks"]]
        step_s = [[s["step_s"] for s in r["steps"]] for r in self.report["ranks"]]
        peak = peak_tflops(trainer.strategy.root_device, str(trainer.precision), self.peak_tflops)
        return rates(tokens, step_s, *self._flops, trainer.world_size, peak)

    def _metrics(self) -> dict[str, float]:
        assert self.report is not None
        mine = next(r["mean"] for r in self.report["ranks"] if r["rank"] == self._rank)
        rated = {k: self.report["throughput"][k] for k in ("tokens_per_s", "mfu")}
        return {
            **{f"zero/profile/{name}": float(mine[name]) for name in _TIMES},
            **{f"zero/profile/{k}": float(v) for k, v in rated.items() if v is not None},
            "zero/profile/slowest_rank": float(self.report["slowest_rank"]),
            "zero/profile/slowest_over_fastest": float(self.report["slowest_over_fastest"]),
        }
