""":class:`Comm`: the one communication API of the engine — collectives, their counts, their timing.

Every collective the engine, the optimizer and the checkpoints make goes through a :class:`Comm`,
which

  * delegates how it runs to the backend chosen for the process group (:func:`backend_for`: single
    process, torch's native collectives, or gloo's split ones): no caller branches on the backend;
  * counts what this rank *sends* at the ring-algorithm cost (reduce-scatter and all-gather of ``P``
    elements: ``P·(N−1)/N``; all-reduce: ``2·P·(N−1)/N``), in elements and in bytes on the wire;
  * times how long the caller blocks in :meth:`Comm.wait`: communication that backward did not hide;
  * names what failed: a collective that ends in an error (a dead peer; a hung one runs into the
    timeout) raises :class:`CommError` naming the operation, its size, this rank and this rank's last
    collectives per group (:mod:`lightning_zero.comm.history`), on every rank that waited for it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from lightning_zero.comm.backends import Backend, SingleProcess, backend_for, failure_hint
from lightning_zero.comm.control import ControlCollectives
from lightning_zero.comm.handles import (
    CommError,
    CommStats,
    EventDone,
    InCall,
    Named,
    process_watchdog,
)
from lightning_zero.comm.history import group_history, last_collectives
from lightning_zero.comm.host_clock import CLOCK
from lightning_zero.comm.recorder import Recorder, recorder_for
from lightning_zero.comm.signatures import SignatureCheck
from lightning_zero.comm.trace import span
from lightning_zero.comm.watchdog import Watchdog


class Comm(ControlCollectives):
    """Collectives over one process group, with counters. Create it on every rank.

    Args:
        group: the process group; ``None`` for the default one, or for no process group at all
            (then every collective is a local copy).
        backend: how the collectives run; default: :func:`backend_for` ``(group)``.
        role: what the group is for (``"world"``, ``"shard"``, ``"replicas"``, ``"background"``), the
            name the collective-order recorder compares ranks by (:mod:`lightning_zero.comm.recorder`);
            default ``"world"`` for the default group, ``"group"`` for another.
        ordered: the group's collectives are issued by the training thread in program order (false
            for a group used by a background thread; the recorder then checks it on its own).
    """

    def __init__(
        self, group: Any = None, backend: Backend | None = None, role: str | None = None, ordered: bool = True
    ) -> None:
        self.backend: Backend = backend if backend is not None else backend_for(group)
        self.group = group
        self.rank = self.backend.rank
        self.world_size = self.backend.world_size
        self.role = role or ("world" if group is None else "group")
        self.ordered = ordered
        self._recorder: Recorder | None = (
            self.backend.own_recorder(self.role, ordered)
            if not self.backend.recorded
            else recorder_for(
                self.backend.global_rank(),
                self.backend.global_ranks(),
                self.role,
                ordered,
                self.backend.group_name(),
            )
        )
        self._some_groups = 0  # depth of only_some_groups()
        self._global_rank = self.backend.global_rank()
        self._history = group_history(
            self._global_rank,
            self.role,
            self.world_size,
            self.backend.global_ranks(),
            self.backend.group_name(),
            failure_hint(self.backend.name),
        )
        self._signatures: SignatureCheck | None = None  # LZ_CHECK_COLLECTIVES: compared before each one
        self._watchdog: Watchdog | None = None
        self._watch_timeout_s = 0.0
        timeout_s = self.backend.timeout_s() if self.backend.watched else None
        if timeout_s is not None:
            self.watch(process_watchdog(), timeout_s)
        self.stats = CommStats()
        self.time_device_waits = False
        """Measure waits with CUDA events (NCCL); off by default: it keeps two events per wait
        until :meth:`flush_timings`."""
        self._device_waits: list[tuple[torch.cuda.Event, torch.cuda.Event, bool]] = []  # bool: params
        self._side_stream: torch.cuda.Stream | None = None

    @classmethod
    def single(cls, device: torch.device) -> Comm:
        """A group of this rank alone (even inside a larger process group): collectives are local
        copies, nothing is counted as sent."""
        return cls(None, SingleProcess(None, 0, 1, device))

    @property
    def device(self) -> torch.device:
        """Device for control tensors: NCCL only moves CUDA tensors, gloo only CPU ones."""
        return self.backend.device

    def _ring(self, numel: int) -> int:
        return numel * (self.world_size - 1) // self.world_size

    def _fail(self, what: str, err: BaseException) -> CommError:
        return CommError(
            f"{self._where()}: {what} failed ({type(err).__name__}: {err}); a peer "
            "has died, hung past the process group's timeout, or lost its connection; "
            + self._last_collectives()
        )

    def _last_collectives(self) -> str:
        return last_collectives(self._history, self._global_rank)

    def labelled(self, label: str) -> AbstractContextManager[None]:
        """``with comm.labelled("bucket 3"):`` collectives issued inside carry the label in a failure
        message's list of the last collectives (:mod:`lightning_zero.comm.history`)."""
        return self._history.labelled(label)

    @contextmanager
    def only_some_groups(self) -> Iterator[None]:
        """Collectives issued inside are issued by some groups of ranks only, by design (each group's
        own sequence still agrees, and no other group waits for them); the collective-order recorder
        compares them inside their group only (:mod:`lightning_zero.comm.recorder`)."""
        self._some_groups += 1
        try:
            yield
        finally:
            self._some_groups -= 1

    def watch(self, watchdog: Watchdog, timeout_s: float) -> None:
        """Have ``watchdog`` end this rank with a :class:`CommError` when a collective of this ``Comm``
        does not complete within ``timeout_s`` (on by itself where ``wait()`` cannot raise: NCCL, with
        the group's own timeout; :mod:`lightning_zero.comm.watchdog`)."""
        self._watchdog, self._watch_timeout_s = watchdog, timeout_s

    def _where(self) -> str:
        group = {"world": "", "group": " of its process group"}.get(self.role, f" in the {self.role} group")
        return f"rank {self.rank} of {self.world_size}{group}"

    def _watched(self, named: Named) -> Named:
        if self._watchdog is not None:
            self._watch(named, named.what)
        return named

    def _watch(self, pending: Any, what: str) -> None:
        """Hand ``pending`` to the watchdog, its failure message naming this rank, ``what`` and the
        group's last collectives."""
        assert self._watchdog is not None
        timeout_s, abort, where = self._watch_timeout_s, self.backend.abort, f"{self._where()}: {what}"
        self._watchdog.watch(pending, where, timeout_s, abort, self.device, self._last_collectives)

    def _watch_stream(self, what: str) -> None:
        """After a blocking collective on CUDA (enqueued, not finished): watch an event behind it."""
        if self._watchdog is not None and self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._watch(EventDone(event), what)

    def check_signatures(self, check: SignatureCheck) -> None:
        """Compare every collective this ``Comm`` issues in program order with every rank's before
        issuing it (``LZ_CHECK_COLLECTIVES``: :mod:`lightning_zero.comm.signatures`)."""
        if self.ordered:
            self._signatures = check

    def _record(self, op: str, numel: int, dtype: torch.dtype | None = None, what: str = "") -> None:
        """Before every collective: raise the watchdog's failure if it found one (every later
        collective of a failed rank fails at once); with ``LZ_CHECK_COLLECTIVES`` compare its
        signature across ranks; in test mode log the collective (:mod:`lightning_zero.comm.recorder`)."""
        if self._watchdog is not None:
            self._watchdog.check()
        self._history.note(what or op, numel, dtype if dtype is not None else "object")
        if self._signatures is not None and not self._some_groups:
            self._signatures.check(self.role, op, numel, dtype if dtype is not None else "object", what or op)
        if self._recorder is not None:
            self._recorder.record(op, numel, dtype if dtype is not None else "object", not self._some_groups)

    def _run(self, what: str, fn: Any, *args: Any, blocking: bool = True) -> Any:
        """``fn(*args)``, a collective (``blocking``: one that returns no handle, on CUDA watched
        while the call lasts, since torch's object collectives synchronise inside it, and through an
        event behind it afterwards), with a failure named."""
        in_call = InCall() if blocking and self._watchdog is not None and self.device.type == "cuda" else None
        if in_call is not None:
            self._watch(in_call, what)
        waiting = getattr(fn, "__name__", "") == "wait"
        try:
            with span(f"{self.role}: {what}{' (wait)' if waiting else ''}", self.device):
                out = fn(*args)
        except CommError:
            raise
        except Exception as err:  # noqa: BLE001 - named and re-raised
            raise self._fail(what, err) from err
        finally:
            if in_call is not None:
                in_call.returned = True
        if blocking:
            self._watch_stream(what)
        return out

    def reduce_scatter(self, output: Tensor, input_: Tensor, what: str = "reduce-scatter") -> Any:
        """Async sum-reduce-scatter of ``input_`` (``world_size * output.numel()``) into ``output``.

        ``input_`` is scratch afterwards: its contents are undefined once the handle is waited for.
        """
        self.stats.count(self._ring(input_.numel()), input_.dtype, kind="reduce_scatter")
        self.stats.collectives += 1
        self._record("reduce_scatter", input_.numel(), input_.dtype, what)
        return self._watched(
            Named(
                self._run(what, self.backend.reduce_scatter, output, input_, blocking=False),
                f"{what} of {input_.numel()} elements",
            )
        )

    def all_reduce(
        self, tensor: Tensor, op: str = "sum", control: bool = False, what: str = "all-reduce"
    ) -> Any:
        """Async in-place all-reduce (``op``: ``"sum"`` or ``"max"``). ``control`` counts it apart
        from gradient traffic."""
        self.stats.count(2 * self._ring(tensor.numel()), tensor.dtype, control, "all_reduce")
        self.stats.collectives += 1
        self._record(f"all_reduce_{op}", tensor.numel(), tensor.dtype, what)
        return self._watched(
            Named(
                self._run(what, self.backend.all_reduce, tensor, op, blocking=False),
                f"{what} of {tensor.numel()} elements",
            )
        )

    def all_gather(
        self, output: Tensor, input_: Tensor, what: str = "all-gather", params: bool = False
    ) -> Any:
        """Async all-gather of every rank's ``input_`` into ``output`` (may be in place). ``params``: a
        gather of parameters, whose wait :meth:`wait` counts in ``stats.gather_wait_s`` too."""
        self.stats.count(self._ring(output.numel()), output.dtype, kind="all_gather")
        self.stats.collectives += 1
        self._record("all_gather", output.numel(), output.dtype, what)
        return self._watched(
            Named(
                self._run(what, self.backend.all_gather, output, input_, blocking=False),
                f"{what} of {output.numel()} elements",
                params,
            )
        )

    def all_to_all(self, output: Tensor, input_: Tensor, what: str = "all-to-all") -> Any:
        """Async all-to-all of equal chunks: this rank's chunk ``r`` of ``input_`` goes to rank ``r``,
        and rank ``s``'s chunk for this rank lands in chunk ``s`` of ``output`` (``input_.numel()``
        divisible by the world size; ``output`` like ``input_``, not the same tensor). Counted as the
        ``(N-1)/N`` of ``input_`` that leaves this rank."""
        if input_.numel() % self.world_size or output.numel() != input_.numel():
            raise ValueError(
                f"all_to_all needs equal chunks: {input_.numel()} elements in and {output.numel()} out "
                f"over {self.world_size} ranks"
            )
        self.stats.count(self._ring(input_.numel()), input_.dtype, kind="all_to_all")
        self.stats.collectives += 1
        self._record("all_to_all", input_.numel(), input_.dtype, what)
        return self._watched(
            Named(
                self._run(what, self.backend.all_to_all, output, input_, blocking=False),
                f"{what} of {input_.numel()} elements",
            )
        )

    def wait(self, handle: Any) -> None:
        """Block on ``handle`` and account the time.

        Under NCCL ``wait()`` returns at once and makes the current CUDA stream wait instead, so a
        host timer reads ~0: with :attr:`time_device_waits` on, a pair of CUDA events around it
        measures how long the stream stalled (read by :meth:`flush_timings`, which synchronises).
        """
        if self._watchdog is not None:
            self._watchdog.check()
        work, what = (handle.handle, handle.what) if isinstance(handle, Named) else (handle, "a collective")
        params = isinstance(handle, Named) and handle.params
        if self.device.type == "cuda" and self.time_device_waits:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._run(what, work.wait, blocking=False)
            end.record()
            self._device_waits.append((start, end, params))
            self._drop_work(handle)
            return
        start_s = time.perf_counter()
        self._run(what, work.wait, blocking=False)
        waited = time.perf_counter() - start_s
        self.stats.add_wait(waited, params)
        CLOCK.waited(waited)  # not our code's host time (a profiled window's host_s)
        self._drop_work(handle)

    def _drop_work(self, handle: Any) -> None:
        """Watched on CUDA: once the stream waits for it, the handle (and the watchdog) keep an event
        recorded behind the collective instead of its ``Work``, which holds its tensors alive."""
        if self._watchdog is not None and self.device.type == "cuda" and isinstance(handle, Named):
            event = torch.cuda.Event()
            event.record()
            handle.handle = EventDone(event)

    @contextmanager
    def after(self, handle: Any) -> Iterator[None]:
        """Collectives issued inside run after ``handle``'s, without making the current CUDA stream
        wait for it (NCCL: a side stream waits on it and the collectives are issued from that stream,
        as FSDP2 orders its all-reduce after its reduce-scatter; elsewhere: a host wait, accounted
        as :meth:`wait` accounts it)."""
        if self.device.type != "cuda":
            self.wait(handle)
            yield
            return
        work, what = (handle.handle, handle.what) if isinstance(handle, Named) else (handle, "a collective")
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=self.device)
        self._side_stream.wait_stream(torch.cuda.current_stream(self.device))  # its inputs are ready
        with torch.cuda.stream(self._side_stream):
            self._run(what, work.wait, blocking=False)
            self._drop_work(handle)
            yield

    def read_here(self, tensor: Tensor) -> None:
        """``tensor``, made inside :meth:`after` (CUDA: on the side stream), is read on the current stream
        from now on: its memory is not handed out before that stream's work on it (``record_stream``)."""
        if tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream(tensor.device))

    def flush_timings(self) -> None:
        """Add the CUDA-measured waits recorded so far to ``stats.wait_s`` (synchronises with the
        device: call when the figures are read, e.g. once per logged step, not in the step)."""
        for start, end, params in self._device_waits:
            end.synchronize()
            self.stats.add_wait(start.elapsed_time(end) / 1000.0, params)
        self._device_waits.clear()

    def new_group(self, backend: str, timeout: timedelta | None = None) -> Comm:
        """A :class:`Comm` over the same ranks on a new process group, for background work that must
        not interleave with training collectives (e.g. gloo for the async checkpoint writer's thread:
        role ``"background"``, not ordered with the training thread's collectives). Call on all ranks.

        ``timeout``: how long a collective of the new group may wait for a peer before it fails;
        pass the training group's (the strategy's ``timeout``): ``None`` gives torch's default
        (30 minutes), which a dead or hung peer would then cost every other rank.
        """
        self._record("new_group", -1, what="new process group")
        return Comm(self.backend.new_group(backend, timeout), role="background", ordered=False)
