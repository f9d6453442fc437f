"""What :class:`~lightning_zero.comm.Comm` hands out and counts: its error, its handles of pending
collectives (what the collective watchdog polls), and its counters.

  * :class:`CommError`, and :func:`collective_failures` for collectives made by other code;
  * ``Named``: a pending collective and what it is (the error names it); ``InCall`` and ``EventDone``:
    a blocking call, and a CUDA event behind a collective, as something with ``is_completed()``;
  * :class:`CommStats`: elements and bytes sent, control traffic apart, time waited (the waits on
    parameter all-gathers apart too), and, while a tally is on, the collectives and bytes by kind.

A failure names this rank's last collectives per group (:mod:`lightning_zero.comm.history`), here too
for collectives made by other code.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from lightning_zero.comm.history import last_collectives
from lightning_zero.comm.watchdog import Watchdog


class CommError(RuntimeError):
    """A collective failed: a peer died, hung past the process group's timeout, or the backend broke."""


@contextmanager
def collective_failures(what: str) -> Iterator[None]:
    """Run a collective made by other code (Lightning's own barrier, reduce, broadcast) with a backend
    failure re-raised as a :class:`CommError` naming it, as every collective of ours is, so that code
    that acts on a peer failure (the recipes' requeue) sees one whichever collective met it."""
    try:
        yield
    except CommError:
        raise
    except (RuntimeError, TimeoutError, ConnectionError) as err:  # torch's DistError is a RuntimeError
        raise CommError(
            f"{what} failed ({type(err).__name__}: {err}); a peer has died, hung past the process "
            "group's timeout, or lost its connection; " + last_collectives()
        ) from err


class Named:
    """A pending collective and what it is, for the error if it fails."""

    def __init__(self, handle: Any, what: str, params: bool = False) -> None:
        self.handle, self.what = handle, what
        self.params = params
        """A parameter all-gather: its wait is counted in :attr:`CommStats.gather_wait_s` too."""

    def is_completed(self) -> bool:
        done = getattr(self.handle, "is_completed", None)
        return bool(done()) if done is not None else True

    def exception(self) -> BaseException | None:
        """The error the collective completed with, where the handle tells (torch's ``Work``)."""
        failed = getattr(self.handle, "exception", None)
        return failed() if failed is not None else None

    def wait(self) -> bool:
        """Wait without the accounting of :meth:`Comm.wait` (use that one)."""
        return bool(self.handle.wait())


class InCall:
    """A blocking call as something the watchdog can poll: completed once it has returned."""

    returned = False

    def is_completed(self) -> bool:
        return self.returned


class EventDone:
    """A CUDA event as something the watchdog can poll (and a stream can wait for)."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def is_completed(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> bool:
        torch.cuda.current_stream().wait_event(self.event)
        return True


_PROCESS_WATCHDOG: list[Watchdog] = []


def process_watchdog() -> Watchdog:
    """The watchdog every watched :class:`Comm` of this process shares (one thread)."""
    if not _PROCESS_WATCHDOG:
        _PROCESS_WATCHDOG.append(Watchdog(CommError))
    return _PROCESS_WATCHDOG[0]


@dataclass
class CommStats:
    """Counters since the last :meth:`reset`."""

    elements_sent: int = 0
    """Elements this rank sent (ring cost model) in parameter and gradient collectives."""
    bytes_sent: int = 0
    """The same, in bytes of the dtype on the wire."""
    control_elements_sent: int = 0
    """Elements sent in small control collectives (used-parameter masks, norms, plan checks)."""
    control_bytes_sent: int = 0
    """The same, in bytes."""
    wait_s: float = 0.0
    """Seconds spent blocked waiting for collectives."""
    gather_wait_s: float = 0.0
    """Of :attr:`wait_s`, the seconds spent waiting for parameter all-gathers (stage 3's unit gathers;
    stages 1 and 2: the gathers after the optimizer step)."""
    waits_since_start_s: tuple[float, float] = (0.0, 0.0)
    """:attr:`wait_s` and :attr:`gather_wait_s` since this communicator was made, never reset: what a
    step profiler reads across the ``log_comm_stats`` monitor's resets, which fall inside its window."""
    collectives: int = 0
    tally: dict[str, list[int]] | None = None
    """``None`` (the default: nothing is done per collective but this test), or, while a step profiler
    counts (:meth:`start_tally`), ``kind -> [collectives, bytes sent]`` since then: the kinds are
    ``reduce_scatter``, ``all_reduce``, ``all_gather``, ``all_to_all``, ``broadcast``, ``gather``,
    with ``_control`` appended for control traffic (masks, norms, flags, plan checks)."""

    def reset(self) -> None:
        """Zero the counters; the :attr:`tally` runs on (it has its own start and stop: the
        ``log_comm_stats`` monitor resets between logs, inside a step profiler's window)."""
        self.elements_sent = self.bytes_sent = self.collectives = 0
        self.control_elements_sent = self.control_bytes_sent = 0
        self.wait_s = self.gather_wait_s = 0.0

    def add_wait(self, seconds: float, params: bool) -> None:
        """Count ``seconds`` blocked on a collective; ``params``: a parameter all-gather's wait."""
        gathered = seconds if params else 0.0
        self.wait_s += seconds
        self.gather_wait_s += gathered
        waited, gathers = self.waits_since_start_s
        self.waits_since_start_s = (waited + seconds, gathers + gathered)

    def start_tally(self) -> None:
        """Count the collectives and bytes by kind from now on (:attr:`tally`, emptied)."""
        self.tally = {}

    def stop_tally(self) -> dict[str, list[int]]:
        """Stop counting by kind; returns what was counted since :meth:`start_tally` (empty if never)."""
        tally, self.tally = self.tally or {}, None
        return tally

    def count(self, numel: int, dtype: torch.dtype, control: bool = False, kind: str = "") -> None:
        """Add ``numel`` elements of ``dtype`` sent by this rank in one collective of ``kind``."""
        nbytes = numel * dtype.itemsize
        if control:
            self.control_elements_sent += numel
            self.control_bytes_sent += nbytes
        else:
            self.elements_sent += numel
            self.bytes_sent += nbytes
        if self.tally is not None:
            entry = self.tally.setdefault(f"{kind}_control" if control else kind, [0, 0])
            entry[0] += 1
            entry[1] += nbytes
