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
from lightning_zero.comm.handles import (
    CommError,
    CommStats,
    EventDone,
    InCall,
    Named,
    process_watchdog,
)
from lightning_zero.comm.history import group_history, last_collectives
from lightning_zero.comm.recorder import Recorder, recorder_for
from lightning_zero.comm.signatures import SignatureCheck
from lightning_zero.comm.trace import span
from lightning_zero.comm.watchdog import Watchdog


class Comm:
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
        self.stats.add_wait(time.perf_counter() - start_s, params)
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

    def broadcast_tensors(self, tensors: list[Tensor], src: int = 0, bucket_bytes: int = 250 * 2**20) -> None:
        """Overwrite ``tensors`` with rank ``src``'s values (blocking, control traffic).

        Tensors of one dtype travel together, in broadcasts of at most ``bucket_bytes`` (a larger tensor
        alone), so the transient copy stays bounded (torch DDP's start-up sync uses 250 MiB too).
        """
        if self.world_size == 1 or not tensors:
            return
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            chunk: list[Tensor] = []
            nbytes = 0
            for t in group:
                if chunk and nbytes + t.numel() * t.element_size() > bucket_bytes:
                    self._broadcast_chunk(chunk, src)
                    chunk, nbytes = [], 0
                chunk.append(t)
                nbytes += t.numel() * t.element_size()
            self._broadcast_chunk(chunk, src)

    @torch.no_grad()
    def _broadcast_chunk(self, tensors: list[Tensor], src: int) -> None:
        flat = torch.cat([t.detach().reshape(-1) for t in tensors]).to(self.device)
        self.stats.count(flat.numel() if self.rank == src else 0, flat.dtype, True, "broadcast")
        self._record(f"broadcast_from_{src}", flat.numel(), flat.dtype, "broadcast of tensors")
        self._run(f"broadcast of {flat.numel()} elements from rank {src}", self.backend.broadcast, flat, src)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Gather a short list of integers from every rank (a blocking control collective)."""
        if self.world_size == 1:
            return [values]
        local = torch.tensor(values, dtype=torch.int64, device=self.device)
        out = torch.empty(self.world_size * len(values), dtype=torch.int64, device=self.device)
        self.stats.count(self._ring(out.numel()), out.dtype, True, "all_gather")
        self._record("all_gather", out.numel(), out.dtype, "all-gather of integers")
        self._run("all-gather of integers", self.backend.all_gather_tensor, out, local)
        return out.view(self.world_size, len(values)).tolist()

    def all_gather_floats(self, values: list[float]) -> list[list[float]]:
        """Gather a short list of floats from every rank (a blocking control collective, float64)."""
        if self.world_size == 1:
            return [values]
        local = torch.tensor(values, dtype=torch.float64, device=self.device)
        out = torch.empty(self.world_size * len(values), dtype=torch.float64, device=self.device)
        self.stats.count(self._ring(out.numel()), out.dtype, True, "all_gather")
        self._record("all_gather", out.numel(), out.dtype, "all-gather of floats")
        self._run("all-gather of floats", self.backend.all_gather_tensor, out, local)
        return out.view(self.world_size, len(values)).tolist()

    def gather(self, tensor: Tensor, dst: int = 0) -> Tensor | None:
        """Every rank's ``tensor`` concatenated on rank ``dst`` (``None`` elsewhere). Blocking."""
        if self.world_size == 1:
            return tensor
        out = (
            torch.empty(tensor.numel() * self.world_size, dtype=tensor.dtype, device=tensor.device)
            if self.rank == dst
            else None
        )
        self.stats.count(tensor.numel() if self.rank != dst else 0, tensor.dtype, True, "gather")
        self._record(f"gather_to_{dst}", tensor.numel(), tensor.dtype, f"gather to rank {dst}")
        self._run(f"gather of {tensor.numel()} elements to rank {dst}", self.backend.gather, tensor, out, dst)
        return out

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order, on every rank (blocking)."""
        what = "all-gather of a Python object"
        self._record("all_gather_object", -1, what=what)
        return self._run(what, self.backend.all_gather_object, obj)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s picklable ``obj`` on every rank (blocking)."""
        what = f"broadcast of a Python object from rank {src}"
        self._record(f"broadcast_object_from_{src}", -1, what=what)
        return self._run(what, self.backend.broadcast_object, obj, src)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's picklable ``obj`` in rank order on rank ``dst``, ``None`` on the others
        (blocking). Where only one rank needs everyone's word, this keeps what each rank receives
        and unpickles independent of the world size (an all-gather's grows with it)."""
        what = f"gather of Python objects to rank {dst}"
        self._record(f"gather_object_to_{dst}", -1, what=what)
        return self._run(what, self.backend.gather_object, obj, dst)

    def union_of(self, problems: list[str], root: int = 0) -> list[str]:
        """Every rank's ``problems`` (lines of text), each distinct line once in rank order, on every
        rank: gathered on ``root``, then broadcast (two collectives, on all ranks). What a rank
        receives is the union, not ``world_size`` lists: nothing per rank grows with the world
        size except on ``root``."""
        everyone = self.gather_object(problems, dst=root)
        # elsewhere its own list is passed: ignored by a real broadcast, the union of N equal ranks' in
        # a simulated one (where a rank receives what it passes)
        union = problems if everyone is None else list(dict.fromkeys(p for rank in everyone for p in rank))
        return list(self.broadcast_object(union, src=root))

    def barrier(self, what: str = "barrier") -> None:
        """Return once every rank has called it: one all-reduce of a single element, its result read
        on the host (on NCCL, waiting for the handle only orders the stream; the read blocks the
        host too). ``what`` names it in a failure."""
        if self.world_size > 1:
            flag = torch.zeros(1, device=self.device)
            self.wait(self.all_reduce(flag, control=True, what=what))
            flag.item()

    def same_everywhere(self, values: list[int]) -> bool:
        """Whether every rank passed the same integers (blocking, on all ranks): one all-reduce of
        ``2 len(values)`` int64s (the maximum of ``v`` and of ``-v``), whatever the world size. The
        values are compared modulo ``2**62`` (so that no value can fail to convert on one rank alone,
        before the collective the others entered)."""
        if self.world_size == 1:
            return True
        reduced = [v % 2**62 for v in values]
        both = torch.tensor(reduced + [-v for v in reduced], dtype=torch.int64, device=self.device)
        self.wait(self.all_reduce(both, op="max", control=True, what="agreement check"))
        top, neg = both.tolist()[: len(values)], both.tolist()[len(values) :]
        return all(a == -b for a, b in zip(top, neg, strict=True))

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
