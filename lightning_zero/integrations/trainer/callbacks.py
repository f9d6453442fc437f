"""The callbacks ``ZeroStrategy`` adds to a ``fit`` at setup, after the engine exists.

* a ``WeightAveraging`` callback (replaced by :class:`ShardedWeightAveraging` in
  ``setup_environment``): the engine keeps the average on its shards;
* ``log_comm_stats=True``: :class:`CommStatsMonitor` (``zero/*`` metrics), unless the user gave one;
* ``skip_nonfinite_steps > 0``: :class:`SkippedStepsMonitor` (``zero/skipped_steps``), likewise;
* ``profile_steps=(first, last)``: :class:`StepProfiler` after those (its reads of the communication
  waits follow the monitor's reset), one per fit, bound to that fit's engine; ``None`` adds nothing;
* ``overlap_param_gather``: forward waits on the modules and :class:`ParamReadBarrier` first among
  the callbacks (:mod:`lightning_zero.integrations.trainer.param_barrier`).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_zero.engine.engine import ShardEngine
from lightning_zero.integrations.trainer.monitor import CommStatsMonitor, SkippedStepsMonitor
from lightning_zero.integrations.trainer.param_barrier import ParamReadBarrier
from lightning_zero.integrations.trainer.step_profile import StepProfiler
from lightning_zero.integrations.trainer.weight_averaging import ShardedWeightAveraging


def install_callbacks(
    trainer: pl.Trainer,
    engine: ShardEngine,
    log_comm_stats: bool,
    profile_steps: tuple[int, int] | None = None,
    pipeline: bool = False,
    peak_tflops: float | None = None,
    tensor_parallel: bool = False,
) -> None:
    """Wire the engine into ``trainer``'s callback list (in place), as the module docstring lists
    (``pipeline``: the step runs a pipeline schedule, which the profiler times as one part;
    ``peak_tflops``: ``profile_peak_tflops``; ``tensor_parallel``: a rank runs a part of each layer, so
    the profiler does not count its FLOPs as the model's)."""
    callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning
    keep_weight_average(engine, callbacks)
    if log_comm_stats and not any(isinstance(cb, CommStatsMonitor) for cb in callbacks):
        callbacks.append(CommStatsMonitor())
    skips = engine.config.skip_nonfinite_steps
    if skips and not any(isinstance(cb, SkippedStepsMonitor) for cb in callbacks):
        callbacks.append(SkippedStepsMonitor())
    callbacks[:] = [cb for cb in callbacks if not isinstance(cb, StepProfiler)]  # a previous fit's
    if profile_steps is not None:
        parts = pipeline or tensor_parallel
        callbacks.append(StepProfiler(engine, *profile_steps, pipeline, peak_tflops, model_parallel=parts))
    if engine.config.overlap_param_gather:
        engine.install_forward_waits(trainer.lightning_module)
        callbacks[:] = [cb for cb in callbacks if not isinstance(cb, ParamReadBarrier)]
        callbacks.insert(0, ParamReadBarrier(engine.wait_for_params, trainer))


def keep_weight_average(engine: ShardEngine, callbacks: list[Any]) -> None:
    """A ``WeightAveraging`` callback (replaced in ``setup_environment``): the engine keeps the
    average on the shards, before a checkpoint restores it."""
    averaging = [cb for cb in callbacks if isinstance(cb, ShardedWeightAveraging)]
    if len(averaging) > 1:
        raise ValueError(
            f"{len(averaging)} WeightAveraging callbacks were given; the zero strategies keep one weight "
            "average (as one AveragedModel per callback would under 'ddp', each a full copy): pass one"
        )
    if averaging:
        engine.keep_weight_average(averaging[0].device)
