"""How each collective runs: one class per kind of process group, chosen in one place (:func:`backend_for`).

  * :class:`SingleProcess`: no process group, or one of size 1. Collectives become local copies, so
    :class:`~lightning_zero.ShardedAdamW` runs in a plain single-process loop.
  * :class:`Native`: torch's own collectives (NCCL, and any backend not listed below).
  * :class:`GlooSplit`: gloo. Its ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` each
    allocate a full-size copy of the bucket and are slower than the collectives they could be built
    from; measured at 2 ranks on a 64 MiB fp32 bucket: reduce-scatter 142 ms and +66 MiB, as one
    ``reduce`` per destination rank 56 ms and +4 MiB; all-gather 103 ms and +64 MiB, as one
    ``broadcast`` per source rank 25 ms and +0 MiB. So here a reduce-scatter is ``N`` reduces (its
    input is scratch afterwards) and an all-gather is ``N`` broadcasts into the output; the elements
    each rank sends are the same ``P·(N−1)/N``.

A backend never counts or times anything (:class:`~lightning_zero.comm.Comm` does) and never chooses
the process group's backend itself: that is whatever the caller (e.g. Lightning) initialised.
Asynchronous collectives return a handle with ``wait()`` (and ``is_completed()``).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.comm.recorder import Recorder

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class Done:
    """Handle of a collective that finished synchronously."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Split:
    """Handle of a collective run as several: waits for all of them, then runs ``finish``."""

    def __init__(self, works: list[Any], finish: Any = None) -> None:
        self.works, self.finish = works, finish

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        if self.finish is not None:
            self.finish()
            self.finish = None
        return True


