"""Gradient hooks -> one collective per bucket -> this rank's shard of the averaged gradient.

Per step (one optimizer step, possibly several micro-batches):

  1. ``no_sync`` micro-batches: autograd accumulates into ``param.grad`` as usual; nothing is
     sent. Hooks only note which parameters got a gradient.
  2. The last micro-batch: as each parameter's gradient is accumulated (a
     ``post_accumulate_grad`` hook), it is divided by ``world_size`` into the bucket's wire buffer
     and ``param.grad`` is released. When every parameter of a bucket has arrived, and every
     earlier bucket has been launched, the bucket's collective starts asynchronously while
     backward goes on. Launching strictly in bucket order keeps the collective sequence identical
     on every rank even when ranks see different unused parameters.
  3. :meth:`GradReducer.finalize` (before clipping and the optimizer step) launches what is left,
     with zeros for parameters that got no gradient, and waits.

The stage 1 / stage 2 difference lives only in :meth:`GradReducer._launch` / ``_collect``:
stage 1 all-reduces the bucket and keeps the owned slice; stage 2 reduce-scatters it. Either way
the optimizer sees only ``grad_shards[b]``: ``(padded_numel // world_size,)`` in the master dtype.

Wire buffers live only from a bucket's first gradient until its collective completes (finished
buckets are collected as later ones launch, and at most ``_MAX_IN_FLIGHT`` wait at once), so
stage 2 holds ``1/N`` of the gradients plus the buckets being filled or in flight.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from lightning_zero.buckets import BucketPlan
from lightning_zero.comm import Comm
from lightning_zero.config import ZeroConfig
from lightning_zero.flat import FlatParams, dtype_from_str
from lightning_zero.partition import shard_range

_MAX_IN_FLIGHT = 2
"""Buckets whose collective may be pending at once (bounds stage 2's transient gradient memory)."""


def _is_completed(handle: object) -> bool:
    done = getattr(handle, "is_completed", None)
    return bool(done()) if done is not None else True


def master_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """Optimizer arithmetic dtype: fp32 for 16-bit parameters, the parameter dtype otherwise."""
    return torch.float32 if param_dtype.itemsize < 4 else param_dtype


class GradReducer:
    """Owns the gradient hooks and the per-bucket collectives for one set of parameters."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        plan: BucketPlan,
        flat: FlatParams,
        comm: Comm,
        config: ZeroConfig,
    ) -> None:
        self.params = list(params)
        self.plan = plan
        self.flat = flat
        self.comm = comm
        self.config = config
        self._where = plan.locate()
        n_buckets = len(plan.buckets)
        self.grad_shards: list[Tensor] = [
            torch.zeros(plan.shard_numel(b), dtype=master_dtype(dtype_from_str(b.dtype)), device=flat.device)
            for b in plan.buckets
        ]
        self._sync = True
        # at world size 1 the local mask is the global one: torch's exact semantics for free
        self._skip_unused = config.find_unused_parameters or comm.world_size == 1
        self._used = [False] * len(self.params)  # got a gradient on this rank in this step
        self._used_global: Tensor | None = None
        self._filled = [False] * len(self.params)
        self._pending = [len(b.slots) for b in plan.buckets]
        self._wire: list[Tensor | None] = [None] * n_buckets
        self._outputs: list[Tensor | None] = [None] * n_buckets
        self._handles: list[object | None] = [None] * n_buckets
        self._next_launch = 0
        self._finalized = False
        self._warned_unused = False
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)
        ]

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally and communicate nothing."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _make_hook(self, index: int):  # noqa: ANN202 - a closure over the parameter index
        def hook(param: torch.nn.Parameter) -> None:
            self._used[index] = True
            if self._sync and param.grad is not None:
                self._take_grad(index, param)
                self._launch_ready()

        return hook

    def _take_grad(self, index: int, param: torch.nn.Parameter) -> None:
        """Move ``param.grad`` (divided by world size) into its bucket's wire buffer."""
        bucket_index, slot = self._where[index]
        if bucket_index < self._next_launch:  # buckets launch in order: this one is already on the wire
            name = self.plan.params[index].name
            raise RuntimeError(
                f"parameter {name!r} received a gradient after its bucket was communicated in this step "
                "(a second backward without an optimizer step in between?); "
                "use no_sync() for all but the last"
            )
        wire = self._wire_buffer(bucket_index)
        view = wire[slot.bucket_offset : slot.bucket_offset + slot.numel]
        assert param.grad is not None  # callers check
        grad = param.grad.detach().reshape(-1)
        if self._filled[index]:
            view.add_(grad / self.comm.world_size)
        else:
            torch.div(grad, self.comm.world_size, out=view)
            self._filled[index] = True
            self._pending[bucket_index] -= 1
        param.grad = None

    def _wire_buffer(self, bucket_index: int) -> Tensor:
        wire = self._wire[bucket_index]
        if wire is None:
            bucket = self.plan.buckets[bucket_index]
            dtype = self.config.wire_dtype(dtype_from_str(bucket.dtype))
            wire = torch.empty(bucket.padded_numel, dtype=dtype, device=self.flat.device)
            wire[bucket.numel :].zero_()
            self._wire[bucket_index] = wire
        return wire

    def _launch_ready(self) -> None:
        if not self.config.overlap_comm:
            return
        while self._next_launch < len(self.plan.buckets) and self._pending[self._next_launch] == 0:
            self._launch(self._next_launch)

    def _launch(self, bucket_index: int) -> None:
        wire = self._wire_buffer(bucket_index)
        if self.config.stage == 1:
            self._handles[bucket_index] = self.comm.all_reduce(wire)
        else:
            shard = self.grad_shards[bucket_index]
            out = (
                shard
                if shard.dtype == wire.dtype
                else torch.empty(shard.numel(), dtype=wire.dtype, device=wire.device)
            )
            self._outputs[bucket_index] = out
            self._handles[bucket_index] = self.comm.reduce_scatter(out, wire)
        self._next_launch = bucket_index + 1
        self._collect_finished(bucket_index)

    def _collect_finished(self, newest: int) -> None:
        """Free wire buffers of finished buckets; keep at most ``_MAX_IN_FLIGHT`` buckets in flight."""
        in_flight = [b for b in range(newest) if self._handles[b] is not None]
        excess = len(in_flight) - _MAX_IN_FLIGHT
        for b in in_flight:  # oldest first
            if excess > 0 or _is_completed(self._handles[b]):
                self._collect(b)
                excess -= 1

    def _fill_missing(self, bucket_index: int) -> None:
        """Zeros (or an accumulated leftover ``.grad``) for parameters whose hook did not fire."""
        wire = self._wire_buffer(bucket_index)
        for slot in self.plan.buckets[bucket_index].slots:
            if self._filled[slot.param_index]:
                continue
            param = self.params[slot.param_index]
            if param.grad is not None:
                self._take_grad(slot.param_index, param)
                continue
            wire[slot.bucket_offset : slot.bucket_offset + slot.numel].zero_()
            self._filled[slot.param_index] = True
            self._pending[bucket_index] -= 1
            if not self._skip_unused and not self._warned_unused:
                self._warned_unused = True
                warnings.warn(
                    f"parameter {self.plan.params[slot.param_index].name!r} got no gradient on rank "
                    f"{self.comm.rank} in this step; it counts as a zero gradient. Pass "
                    "find_unused_parameters=True to skip parameters no rank used, as torch.optim does.",
                    stacklevel=2,
                )

    def finalize(self) -> Tensor | None:
        """Finish this step's communication; ``grad_shards`` are then valid. Idempotent.

        Must be called on all ranks. Returns a ``(num_params,)`` mask of parameters some rank
        used when ``find_unused_parameters`` is on (or at world size 1), else ``None``.
        """
        if self._finalized:
            return self._used_global
        for bucket_index in range(self._next_launch, len(self.plan.buckets)):
            self._fill_missing(bucket_index)
            self._launch(bucket_index)
        used_handle = None  # launched after every bucket: the same collective order on every rank
        if self._skip_unused:
            self._used_global = torch.tensor(self._used, dtype=torch.int32, device=self.comm.device)
            used_handle = self.comm.all_reduce(
                self._used_global, op=torch.distributed.ReduceOp.MAX, control=True
            )
        for bucket_index in range(len(self.plan.buckets)):
            if self._handles[bucket_index] is not None:
                self._collect(bucket_index)
        if used_handle is not None:
            self.comm.wait(used_handle)
        self._finalized = True
        return self._used_global

    def _collect(self, bucket_index: int) -> None:
        handle, wire = self._handles[bucket_index], self._wire[bucket_index]
        assert handle is not None and wire is not None
        self.comm.wait(handle)
        shard = self.grad_shards[bucket_index]
        if self.config.stage == 1:
            start, end = shard_range(wire.numel(), self.comm.world_size, self.comm.rank)
            shard.copy_(wire[start:end])
        else:
            out = self._outputs[bucket_index]
            assert out is not None
            if out is not shard:
                shard.copy_(out)
        self._handles[bucket_index] = self._wire[bucket_index] = self._outputs[bucket_index] = None

    def reset(self) -> None:
        """Start a new step: drop gradients and per-step state (waits for anything in flight)."""
        for bucket_index, handle in enumerate(self._handles):
            if handle is not None:
                self.comm.wait(handle)
            self._handles[bucket_index] = self._wire[bucket_index] = self._outputs[bucket_index] = None
        for param in self.params:
            param.grad = None
        self._used = [False] * len(self.params)
        self._used_global = None
        self._filled = [False] * len(self.params)
        self._pending = [len(b.slots) for b in self.plan.buckets]
        self._next_launch = 0
        self._finalized = False

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
