"""The host's time in lightning-zero's code: what a step profiler reports as ``host_s``.

Every way into the engine during a step is an entry point marked :func:`timed`: the hooks autograd and
the forward call (each parameter's gradient arriving, the end of the backward, stage 3's gathers
before a unit's forward and backward and its free after them, the wait for a parameter all-gather
left in flight into the forward) and the methods the optimizer and the integrations call (the step,
``zero_grad``, clipping, unscaling, the last gradient sync). While the process's :data:`CLOCK` is on,
an entry point adds the seconds from its entry to its return, once however deeply entry points nest,
less the seconds the host blocked in :meth:`~lightning_zero.comm.Comm.wait` inside it (those are
``comm_exposed_s``). Only the thread that switched the clock on is timed (not the asynchronous
checkpoint writer's).

What it holds depends on the device: on a CPU our code runs its kernels itself (the optimizer's update
of the shards, the copies of gradients into the buckets), so the host time is that work too; on CUDA
kernels are queued, so it is the Python and the launches, unless our code synchronises (a
``.item()``). A large host time on CUDA means the device waits for our code: the step is launch-bound.

Off (the default) an entry point costs one call and one test of a flag; the clock is switched on only
for a profiled window (``ZeroStrategy(profile_steps=...)``).

Under pipeline parallelism the same window times this rank's stages in their own work with
:data:`STAGE_CLOCK` (each micro-batch's forward, with the loss on the last stage, and backward:
:class:`~lightning_zero.comm.pipeline.ShardedStage`); the rest of the schedule's run is the stage's
idle time, the bubble and the waits for its neighbours' activations and gradients (``pipeline_idle_s``).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


class HostClock:
    """Seconds the host spent inside entry points marked :func:`timed`, less the waits inside them."""

    def __init__(self) -> None:
        self.on = False
        self.seconds = 0.0
        """Since the first :meth:`start`, never reset (read differences)."""
        self._depth = 0
        self._entered = 0.0
        self._thread: int | None = None

    def start(self) -> bool:
        """Time the entry points this thread runs from now on; returns whether the clock was on."""
        was, self.on, self._thread = self.on, True, threading.get_ident()
        return was

    def stop(self, keep: bool = False) -> None:
        """Stop timing (``keep``: leave it on, as :meth:`start` found it)."""
        self.on = keep

    def enter(self) -> bool:
        """An entry point starts; returns whether it is timed (hand that to :meth:`leave`)."""
        if threading.get_ident() != self._thread:
            return False
        self._depth += 1
        if self._depth == 1:
            self._entered = time.perf_counter()
        return True

    def leave(self) -> None:
        """A timed entry point returns (or raises)."""
        self._depth -= 1
        if self._depth == 0:
            self.seconds += time.perf_counter() - self._entered

    def waited(self, seconds: float) -> None:
        """The host blocked ``seconds`` on a collective: not our code's time when inside an entry point."""
        if self._depth > 0 and threading.get_ident() == self._thread:  # inside a timed entry point
            self.seconds -= seconds


CLOCK = HostClock()
"""The process's clock (a step profiler switches it on for its window)."""


def timed(fn: F) -> F:
    """Mark ``fn`` an entry point into lightning-zero's code (see the module docstring)."""

    @functools.wraps(fn)
    def entry(*args: Any, **kwargs: Any) -> Any:
        if not CLOCK.on or not CLOCK.enter():
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        finally:
            CLOCK.leave()

    return entry  # type: ignore[return-value]


class StageClock:
    """Seconds this rank's pipeline stages spent in their own forwards and backwards, while on: a host
    clock on a CPU; on CUDA a pair of events on the current stream around each (its device time, not
    the launches'), read by :meth:`flush`."""

    def __init__(self) -> None:
        self.on = False
        self.seconds = 0.0
        """Since the first :meth:`start`, never reset (read differences, after :meth:`flush`)."""
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def start(self) -> bool:
        """Time the stages' work from now on; returns whether the clock was on."""
        was, self.on = self.on, True
        return was

    def stop(self, keep: bool = False) -> None:
        """Stop timing (``keep``: leave it on, as :meth:`start` found it); :meth:`flush` first."""
        self.on = keep

    @contextmanager
    def timing(self, device: torch.device) -> Iterator[None]:
        """Around one forward or backward of a stage on ``device``."""
        if not self.on:
            yield
        elif device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((start, end))
        else:
            entered = time.perf_counter()
            try:
                yield
            finally:
                self.seconds += time.perf_counter() - entered

    def flush(self) -> None:
        """Add the device times recorded so far to :attr:`seconds` (waits for the last of them)."""
        for start, end in self._events:
            end.synchronize()
            self.seconds += start.elapsed_time(end) / 1e3
        self._events.clear()


STAGE_CLOCK = StageClock()
"""The process's clock of its pipeline stages' work (a step profiler switches it on for its window)."""
