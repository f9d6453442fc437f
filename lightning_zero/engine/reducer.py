"""Gradient hooks -> one collective per bucket -> this rank's shard of the averaged gradient.

Per optimizer step (one or more backward passes):

  1. Every gradient, as autograd accumulates it (a ``post_accumulate_grad`` hook), is added into
     its bucket's *accumulation buffer* (the master dtype: fp32 for 16-bit parameters, so
     micro-batches of a ``bf16-true`` model accumulate in fp32, not in a bf16 ``param.grad``) and
     ``param.grad`` is released. A parameter alone in an unpadded bucket of its master dtype (an
     fp32 embedding or output layer, typically larger than the bucket cap) skips the copy: the
     gradient autograd created becomes the buffer (*adopted*; never a ``.grad`` the user
     assigned). Inside ``no_sync`` nothing more happens: nothing is sent (with
     ``sharded_accumulation`` a backward inside ``no_sync`` is a round as in 2 and 3, whose results
     are summed into ``grad_shards``; under hybrid sharding its all-reduce across the replicas is
     left out, and the step's last round all-reduces the accumulated shard instead of its own part).
  2. Outside ``no_sync`` a backward pass is a *round*: when every parameter of a bucket has
     arrived, and every earlier bucket has been launched, the bucket is divided by the world size,
     cast to the wire dtype and its collective starts asynchronously while backward goes on.
     Launching strictly in bucket order keeps the collective sequence identical on every rank even
     when ranks see different unused parameters. At stage 3 the gradient hooks launch nothing: the
     units' backward gathers are collectives too, and a bucket waiting for a gradient that one rank
     gets and another does not would put its launch before a gather on one rank and after it on the
     other. Instead a unit's buckets launch, in bucket order and with zeros for the parameters that
     got no gradient, when its backward is done (:meth:`GradReducer.launch_units`, called by the unit
     hooks before the next unit's backward gather: :mod:`lightning_zero.engine.unit_gather`), so
     where each launch goes depends on which units ran, not on which gradients arrived.
  3. At the end of the round's backward (a callback queued on the autograd engine, as torch DDP's
     reducer does) the remaining buckets are launched, with zeros for parameters that got no
     gradient, and every collective is waited for. The result is copied into ``grad_shards`` (the
     first round of a step) or added to it (later rounds: several backward passes before one
     optimizer step, e.g. accumulation by hand in manual optimization, sum as in torch DDP).
     :meth:`GradReducer.finalize` (clipping, the optimizer step) closes a round that is still open.

What happens between a bucket's accumulation buffer and its shard (averaging, the cast to the wire
dtype, the collective, the accumulation back) is the bucket's wire codec
(:mod:`lightning_zero.engine.codecs`), which is also the only place where stage 1 (all-reduce the
bucket, keep the owned slice) and stage 2 (reduce-scatter it) differ. Either way the optimizer sees
only ``grad_shards[b]``: ``(padded_numel // world_size,)`` in the master dtype.

Hybrid sharding (:class:`~lightning_zero.comm.CommGroups` with replicas): the bucket is divided by
all ``N`` ranks and reduced inside the shard group as above; then this rank's part is all-reduced
(summed) across the replicas, asynchronously while backward goes on, and folded into the shard when
that has finished too. **Collective order** (``docs/architecture.md``): where each collective is
issued is a function of the program, never of timing, so that every rank issues the same sequence per
group and interleaved across groups, as NCCL requires. A bucket's all-reduce across the replicas is
issued right after the next bucket's collective inside the group is launched (the last bucket's at
the end of the round, after every launch, before the used-parameter mask), never when a completion
check happens to see its reduction done; collecting a bucket (waiting, folding into the shard) issues
no collective, so buckets are collected whenever they are done. On CUDA the all-reduce waits for the
reduction on a side stream (:meth:`~lightning_zero.comm.Comm.after`), not on the compute stream.

``skip_nonfinite_steps``: each bucket is shown to the :class:`NonFiniteGuard` as it is sent (and
collected); the guard's flags ride on the used-parameter mask, then launched after the collects.

Memory: a bucket's accumulation buffer is a slot of a small pool (:class:`WirePool`: three
buffers as long as the longest bucket within the cap, plus one as long as the longest bucket above
it, allocated once) from the bucket's first gradient of the step until its collective is collected;
a launched bucket is collected as soon as its collective has finished (checked when later buckets
launch), at most ``MAX_IN_FLIGHT`` launched buckets wait uncollected, and a bucket that needs a
slot when none of its size is free waits for the oldest ones in flight. So stage 2 holds ``1/N`` of
the gradients plus at most three buckets and the largest one, and allocates nothing per step. At
stage 3 one unit's buckets fill while the unit before it is in flight (twice the most buckets of
one unit, allocated as they fill and freed when collected: FSDP2's per-unit reduce-scatter).
Across the micro-batches of ``no_sync`` all buckets hold data (like ``param.grad`` under DDP):
those beyond the pool get buffers of their own for the accumulation window.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from lightning_zero.comm.communicator import Comm
from lightning_zero.comm.groups import CommGroups
from lightning_zero.comm.host_clock import timed
from lightning_zero.config import ZeroConfig
from lightning_zero.engine.backward_end import EndOfBackward
from lightning_zero.engine.bucket_group import BucketGroup, RoundState
from lightning_zero.engine.nonfinite import NonFiniteGuard
from lightning_zero.engine.tensor_parallel import TensorParallel
from lightning_zero.engine.used_params import UsedParams
from lightning_zero.layout.buckets import BucketPlan
from lightning_zero.layout.flat import FlatParams


class GradReducer:
    """Owns the gradient hooks and the per-bucket collectives for one set of parameters."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        plan: BucketPlan,
        flat: FlatParams,
        comm: Comm | CommGroups,
        config: ZeroConfig,
        guard: NonFiniteGuard | None = None,
        tensor: TensorParallel | None = None,
    ) -> None:
        self.params = list(params)
        self.tensor = tensor
        """Tensor parallelism's group (``DTensor`` parameters), else ``None``."""
        self.plan = plan
        self.flat = flat
        groups = CommGroups.of(comm)
        self.comm = groups.shard
        self.replicas = groups.replicas
        self.world = groups.world
        self.config = config
        self._guard = guard if guard is not None and guard.enabled else None
        inspect = (None, None) if self._guard is None else (self._guard.inspect, self._guard.inspect_reduced)
        self._where = plan.locate()
        self.round = RoundState()
        self.group = BucketGroup(
            self.params, plan, config, (self.comm, self.replicas), flat.device, self.round, inspect, tensor
        )
        self.grad_shards: list[Tensor] = self.group.grad_shards
        """``grad_shards[b]``: ``(padded_numel // world_size,)``, master dtype; valid after
        :meth:`finalize`."""
        self.pool = self.group.pool
        self._sharded_accumulation = config.accumulates_sharded
        self._synced_in_step = False  # a round outside no_sync finished in this step
        # the same semantics on 1 and N ranks: without find_unused_parameters a parameter that got no
        # gradient counts as a zero gradient (with a one-time warning), also at world size 1
        self._skip_unused = config.find_unused_parameters
        self._used = UsedParams(len(self.params), self.world, self._skip_unused, self._guard)
        self._has_data = [False] * len(self.params)  # accumulated in this round's buffers
        self._arrived = [False] * len(self.params)  # arrived in this round's backward
        self._by_unit = config.stage == 3  # buckets launch when their unit's backward is done, not from hooks
        self._round_open = False
        self._inputs_only = False  # inside inputs_only(): a backward that computes no parameter gradient
        self._end = EndOfBackward(self._end_of_backward, abandoned=self._after_raised_backward)
        self._warned_unused = False
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)
        ]
        self._hooks.extend(self.group.hooks)

    @property
    def adopted(self) -> int:
        """Gradients that became their bucket's accumulation buffer so far."""
        return self.group.adopted

    @property
    def allocations_outside_pool(self) -> int:
        """Accumulation buffers allocated because every pool slot was busy (e.g. ``no_sync``)."""
        return self.group.allocations_outside_pool

    @property
    def peak_accumulating_bytes(self) -> int:
        """The most bytes of accumulation buffers holding gradients at once."""
        return self.group.peak_accumulating_bytes

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally and communicate nothing."""
        previous, self.round.syncing = self.round.syncing, False
        try:
            yield
        finally:
            self.round.syncing = previous

    @property
    def syncing(self) -> bool:
        """False inside :meth:`no_sync`."""
        return self.round.syncing

    @contextmanager
    def inputs_only(self) -> Iterator[None]:
        """A backward inside computes input gradients only (``torch.autograd.grad(..., inputs=...)``:
        torch's shape inference of a pipeline stage), so no parameter gets a gradient: stage 3's unit
        hooks, which still fire in it, launch no bucket and open no round (else a round of zeros, with
        a warning that each parameter got none)."""
        previous, self._inputs_only = self._inputs_only, True
        try:
            yield
        finally:
            self._inputs_only = previous

    @property
    def idle(self) -> bool:
        """Nothing accumulated or in flight since the last :meth:`reset` (an optimizer-step boundary)."""
        return not self._round_open and self.round.rounds == 0

    def _make_hook(self, index: int):  # noqa: ANN202 - a closure over the parameter index
        # weakly: a hook the parameter holds must not keep the reducer (and its buffers) alive once the
        # optimizer is gone (the parameter's hooks are invisible to the garbage collector)
        owner = weakref.ref(self)

        @timed
        def hook(param: torch.nn.Parameter) -> None:
            reducer = owner()
            if reducer is not None and param.grad is not None:
                reducer._on_gradient(index, param)

        return hook

    def _on_gradient(self, index: int, param: torch.nn.Parameter) -> None:
        """A parameter's gradient has been accumulated (its hook)."""
        self._used.local[index] = True
        self._take_grad(index, param)
        if self.round.syncing or self._sharded_accumulation:
            self._arrive(index)
            self._end.queue()
            if not self._by_unit:
                self.group.start_ready()

    def launch_units(self, units: Sequence[int]) -> None:
        """Stage 3: a backward is running and the backward of ``units`` is done (called by the unit
        hooks at each unit's backward, before its gather; ``units`` may be empty): launch their buckets
        not yet launched in this round, in bucket order, with zeros for parameters that got no
        gradient. Which buckets launch where is so a function of which units ran, never of which
        parameters received a gradient (the collective order). The rest launches at the end of the
        backward."""
        if self._inputs_only or not (self.round.syncing or self._sharded_accumulation):
            return  # inside no_sync without sharded accumulation nothing is sent
        self._end.queue()
        self._round_open = True
        if not self.config.overlap_comm or not units:
            return
        for bucket_index, state in enumerate(self.group.states):
            if state.bucket.unit in units and not state.launched:
                self._fill_missing(bucket_index)
                self.group.start_grad_sync(bucket_index)

    def _take_grad(self, index: int, param: torch.nn.Parameter) -> None:
        """Add ``param.grad`` into its bucket's accumulation buffer and release it."""
        if self.group.launched(self._where[index][0]):  # already on the wire: this gradient opens a new round
            self._finish_round()
        assert param.grad is not None  # callers check
        grad = param.grad if self.tensor is None else self.tensor.local_grad(index, param, param.grad)
        self.group.accumulate(index, grad, first=not self._has_data[index])
        self._has_data[index] = True
        self._round_open = True
        param.grad = None

    def _arrive(self, index: int) -> None:
        if not self._arrived[index]:
            self._arrived[index] = True
            self.group.arrive(index)

    def _fill_missing(self, bucket_index: int) -> None:
        """Zeros for parameters that have no gradient in this round's buffers."""
        bucket = self.group.states[bucket_index].bucket
        accum = self.group.buffer(bucket_index)
        for slot in bucket.slots:
            if self._has_data[slot.param_index]:
                continue
            accum[slot.bucket_offset : slot.bucket_offset + slot.numel].zero_()
            self._has_data[slot.param_index] = True
            if not self._skip_unused and not self._warned_unused and not self._used.local[slot.param_index]:
                self._warned_unused = True
                warnings.warn(
                    f"parameter {self.plan.params[slot.param_index].name!r} got no gradient on rank "
                    f"{self.world.rank} in this step; it counts as a zero gradient. Pass "
                    "find_unused_parameters=True to skip parameters no rank used, as torch.optim does.",
                    stacklevel=3,
                )

    def _end_of_backward(self) -> None:
        if self._round_open:
            self._finish_round()

    def _after_raised_backward(self) -> None:
        """The next backward after one that raised with a round open (its end never ran): its partial
        gradients, and collectives some ranks may have run, are no state to go on from.

        Raises:
            RuntimeError: until :meth:`reset` (``optimizer.zero_grad()``) drops them.
        """
        if self._round_open:
            raise RuntimeError(
                "the last backward raised after gradients reached the sharded optimizer's buckets (its "
                "round of collectives was left part-way): call optimizer.zero_grad() before the next "
                "backward, to drop that batch's partial gradients (a loop that catches the error and "
                "skips the batch; torch DDP cannot go on after such a backward at all)"
            )

    def _finish_round(self) -> None:
        """Launch what is left of this round, wait for all of it, fold it into ``grad_shards``."""
        for bucket_index, state in enumerate(self.group.states):
            if not state.launched:
                self._fill_missing(bucket_index)
                self.group.start_grad_sync(bucket_index)
        self.group.start_across()
        if not self.round.syncing:  # sharded accumulation in no_sync: the step's last round agrees on it
            self.group.finish_grad_sync()
            self.round.awaiting_sync = True
            self._end_round()
            return
        # the mask after every bucket's launch: the same collective order everywhere
        self._used.agree(self.group.finish_grad_sync, with_guard=False)
        self.round.awaiting_sync = False
        self._synced_in_step = True
        self._end_round()

    def _end_round(self) -> None:
        self.round.rounds += 1
        self._round_open = False
        self._has_data = [False] * len(self.params)
        self._arrived = [False] * len(self.params)
        self.group.end_round()

    def finalize(self) -> list[bool] | None:
        """Finish this step's communication; ``grad_shards`` are then valid. Idempotent.

        Must be called on all ranks (that ran a backward pass since the last :meth:`reset`; a rank
        that ran none communicates nothing, as under torch DDP, whose collectives run in backward,
        so every rank must run backward or none). Returns a list, one bool per parameter: whether some
        rank used it, when ``find_unused_parameters`` is on; else ``None``.
        """
        if self.idle:  # no backward since the last step: torch's step with every .grad None
            for shard in self.grad_shards:
                shard.zero_()
        elif self._round_open:
            self._finish_round()
        if self.round.awaiting_sync:  # the step's last backward ran inside no_sync: close the window here
            self._close_window()
        return self._used.agreed

    def _close_window(self) -> None:
        """Sharded accumulation whose last round ran inside ``no_sync``: all-reduce the accumulated
        shards across the replicas and agree on the used parameters, as a syncing round would.

        Raises:
            RuntimeError: under node-aware sharding, when an earlier backward of the step ran outside
                ``no_sync`` (its part is already summed across the replicas: summing the shard again
                would count it once per replica group).
        """
        if self.replicas.world_size > 1 and self._synced_in_step:
            raise RuntimeError(
                "sharded_accumulation under node-aware sharding: the step's last backward ran inside "
                "no_sync after one outside it; run the step's last backward outside no_sync (as "
                "Lightning's accumulate_grad_batches does), or every backward outside it"
            )
        handles = (
            [
                self.replicas.all_reduce(shard, what="gradient all-reduce across replicas")
                for shard in self.grad_shards
            ]
            if self.replicas.world_size > 1
            else []
        )
        for handle in handles:
            self.replicas.wait(handle)
        self._used.agree(lambda: None, with_guard=True)
        self.round.awaiting_sync = False

    def reset(self) -> None:
        """Start a new step: drop gradients and per-step state (waits for anything in flight)."""
        self.group.reset()
        for param in self.params:
            param.grad = None
        self._used.reset()
        self._has_data = [False] * len(self.params)
        self._arrived = [False] * len(self.params)
        self.round.rounds = 0
        self.round.awaiting_sync = False
        self._round_open = False
        self._end.forget()
        self._synced_in_step = False
        if self._guard is not None:
            self._guard.reset()

    def forget_sent(self) -> None:
        """A skipped step: codecs that carry something from one send to the next (error feedback's
        residuals) drop it."""
        self.group.forget_sent()

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
