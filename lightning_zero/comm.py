"""The only place that talks to ``torch.distributed``: collectives, counting and timing.

Every collective goes through :class:`Comm`, which

  * works without a process group at world size 1 (the collectives become local copies), so
    :class:`~lightning_zero.ShardedAdamW` runs in a plain single-process loop;
  * counts the elements each rank *sends* with the ring-algorithm cost the literature uses
    (reduce-scatter and all-gather of ``P`` elements: ``P·(N−1)/N``; all-reduce: ``2·P·(N−1)/N``),
    so the 2Ψ-versus-3Ψ claim is measured, not assumed;
  * times how long the caller blocks in ``wait()``: communication that backward did not hide.

It never chooses a backend: the process group (gloo on CPU, NCCL on CUDA) is whatever the caller,
e.g. Lightning, initialised.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class CommStats:
    """Counters since the last :meth:`reset`."""

    elements_sent: int = 0
    """Elements this rank sent (ring cost model) in parameter and gradient collectives."""
    control_elements_sent: int = 0
    """Elements sent in small control collectives (used-parameter masks, norms, plan checks)."""
    wait_s: float = 0.0
    """Seconds spent blocked waiting for collectives."""
    collectives: int = 0

    def reset(self) -> None:
        self.elements_sent = self.control_elements_sent = self.collectives = 0
        self.wait_s = 0.0


class _Done:
    """Handle of a collective that finished synchronously (world size 1)."""

    def wait(self) -> bool:
        return True


class Comm:
    """Collectives over one process group, with counters. Create it on every rank."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.stats = CommStats()

    def _ring(self, numel: int) -> int:
        return numel * (self.world_size - 1) // self.world_size

    def reduce_scatter(self, output: Tensor, input_: Tensor) -> object:
        """Async sum-reduce-scatter of ``input_`` (``world_size * output.numel()``) into ``output``."""
        self.stats.elements_sent += self._ring(input_.numel())
        self.stats.collectives += 1
        if self.world_size == 1:
            output.copy_(input_)
            return _Done()
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return fn(output, input_, group=self.group, async_op=True)

    def all_reduce(
        self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, control: bool = False
    ) -> object:
        """Async in-place all-reduce. ``control`` counts it apart from gradient traffic."""
        sent = 2 * self._ring(tensor.numel())
        if control:
            self.stats.control_elements_sent += sent
        else:
            self.stats.elements_sent += sent
        self.stats.collectives += 1
        if self.world_size == 1:
            return _Done()
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=True)

    def all_gather(self, output: Tensor, input_: Tensor) -> object:
        """Async all-gather of every rank's ``input_`` into ``output`` (may be in place)."""
        self.stats.elements_sent += self._ring(output.numel())
        self.stats.collectives += 1
        if self.world_size == 1:
            if output.data_ptr() != input_.data_ptr():
                output.copy_(input_)
            return _Done()
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return fn(output, input_, group=self.group, async_op=True)

    def wait(self, handle: object) -> None:
        """Block on ``handle`` and account the time."""
        start = time.perf_counter()
        handle.wait()  # type: ignore[attr-defined]
        self.stats.wait_s += time.perf_counter() - start

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Gather a short list of integers from every rank (a blocking control collective)."""
        local = torch.tensor(values, dtype=torch.int64, device=self.device)
        if self.world_size == 1:
            return [values]
        out = torch.empty(self.world_size * len(values), dtype=torch.int64, device=self.device)
        self.stats.control_elements_sent += self._ring(out.numel())
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        fn(out, local, group=self.group)
        return out.view(self.world_size, len(values)).tolist()

    @property
    def device(self) -> torch.device:
        """Device for control tensors: NCCL only moves CUDA tensors, gloo only CPU ones."""
        if self.distributed and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
