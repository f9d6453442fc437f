"""The collective watchdog: a dead or hung peer becomes a :class:`CommError` where ``Work.wait()`` cannot
raise (NCCL), as it does on gloo.

On gloo a collective is CPU work: ``wait()`` blocks and raises when the group's timeout passes, and
:class:`~lightning_zero.comm.Comm` turns that into a ``CommError`` naming the collective. On NCCL
``wait()`` only makes the current CUDA stream wait; a peer that never joins leaves the kernel spinning,
the host runs ahead until something synchronises (a ``.item()``, a checkpoint) and then blocks for good.
torch's own watchdog thread notices the timeout and, with its default
``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``, ends the process: no Python exception, no ``on_exception``, no
exit status 75, no requeue. The choices (each from torch's documented mechanisms), and their cost:

  * ``TORCH_NCCL_BLOCKING_WAIT=1``: ``wait()`` blocks the host and raises. Every wait becomes a host
    synchronisation, so the host can no longer queue the next bucket's work behind a collective: the
    overlap the engine is built for is lost.
  * ``Work.wait(timeout)``: the same host block, per call.
  * **a watchdog of our own (this module)**: every asynchronous collective issued through a watched
    ``Comm`` (and, on CUDA, every blocking one while the call lasts, then an event recorded behind
    it: torch's object collectives synchronise inside the call) is registered with its
    deadline, the issuing group's timeout. One thread per process polls ``is_completed()`` (a CUDA
    event query: no synchronisation) every ``poll_s``. Cost on the step: one list append per
    collective; nothing on the stream, no host synchronisation.

When a registered collective is past its deadline the watchdog (1) records a ``CommError`` naming
the collective, its group and this rank; (2) raises it in the main thread
(``PyThreadState_SetAsyncExc``: it surfaces at the next Python line the main thread runs, e.g. in an
autograd hook or Lightning's loop, so ``on_exception``, the recipes' requeue and exit status 75
follow as on gloo), and every later collective of a watched ``Comm`` raises it too; (3) calls the
group's abort (NCCL: ``abort`` of the process group, which ends the spinning kernels, so that a host
blocked in a synchronisation returns to meet the error); (4) if the process is still alive one more
timeout later (the main thread caught the error and went on, or never returned from C++), prints
the error and exits with status 75 (``EX_TEMPFAIL``, the recipes' status for a peer failure), so a
rank never hangs (a handler of the error that takes longer than one timeout, e.g. an emergency save,
is cut short then). The thread makes the watched device current before it queries an event. A
completed collective's ``Work`` (and the tensors it holds) is not kept until the next poll: once
waited for, the ``Comm`` swaps it for an event recorded behind it.

Unverified here (no GPU, and NCCL refuses two ranks on one GPU): that ``abort`` releases a host blocked
in a stream synchronisation on every torch version; ``benchmarks/gpu_check.py`` checks the rest of the
path at world size 1 (a never-completing CUDA event behind a collective ends as ``CommError`` within
the timeout).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

EXIT_PEER_FAILURE = 75
"""Exit status when the main thread did not end after the error was raised in it (EX_TEMPFAIL)."""


@dataclass
class _Watched:
    pending: Any
    """Has ``is_completed()``."""
    what: str
    timeout_s: float
    deadline: float
    abort: Callable[[], None] | None
    context: Callable[[], str] | None = None
    """Read when it expires: what the failure message adds (its group's last collectives)."""


class Watchdog:
    """Watches pending collectives (see the module docstring); one per process (:func:`watchdog`).

    Args:
        error_type: the exception raised (the caller's ``CommError``; a subclass carrying the message is
            what reaches the main thread, so ``isinstance(err, error_type)`` holds there).
        poll_s: seconds between two looks at the pending collectives.
        exit_after: the main thread has this many times the expired timeout, after the error was raised
            in it, to end the process before the watchdog exits it with :data:`EXIT_PEER_FAILURE`;
            ``None``: never exit (the caller must act on the error).
    """

    def __init__(
        self, error_type: type[BaseException], poll_s: float = 1.0, exit_after: float | None = 1.0
    ) -> None:
        self.error_type, self.poll_s, self.exit_after = error_type, poll_s, exit_after
        self.failure: BaseException | None = None
        self._pending: list[_Watched] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.main = threading.main_thread()
        """The thread the error is raised in."""
        self.device: torch.device | None = None

    def watch(
        self,
        pending: Any,
        what: str,
        timeout_s: float,
        abort: Callable[[], None] | None = None,
        device: torch.device | None = None,
        context: Callable[[], str] | None = None,
    ) -> None:
        """Register ``pending`` (anything with ``is_completed()``): it must complete within ``timeout_s``;
        ``abort`` (e.g. the process group's) is called if it does not. ``device``: the CUDA device the
        completion is queried on (the thread makes it current: a query from device 0 by default would
        create a CUDA context there on every rank of a node). ``context()``: text the failure message
        ends with, read when it expires."""
        self.check()
        if device is not None and device.type == "cuda":
            self.device = device
        watched = _Watched(pending, what, timeout_s, time.monotonic() + timeout_s, abort, context)
        with self._lock:
            self._pending.append(watched)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="lightning-zero-watchdog", daemon=True)
                self._thread.start()

    def check(self) -> None:
        """Raise the recorded failure, if any (every watched ``Comm`` calls this before a collective)."""
        if self.failure is not None:
            raise self.failure

    @property
    def pending(self) -> int:
        """Collectives registered and not yet seen complete."""
        with self._lock:
            return len(self._pending)

    def _expired(self) -> _Watched | None:
        now = time.monotonic()
        with self._lock:
            self._pending = [w for w in self._pending if not _done(w.pending)]
            return next((w for w in self._pending if w.deadline < now), None)

    def _run(self) -> None:
        if self.device is not None and torch.cuda.is_available():
            torch.cuda.set_device(self.device)
        while self.failure is None:
            time.sleep(self.poll_s)
            expired = self._expired()
            if expired is not None:
                self._fail(expired)

    def _fail(self, expired: _Watched) -> None:
        message = (
            f"{expired.what} did not complete within its process group's timeout of {expired.timeout_s:g} s "
            f"(found {time.monotonic() - expired.deadline:.1f} s past its deadline by the collective "
            "watchdog); a peer has died, hung, or lost its connection"
            + ("" if expired.context is None else f"; {expired.context()}")
        )
        self.failure = self.error_type(message)
        base = self.error_type

        class Raised(base):  # type: ignore[valid-type, misc]
            """What the main thread sees: ``error_type`` with the message (an async exception is
            raised by class, without arguments)."""

            def __init__(self, *args: object) -> None:
                super().__init__(*(args or (message,)))

        Raised.__name__ = Raised.__qualname__ = base.__name__
        # raised first, then the abort: the abort may release a main thread blocked behind the stuck
        # kernel, which must meet the error at once, not inside a handler it enters later
        _raise_in(self.main, Raised)
        if expired.abort is not None:
            try:
                expired.abort()
            except Exception as err:  # noqa: BLE001 - the error above still ends the rank
                print(f"lightning-zero watchdog: abort failed: {err!r}", file=sys.stderr, flush=True)
        if self.exit_after is None:
            return
        time.sleep(self.exit_after * expired.timeout_s)
        if self.main.is_alive():
            print(f"lightning-zero watchdog: {message}; exiting", file=sys.stderr, flush=True)
            os._exit(EXIT_PEER_FAILURE)


def _done(pending: Any) -> bool:
    """Completed successfully (a collective that completed with an error, e.g. one that torch's own
    watchdog aborted under ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``, is not: it stays until its deadline
    and then fails by name)."""
    try:
        if not pending.is_completed():
            return False
        failed = getattr(pending, "exception", None)
        return failed is None or failed() is None
    except Exception:  # noqa: BLE001 - an error from the handle itself: failed, see above
        return False


NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def let_errors_reach_python() -> None:
    """Call before the NCCL process group is created: unless the user chose otherwise, torch's own
    watchdog is set to abort a failed or timed-out communicator without ending the process
    (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``; torch's default, 3, ends the process at the same timeout
    as ours, before a ``CommError`` can reach Python). The abort also ends kernels stuck on a dead
    peer, so a host blocked behind them returns."""
    os.environ.setdefault(NCCL_ERROR_HANDLING, "2")


def _raise_in(thread: threading.Thread, exc_type: type[BaseException]) -> None:
    """Raise ``exc_type`` in ``thread`` at its next Python line (CPython's async exception)."""
    if thread.ident is not None and thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc_type))
