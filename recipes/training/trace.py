"""A Chrome trace of a few training steps, one file per rank: `<dirpath>/trace-rank<R>.json`.

`StepTrace(steps=[5, 7])` runs `torch.profiler` over optimizer steps 5 to 7 (Lightning's `global_step`
as each begins, counting from 0), with every activity the build supports (CPU operators; CUDA kernels
on a GPU), and writes the trace when step 7 ends. The step before the first is the profiler's warm-up
(recorded, then dropped), so its start-up cost stays out of the traced steps; with gradient
accumulation a step is all its micro-batches. Open the file in https://ui.perfetto.dev or
chrome://tracing: lightning-zero's named ranges (`lightning_zero bucket 3: launch`, `lightning_zero unit
blocks.0: gather`, ...; the table is in docs/troubleshooting.md, "Slow steps") show its schedule among
torch's operators and kernels, rank by rank.

Outside the traced steps the callback compares two integers per batch: no profiler runs, and the
ranges cost one check each. A run that ends before `last` writes the steps it traced; a run resumed
past `last` traces nothing, one resumed inside the range traces the steps left. Every rank writes its
own file, `R` its global rank; a later run with the same steps overwrites them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


class StepTrace(Callback):
    """Writes a Chrome trace of optimizer steps `steps[0]` to `steps[1]` (see the module docstring)."""

    def __init__(self, steps: tuple[int, int] = (5, 7), dirpath: str = "trace") -> None:
        """Args:
            steps: `[first, last]`, the optimizer steps to trace (0-based, both included).
            dirpath: where each rank writes `trace-rank<R>.json`.

        Raises:
            ValueError: `steps` is not two integers `0 <= first <= last`, naming the value.
        """
        values = list(steps)  # a YAML list arrives as one
        if len(values) != 2 or not all(isinstance(v, int) for v in values) or not 0 <= values[0] <= values[1]:
            raise ValueError(
                f"steps={values!r}: give [first, last], two optimizer steps with 0 <= first <= last "
                "(e.g. [5, 7]: the three steps from global step 5)"
            )
        self.first, self.last = values
        self.dirpath = Path(dirpath)
        self._profiler: torch.profiler.profile | None = None
        self._step = -1  # the global step the profiler last saw begin
        self._done = False

    def path(self, rank: int) -> Path:
        """Where rank `rank` writes its trace."""
        return self.dirpath / f"trace-rank{rank}.json"

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self._profiler is not None or self._done or not self.first - 1 <= step <= self.last:
            return
        warmup = self.first - step if step < self.first else 0
        active = self.last - max(step, self.first) + 1
        rank = trainer.global_rank

        def write(profiler: torch.profiler.profile) -> None:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(str(self.path(rank)))
            self._done = True

        self._profiler = torch.profiler.profile(
            schedule=torch.profiler.schedule(wait=0, warmup=warmup, active=active, repeat=1),
            on_trace_ready=write,
        )
        self._profiler.start()
        self._step = step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._profiler is None or trainer.global_step == self._step:
            return  # not tracing, or a micro-batch that did not end an optimizer step
        self._step = trainer.global_step
        self._profiler.step()
        if self._done:  # the schedule's last active step ended: the trace is written
            self._stop()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop()  # a run that ended first writes the steps it traced

    def _stop(self) -> None:
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.stop()
