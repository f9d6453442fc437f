""":class:`ControlCollectives`: the blocking, small collectives of :class:`~lightning_zero.comm.Comm`.

Start-up broadcasts of tensors, short lists of numbers, Python objects, a barrier and agreement
checks: control traffic (counted apart from gradient and parameter traffic), issued on every rank and
waited for at once. A mixin of :class:`~lightning_zero.comm.communicator.Comm`, whose running,
recording and counting of a collective they use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_zero.comm.backends import Backend
from lightning_zero.comm.handles import CommStats


class ControlCollectives:
    """The blocking control collectives of a :class:`~lightning_zero.comm.communicator.Comm`."""

    if TYPE_CHECKING:  # what Comm provides
        backend: Backend
        rank: int
        world_size: int
        stats: CommStats

        @property
        def device(self) -> torch.device: ...
        def _ring(self, numel: int) -> int: ...
        def _record(self, op: str, numel: int, dtype: torch.dtype | None = None, what: str = "") -> None: ...
        def _run(self, what: str, fn: Any, *args: Any, blocking: bool = True) -> Any: ...
        def wait(self, handle: Any) -> None: ...
        def all_reduce(
            self, tensor: Tensor, op: str = "sum", control: bool = False, what: str = "all-reduce"
        ) -> Any: ...

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
        return self._all_gather_numbers(values, torch.int64, "integers")

    def all_gather_floats(self, values: list[float]) -> list[list[float]]:
        """Gather a short list of floats from every rank (a blocking control collective, float64)."""
        return self._all_gather_numbers(values, torch.float64, "floats")

    def _all_gather_numbers(self, values: list[Any], dtype: torch.dtype, kind: str) -> list[list[Any]]:
        if self.world_size == 1:
            return [values]
        local = torch.tensor(values, dtype=dtype, device=self.device)
        out = torch.empty(self.world_size * len(values), dtype=dtype, device=self.device)
        self.stats.count(self._ring(out.numel()), out.dtype, True, "all_gather")
        self._record("all_gather", out.numel(), out.dtype, f"all-gather of {kind}")
        self._run(f"all-gather of {kind}", self.backend.all_gather_tensor, out, local)
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
