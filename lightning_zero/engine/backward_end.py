"""A callback at the end of the running backward, queued once per backward, that survives a backward
which raised.

The gradient hooks of the reducer and of stage 3's units queue a callback on the autograd engine (as
torch DDP's reducer does) to close what a backward opened: the round's last collectives, the units
still gathered. Autograd runs the queued callbacks only when a backward completes; a backward that
raises (an out-of-memory error a training loop catches to skip the batch) drops them with its graph
task. A plain "queued" flag would then stay set, and the next backward would never queue its own
callback nor reset what the last one left. Here the queued callback is held weakly: once autograd has
dropped it without running it, :meth:`EndOfBackward.queue` sees it gone, calls ``abandoned`` (the
owner's reset of the per-backward state) and queues a new one.

A reentrant backward inside a backward (reentrant activation checkpointing) finds the outer
backward's callback queued and queues none of its own.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from lightning_zero.comm.host_clock import timed


class _Queued:
    """What autograd holds until the backward ends (this object, weakly referenced by its owner)."""

    __slots__ = ("run", "__weakref__")

    def __init__(self, run: Callable[[], None]) -> None:
        self.run = run

    @timed  # autograd calls it: a way into our code
    def __call__(self) -> None:
        self.run()


class EndOfBackward:
    """Calls ``at_end`` once at the end of each backward in which :meth:`queue` was called.

    Args:
        at_end: what to run when the backward completes.
        abandoned: what to run, before queueing again, when the previous backward raised after a
            :meth:`queue` (its ``at_end`` never ran); if it raises, so does every :meth:`queue` until
            :meth:`forget`.
    """

    def __init__(self, at_end: Callable[[], None], abandoned: Callable[[], None] = lambda: None) -> None:
        self._at_end = at_end
        self._abandoned = abandoned
        self._queued: weakref.ref[_Queued] | None = None

    @property
    def queued(self) -> bool:
        """A callback is queued on a backward that has not ended."""
        return self._queued is not None and self._queued() is not None

    def queue(self) -> None:
        """Queue ``at_end`` on the running backward unless it is queued there already. Call from a
        hook that autograd runs during a backward."""
        if self.queued:
            return
        if self._queued is not None:  # dropped by autograd without running: that backward raised
            self._abandoned()  # may raise: it then raises again at every queue() until forget()
            self._queued = None
        callback = _Queued(self._run)
        self._queued = weakref.ref(callback)
        torch.autograd.Variable._execution_engine.queue_callback(callback)

    def _run(self) -> None:
        self._queued = None
        self._at_end()

    def forget(self) -> None:
        """Drop the record of a queued callback (a step boundary: nothing of the last backward is kept)."""
        self._queued = None
