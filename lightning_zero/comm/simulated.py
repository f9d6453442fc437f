"""A simulated world: this process is rank ``r`` of ``N``, and no other rank exists (nothing uses it
unless asked: :meth:`CommGroups.simulated`, ``ShardedAdamW(groups=...)``; ``benchmarks/scale.py``
measures with it what grows with ``N``).

Every collective completes at once with what ``N`` ranks would deliver **if every rank sent what this
rank sends** (the data-parallel case of identical replicas on identical batches):

  * ``reduce_scatter``: this rank's chunk of the input, times ``N`` (the sum of ``N`` equal parts);
  * ``all_reduce``: ``"sum"`` multiplies by ``N``, ``"max"`` leaves the tensor as it is;
  * ``all_gather``: this rank's input in every chunk of the output;
  * ``all_to_all``: the chunk this rank sends to itself, from every sender;
  * ``broadcast``/``broadcast_object``: this rank's value stands for the source's;
  * ``all_gather_object``/``gather``/``gather_object``: ``N`` copies of this rank's value, or, with a
    ``peer`` function, ``peer(value, k)`` for each rank ``k != r``: what rank ``k`` would send, made
    from this rank's (e.g. a checkpoint's file list naming rank ``k``'s shard file).

So the real engine, optimizer and checkpoint code run as rank ``r`` of ``N`` in one process: shapes,
padding, plans, the number and kind of collectives, the elements and bytes counted (the
:class:`~lightning_zero.comm.Comm` counters use ``N``), and the host time spent in our code around
them are those of rank ``r`` in a real world of ``N``. This rank's own shard is computed exactly as
it would be (every rank's mean gradient is its own); what the gathers put in the other ranks' chunks
is this rank's shard again: right in shape, not in value.

What it cannot show: bandwidth and latency (a collective here is a local copy or a multiplication),
stragglers and their waits, the differences between ranks (different batches, a failing rank),
anything a peer computes, and a second process group (``new_group`` is refused).

Order check: given a list (``log``), every collective this rank issues on any of its simulated groups
is appended to it as an :class:`~lightning_zero.comm.recorder.Entry` (role, the group's global
ranks, op, size, dtype), in the order issued; the lists of several simulated ranks compare with
:func:`~lightning_zero.comm.recorder.compare_ranks`, the rule NCCL needs (the collective-order
recorder's, whose log files a simulated rank never writes to).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from lightning_zero.comm.backends import Backend, Done
from lightning_zero.comm.recorder import Entry, ListRecorder, Recorder

Peer = Callable[[Any, int], Any]
"""``peer(obj, k)``: what rank ``k`` would send in an object collective where this rank sends ``obj``."""


class Simulated(Backend):
    """Rank ``rank`` of ``world_size`` simulated ranks in this process (the module docstring)."""

    recorded = False
    """Not sent to the collective-order recorder, which compares the sequences of real processes:
    the simulated ranks are all this one."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device,
        name: str = "simulated",
        global_ranks: Sequence[int] | None = None,
        peer: Peer | None = None,
        log: list[Entry] | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"a simulated rank must be in 0..{world_size - 1} (world_size), got {rank}")
        super().__init__(None, rank, world_size, device)
        self._name = name
        self._global = list(range(world_size)) if global_ranks is None else list(global_ranks)
        self._peer = peer
        self.log = log

    def own_recorder(self, role: str, ordered: bool) -> Recorder | None:
        if self.log is None:
            return None
        return ListRecorder(self.log, self.global_rank(), self._global, role, ordered, self._name)

    def global_rank(self) -> int:
        return self._global[self.rank]

    def global_ranks(self) -> list[int]:
        return list(self._global)

    def group_name(self) -> str:
        return self._name

    def reduce_scatter(self, output: Tensor, input_: Tensor) -> Any:
        output.copy_(input_.view(self.world_size, -1)[self.rank]).mul_(self.world_size)
        return Done()

    def all_reduce(self, tensor: Tensor, op: str) -> Any:
        if op == "sum":
            tensor.mul_(self.world_size)
        elif op != "max":
            raise ValueError(f"all_reduce op must be 'sum' or 'max', got {op!r}")
        return Done()

    def all_gather(self, output: Tensor, input_: Tensor) -> Any:
        self.all_gather_tensor(output, input_)
        return Done()

    def all_to_all(self, output: Tensor, input_: Tensor) -> Any:
        own = input_.view(self.world_size, -1)[self.rank].clone()
        output.view(self.world_size, -1).copy_(own.expand(self.world_size, -1))
        return Done()

    def broadcast(self, tensor: Tensor, src: int) -> None:
        return None

    def all_gather_tensor(self, output: Tensor, input_: Tensor) -> None:
        own = input_.reshape(1, -1).clone()  # the input may be a view of the output's own chunk
        output.view(self.world_size, -1).copy_(own.expand(self.world_size, -1))

    def gather(self, tensor: Tensor, out: Tensor | None, dst: int) -> None:
        if out is not None:
            self.all_gather_tensor(out, tensor)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj if k == self.rank else self._from(obj, k) for k in range(self.world_size)]

    def gather_object(self, obj: Any, dst: int) -> list[Any] | None:
        return self.all_gather_object(obj) if self.rank == dst else None

    def _from(self, obj: Any, rank: int) -> Any:
        return copy.deepcopy(obj) if self._peer is None else self._peer(obj, rank)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        return obj

    def new_group(self, backend: str, timeout: timedelta | None) -> Any:
        raise RuntimeError(
            "a simulated world has no process groups to create (what needs one, e.g. an asynchronous "
            "checkpoint writer's group, cannot run simulated)"
        )