class Backend(ABC):
    """The collectives of one process group (see the module docstring). Methods that return a
    handle are asynchronous; the others block."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        device: torch.device,
        name: str = "",
    ) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self.device = device
        """Device of control tensors: NCCL moves only CUDA tensors, gloo only CPU ones."""
        self.name = name
        """The process group's backend (``"nccl"``, ``"gloo"``; ``""``: none, or not a torch one)."""

    recorded = True
    """Its collectives go to the collective-order recorder (test mode): a group of real ranks."""
    watched = False
    """``Work.wait()`` does not raise when a peer fails (NCCL): the collective watchdog
    (:mod:`lightning_zero.comm.watchdog`) watches this backend's collectives."""

    def own_recorder(self, role: str, ordered: bool) -> Recorder | None:
        """Where a backend that is not :attr:`recorded` records its collectives itself (a simulated
        rank's in-memory sequence); ``None``: nowhere."""
        return None

    def timeout_s(self) -> float | None:
        """The process group's timeout in seconds (``None``: unknown)."""
        return None

    def abort(self) -> None:
        """Abort the group's pending collectives and connections, where the backend can."""
        return None

    def global_rank(self) -> int:
        """This rank's rank in the default process group."""
        return self.rank

    def global_ranks(self) -> list[int]:
        """The default group's ranks of this group, in group-rank order."""
        return list(range(self.world_size))

    def group_name(self) -> str:
        """The process group's name, the same on every rank ("" without one)."""
        return ""

    @abstractmethod
    def reduce_scatter(self, output: Tensor, input_: Tensor) -> Any:
        """Implemented by each backend."""

    @abstractmethod
    def all_reduce(self, tensor: Tensor, op: str) -> Any:
        """Implemented by each backend."""

    @abstractmethod
    def all_gather(self, output: Tensor, input_: Tensor) -> Any:
        """Implemented by each backend."""

    @abstractmethod
    def all_to_all(self, output: Tensor, input_: Tensor) -> Any:
        """Implemented by each backend: chunk ``r`` of ``input_`` goes to rank ``r``, which writes what
        rank ``s`` sent into its chunk ``s`` of ``output`` (equal chunks)."""

    @abstractmethod
    def broadcast(self, tensor: Tensor, src: int) -> None:
        """Implemented by each backend."""

    @abstractmethod
    def all_gather_tensor(self, output: Tensor, input_: Tensor) -> None:
        """Implemented by each backend."""

    @abstractmethod
    def gather(self, tensor: Tensor, out: Tensor | None, dst: int) -> None:
        """Implemented by each backend."""

    @abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Implemented by each backend."""

    @abstractmethod
    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Implemented by each backend."""

    def gather_object(self, obj: Any, dst: int) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on rank ``dst`` (``None`` elsewhere); by default through
        :meth:`all_gather_object` (which every backend has; :class:`Native` gathers to ``dst`` only)."""
        everyone = self.all_gather_object(obj)
        return everyone if self.rank == dst else None

    @abstractmethod
    def new_group(self, backend: str, timeout: timedelta | None) -> dist.ProcessGroup | None:
        """Implemented by each backend."""


class SingleProcess(Backend):
    """World size 1: every collective is a local copy (or nothing)."""

    recorded = False

    def global_rank(self) -> int:
        """This rank's rank in the default process group: a group of one inside a larger world (a
        data-parallel dimension of size 1 of a mesh) is that rank, not rank 0."""
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else self.rank

    def global_ranks(self) -> list[int]:
        return [self.global_rank()]

    def reduce_scatter(self, output: Tensor, input_: Tensor) -> Any:
        output.copy_(input_)
        return Done()

    def all_reduce(self, tensor: Tensor, op: str) -> Any:
        return Done()

    def all_gather(self, output: Tensor, input_: Tensor) -> Any:
        if output.data_ptr() != input_.data_ptr():
            output.copy_(input_)
        return Done()

    def all_to_all(self, output: Tensor, input_: Tensor) -> Any:
        if output.data_ptr() != input_.data_ptr():
            output.copy_(input_)
        return Done()

    def broadcast(self, tensor: Tensor, src: int) -> None:
        return None

    def all_gather_tensor(self, output: Tensor, input_: Tensor) -> None:
        output.copy_(input_)

    def gather(self, tensor: Tensor, out: Tensor | None, dst: int) -> None:
        if out is not None:
            out.copy_(tensor)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, src: int) -> Any:
        return obj

    def new_group(self, backend: str, timeout: timedelta | None) -> dist.ProcessGroup | None:
        return self.group


class Native(Backend):
    """torch's own collectives over the group."""

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def global_rank(self) -> int:
        return dist.get_rank()

    @property
    def watched(self) -> bool:  # type: ignore[override]
        return self.device.type == "cuda"  # NCCL (and any backend on CUDA tensors): wait() is a stream wait

    def timeout_s(self) -> float | None:
        group = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
        try:
            return float(group._get_backend(self.device).options._timeout.total_seconds())
        except (AttributeError, RuntimeError):  # a backend without options
            return None

    def abort(self) -> None:
        group = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
        group.abort()

    def global_ranks(self) -> list[int]:
        return [self._global(r) for r in range(self.world_size)]

    def group_name(self) -> str:
        group = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
        return str(getattr(group, "group_name", ""))

    def reduce_scatter(self, output: Tensor, input_: Tensor) -> Any:
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return fn(output, input_, group=self.group, async_op=True)

    def all_reduce(self, tensor: Tensor, op: str) -> Any:
        return dist.all_reduce(tensor, op=_OPS[op], group=self.group, async_op=True)

    def all_gather(self, output: Tensor, input_: Tensor) -> Any:
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return fn(output, input_, group=self.group, async_op=True)

    def all_to_all(self, output: Tensor, input_: Tensor) -> Any:
        return dist.all_to_all_single(output, input_, group=self.group, async_op=True)

    def broadcast(self, tensor: Tensor, src: int) -> None:
        dist.broadcast(tensor, src=self._global(src), group=self.group)

    def all_gather_tensor(self, output: Tensor, input_: Tensor) -> None:
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        fn(output, input_, group=self.group)

    def gather(self, tensor: Tensor, out: Tensor | None, dst: int) -> None:
        chunks = list(out.chunk(self.world_size)) if out is not None else None
        dist.gather(tensor, chunks, dst=self._global(dst), group=self.group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(src), group=self.group)
        return box[0]

    def gather_object(self, obj: Any, dst: int) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=self._global(dst), group=self.group)
        return out

    def new_group(self, backend: str, timeout: timedelta | None) -> dist.ProcessGroup | None:
        ranks = [self._global(r) for r in range(self.world_size)]
        return dist.new_group(ranks=ranks, backend=backend, timeout=timeout)


class GlooSplit(Native):
    """gloo: reduce-scatter as one reduce per destination rank, all-gather as one broadcast per source."""

    def reduce_scatter(self, output: Tensor, input_: Tensor) -> Any:
        chunks = input_.chunk(self.world_size)
        works = [
            dist.reduce(chunk, dst=self._global(r), group=self.group, async_op=True)
            for r, chunk in enumerate(chunks)
        ]
        mine = chunks[self.rank]
        return _Split(works, None if mine.data_ptr() == output.data_ptr() else lambda: output.copy_(mine))

    def all_gather(self, output: Tensor, input_: Tensor) -> Any:
        chunks = output.chunk(self.world_size)
        if chunks[self.rank].data_ptr() != input_.data_ptr():
            chunks[self.rank].copy_(input_)
        works = [
            dist.broadcast(chunk, src=self._global(r), group=self.group, async_op=True)
            for r, chunk in enumerate(chunks)
        ]
        return _Split(works)


_BY_NAME: dict[str, type[Native]] = {"gloo": GlooSplit}
"""Process-group backends whose collectives run our way; any other runs torch's own (:class:`Native`)."""


def backend_for(group: dist.ProcessGroup | None) -> Backend:
    """The one place that decides how collectives run on ``group`` (``None``: the default group, or
    no process group at all)."""
    if not (dist.is_available() and dist.is_initialized()):
        return SingleProcess(group, 0, 1, torch.device("cpu"))
    rank, world_size, name = dist.get_rank(group), dist.get_world_size(group), dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if name == "nccl" else torch.device("cpu")
    if world_size == 1:
        return SingleProcess(group, rank, world_size, device, name)
    return _BY_NAME.get(name, Native)(group, rank, world_size, device, name)


FLIGHT_RECORDER = {
    "nccl": (
        "torch's flight recorder keeps every rank's NCCL collectives: set TORCH_NCCL_DUMP_ON_TIMEOUT=1 "
        "(and TORCH_NCCL_TRACE_BUFFER_SIZE=2000, torch's default) before the process group is made, and "
        "each rank writes it on a timeout to TORCH_FR_DUMP_TEMP_FILE<rank> (default "
        "/tmp/nccl_trace_rank_<rank>); torchfrtrace DIR names the ranks that did not join"
    )
}
"""What a failure message adds, by process-group backend: where that backend records collectives itself
(torch 2.13: ``torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp`` and ``FlightRecorder.hpp``; gloo has
no such record)."""


def failure_hint(name: str) -> str:
    """What a collective's failure message adds on a process group of backend ``name`` (``"nccl"``:
    where torch's flight recorder dumps every rank's record); ``""`` for the others."""
    return FLIGHT_RECORDER.get(name, "")


def before_any_group() -> None:
    """Import ``torch.distributed.nn`` while no process group exists: its functions' default argument
    ``group=group.WORLD`` is evaluated at its import and would hold the world group past
    ``destroy_process_group()`` (:mod:`lightning_zero.integrations.autoregister` runs this right after
    torch's import)."""
    if dist.is_available() and not dist.is_initialized():
        importlib.import_module("torch.distributed.nn")


def end_process_group() -> None:
    """Destroy the default process group (and every group made from it), if there is one. A gloo group
    left to the interpreter's exit-time destructors can abort the process ("terminate called without
    an active exception") after its work is done."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


before_any_group()  # torch imported from here (lightning_zero.comm before torch): autoregister left it to us
