"""A reducer's buckets between the gradient hooks and the gradient shards: one object that owns each
bucket's accumulation buffer, its launch, its collective in flight and its collection.

The paired verbs, as Megatron-Core's bucket groups have them: :meth:`BucketGroup.start_grad_sync`
launches one bucket (its codec encodes the accumulation buffer and starts the collective:
:mod:`lightning_zero.engine.codecs`), :meth:`BucketGroup.finish_grad_sync` waits for every launched
bucket and folds it into ``grad_shards``. In between, :meth:`BucketGroup.accumulate` adds gradients
into the buffers and the group collects finished buckets on its own. When each verb is called (the
hooks, the rounds, stage 3's per-unit launches) is the reducer's business
(:mod:`lightning_zero.engine.reducer`, whose docstring has the collective-order rule kept here).

**Accumulation buffers.** A bucket's local gradients are summed in one ``(padded_numel,)`` buffer of
the master dtype from its first gradient of the step until its collective no longer reads it. The
buffer is, in this order:

  * the gradient itself (*adopted*): a parameter alone in an unpadded bucket of its master dtype
    whose ``.grad`` autograd created into an empty slot (torch stores the incoming gradient then only
    if nothing else references it, so the tensor is ours; a ``.grad`` the user assigned is copied);
  * a slot of the :class:`~lightning_zero.engine.wire_pool.WirePool`, after the oldest bucket in
    flight has been collected if every slot of the size class is busy;
  * a buffer of its own, counted in ``allocations_outside_pool`` (e.g. across ``no_sync``
    micro-batches, where every bucket holds data).

``peak_accumulating_bytes`` is the most bytes held by such buffers at once: the whole model's
gradients under ``no_sync``, a few buckets with sharded accumulation.

**In flight.** At most ``max_in_flight`` launched buckets wait uncollected (``MAX_IN_FLIGHT``; at
stage 3 the most buckets one unit has, since a unit's buckets launch together). Hybrid sharding: a
bucket's all-reduce across the replicas is issued by :meth:`BucketGroup.start_across` at fixed points
of the program only; collecting issues no collective, so which buckets a completion check finds done
changes no rank's collective sequence.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_zero.comm.communicator import Comm
from lightning_zero.comm.host_clock import timed
from lightning_zero.comm.trace import span
from lightning_zero.config import ZeroConfig, master_dtype
from lightning_zero.engine.codecs import InFlight, WireCodec, codec_for
from lightning_zero.engine.tensor_parallel import TensorParallel
from lightning_zero.engine.wire_pool import WirePool, adoptable_params
from lightning_zero.layout.buckets import Bucket, BucketPlan
from lightning_zero.layout.local import is_dtensor

MAX_IN_FLIGHT = 2
"""Launched buckets that may wait uncollected at once (bounds stage 2's transient gradient memory)."""
POOL_SLOTS = MAX_IN_FLIGHT + 1
"""Accumulation buffers of bucket size the pool holds: one bucket filling, the others in flight
(what ``lightning-zero estimate`` counts as transient gradient memory)."""


def _is_completed(sent: InFlight) -> bool:
    done = getattr(sent.handle, "is_completed", None)
    return bool(done()) if done is not None else True


@dataclass
class RoundState:
    """Where the reducer's step is; the reducer writes it, the bucket group reads it."""

    syncing: bool = True
    """Outside ``no_sync``: this round's buckets are all-reduced across the replicas too."""
    rounds: int = 0
    """Rounds already folded into ``grad_shards`` in this step (0: the next result is copied)."""
    awaiting_sync: bool = False
    """A round inside ``no_sync`` was folded into the shards and none after it: the next syncing
    round all-reduces the accumulated shard across the replicas instead of its own part."""


@dataclass
class BucketState:
    """One bucket's per-step communication state (lives and dies together)."""

    bucket: Bucket
    codec: WireCodec
    """How the bucket travels to its shard (cast, collective, accumulation back)."""
    accum: Tensor | None = None
    """``(padded_numel,)`` sum of this step's local gradients, master dtype (padding zero)."""
    sent: InFlight | None = None
    """The launched collective, until it is collected."""
    waiting: int = 0
    """Parameters of the bucket that have not yet arrived in this round."""
    slot: tuple[tuple[torch.dtype, bool], int] | None = None
    """The pool slot ``accum`` lives in, as (size class, index) (``None``: not from the pool)."""
    launched: bool = False
    """Its collective was launched in this round."""


class BucketGroup:
    """Every bucket of one reducer (see the module docstring).

    Args:
        params: the planned parameters (the ones whose gradient may be adopted get a hook here).
        plan: their buckets.
        config: caps, stage, wire dtype, overlap.
        comm, replicas: the shard group's and (hybrid sharding) the replica group's communicators.
        device: where buffers and shards live.
        round: the reducer's :class:`RoundState`.
        inspect, inspect_reduced: the non-finite guard's checks of what is sent and of what arrives.
        tensor: tensor parallelism's group (``DTensor`` parameters): partial gradients are summed over
            it just before each bucket's launch.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        plan: BucketPlan,
        config: ZeroConfig,
        comms: tuple[Comm, Comm],
        device: torch.device,
        round: RoundState,  # noqa: A002 - the reducer's round, shared
        inspect: tuple[Callable[[Tensor], None] | None, Callable[[Tensor], None] | None] = (None, None),
        tensor: TensorParallel | None = None,
    ) -> None:
        self.comm, self.replicas = comms
        self.tensor = tensor
        self.config, self.round, self.device = config, round, device
        self._ranks = self.comm.world_size * self.replicas.world_size  # what a gradient is averaged over
        self._inspect, self._inspect_reduced = inspect
        self._where = plan.locate()
        self.grad_shards: list[Tensor] = [
            torch.zeros(plan.shard_numel(b), dtype=master_dtype(b.dtype), device=device) for b in plan.buckets
        ]
        hierarchical = self.replicas.world_size > 1
        self.states = [
            BucketState(b, codec_for(config, b.dtype, hierarchical), waiting=len(b.slots))
            for b in plan.buckets
        ]
        units = [b.unit for b in plan.buckets]
        most = max(units.count(u) for u in set(units))  # stage 3: one unit's buckets launch together
        self._max_in_flight = max(MAX_IN_FLIGHT, most) if config.stage == 3 else MAX_IN_FLIGHT
        self._launched: list[int] = []
        """The buckets launched in this round, in launch order (bucket order at stages 1 and 2)."""
        self._next_across = 0
        """Position in ``_launched`` of the first bucket whose all-reduce across is not issued."""
        # a DTensor's gradient is not the buffer's layout: it is copied (tensor parallelism)
        self._adoptable = {i for i in adoptable_params(plan) if not is_dtensor(params[i])}
        cap_bytes = max(config.bucket_cap_mb, config.first_bucket_cap_mb) * 2**20
        adopted_buckets = {self._where[i][0] for i in self._adoptable}
        keep = config.stage < 3  # stage 3 frees each buffer when its bucket is collected (wire_pool.py)
        self.pool = WirePool(plan, POOL_SLOTS, cap_bytes, device, adopted_buckets, keep)
        self.allocations_outside_pool = 0
        """Accumulation buffers allocated because every pool slot was busy (e.g. ``no_sync``)."""
        self.adopted = 0
        """Gradients that became their bucket's accumulation buffer (no copy, no slot)."""
        self.peak_accumulating_bytes = 0
        """The most bytes of accumulation buffers holding gradients at once."""
        self._accumulating_bytes = 0
        self._fresh: dict[int, bool] = {}  # adoptable parameter -> its .grad was None as a gradient arrived
        self.hooks: list[Any] = [
            params[i].register_hook(self._make_fresh_check(params, i)) for i in self._adoptable
        ]

    # -- accumulation ------------------------------------------------------------------------------

    def accumulate(self, param_index: int, grad: Tensor, first: bool) -> None:
        """Add parameter ``param_index``'s ``grad`` into its bucket's buffer (``first``: the
        parameter's first gradient of the round, copied, or adopted as the buffer where that is safe)."""
        bucket_index, slot = self._where[param_index]
        state = self.states[bucket_index]
        if first and self._adopt(state, param_index, grad):
            return
        view = self.buffer(bucket_index)[slot.bucket_offset : slot.bucket_offset + slot.numel]
        flat = grad.detach().reshape(-1)
        if first:
            view.copy_(flat)
        else:
            view.add_(flat)

    def buffer(self, bucket_index: int) -> Tensor:
        """The bucket's ``(padded_numel,)`` accumulation buffer, given one if it has none (padding
        zeroed): a pool slot, after collecting the oldest bucket in flight if none is free."""
        state = self.states[bucket_index]
        if state.accum is None:
            bucket = state.bucket
            dtype = master_dtype(bucket.dtype)
            taken = self.pool.take(dtype, bucket.padded_numel)
            while taken is None and self.pool.serves(dtype, bucket.padded_numel) and self._collect_oldest():
                taken = self.pool.take(dtype, bucket.padded_numel)
            if taken is None:  # every slot holds a bucket being filled, or no slot is this long
                state.accum = torch.empty(bucket.padded_numel, dtype=dtype, device=self.device)
                self.allocations_outside_pool += 1
            else:
                key, index, state.accum = taken
                state.slot = (key, index)
            state.accum[bucket.numel :].zero_()
            self._count(state.accum)
        return state.accum

    def _adopt(self, state: BucketState, index: int, grad: Tensor) -> bool:
        if index not in self._adoptable or not self._fresh.pop(index, False) or state.accum is not None:
            return False
        if not grad.is_contiguous() or grad.device != self.device:
            return False
        state.accum = grad.detach().view(-1)
        self.adopted += 1
        self._count(state.accum)
        return True

    def _make_fresh_check(self, params: Sequence[torch.nn.Parameter], index: int):  # noqa: ANN202
        # weakly: a hook the parameter holds must not keep the group alive once the optimizer is gone
        owner, param = weakref.ref(self), weakref.ref(params[index])

        @timed
        def check(grad: Tensor) -> None:
            group, p = owner(), param()
            if group is not None and p is not None:
                group._fresh[index] = p.grad is None

        return check

    def _count(self, accum: Tensor) -> None:
        self._accumulating_bytes += accum.numel() * accum.element_size()
        self.peak_accumulating_bytes = max(self.peak_accumulating_bytes, self._accumulating_bytes)

    def _drop_buffer(self, state: BucketState) -> None:
        """Give the bucket's buffer (and its pool slot) back."""
        if state.accum is not None:
            self._accumulating_bytes -= state.accum.numel() * state.accum.element_size()
        if state.slot is not None:
            self.pool.give(*state.slot)
            state.slot = None
        state.accum = None

    def _release(self, state: BucketState) -> None:
        """The bucket is collected (or dropped): its buffer goes back, nothing of it is in flight."""
        self._drop_buffer(state)
        state.sent = None

    # -- launch --------------------------------------------------------------------------------------

    def arrive(self, param_index: int) -> None:
        """A parameter's gradient arrived in this round (once per parameter per round)."""
        self.states[self._where[param_index][0]].waiting -= 1

    def launched(self, bucket_index: int) -> bool:
        return self.states[bucket_index].launched

    def start_ready(self) -> None:
        """Stages 1 and 2: launch, in bucket order, every bucket whose parameters have all arrived and
        whose predecessors are launched (the launched buckets are a prefix of the plan)."""
        if not self.config.overlap_comm:
            return
        while len(self._launched) < len(self.states) and self.states[len(self._launched)].waiting == 0:
            self.start_grad_sync(len(self._launched))

    def start_grad_sync(self, bucket_index: int) -> None:
        """Launch the bucket's collective (its buffer must hold the round's sum, zeros included), then
        issue the across all-reduces due before it and collect what has finished."""
        state = self.states[bucket_index]
        accum, shard = self.buffer(bucket_index), self.grad_shards[bucket_index]
        first = self.round.rounds == 0
        if self.tensor is not None:
            self.tensor.reduce_partial(state.bucket, accum)
        with (
            span(f"bucket {bucket_index}: launch", self.device),
            self.comm.labelled(f"bucket {bucket_index}"),
        ):
            sent = state.codec.launch(self.comm, accum, shard, first, self._inspect, self._ranks)
        sent.local_only = not self.round.syncing  # sharded accumulation in no_sync: across once, at the end
        if not sent.uses_accum:
            self._release(state)  # the wire copy is all that is needed from here on
        state.sent, state.launched = sent, True
        self._launched.append(bucket_index)
        self.start_across(len(self._launched) - 1)
        self._collect_finished()

    def start_across(self, end: int | None = None) -> None:
        """Hybrid sharding: issue the all-reduce across the replicas of every bucket launched before
        position ``end`` of the launch order (``None``: all) that has none yet, in launch order. Called
        right after a launch (for the buckets before it) and at the end of a round (for all) only:
        fixed points of the program (the reducer's collective order)."""
        end = len(self._launched) if end is None else end
        if self.replicas.world_size == 1 or not self.round.syncing:
            return
        for b in self._launched[self._next_across : end]:  # every bucket before it has its across issued
            state = self.states[b]
            if state.sent is not None and not state.sent.across:
                # after rounds folded inside no_sync: this round's part joins the shard, and the whole
                # accumulated shard is all-reduced across the replicas, once per step
                fold = self.grad_shards[b] if self.round.awaiting_sync else None
                with self.replicas.labelled(f"bucket {b}"):
                    state.codec.start_across(self.comm, state.sent, self.replicas, fold)
        self._next_across = max(self._next_across, end)

    # -- collection ----------------------------------------------------------------------------------

    def finish_grad_sync(self) -> None:
        """Wait for every launched bucket and fold it into ``grad_shards`` (issues no collective)."""
        for bucket_index, state in enumerate(self.states):
            if state.sent is not None:
                self._collect(bucket_index)

    def _collectable(self, state: BucketState) -> bool:
        """Collecting ``state`` issues no collective (hybrid: its all-reduce across is issued)."""
        sent = state.sent
        return sent is not None and (self.replicas.world_size == 1 or sent.across or sent.local_only)

    def _collect_finished(self) -> None:
        """Collect launched buckets that have finished; keep at most ``_max_in_flight`` uncollected
        (the newest included: it is never waited for here)."""
        in_flight = [b for b in self._launched if self.states[b].sent is not None]
        excess = len(in_flight) - self._max_in_flight
        for b in in_flight[:-1]:  # oldest first
            state = self.states[b]
            assert state.sent is not None
            if not self._collectable(state):
                break
            if excess > 0 or _is_completed(state.sent):
                self._collect(b)
                excess -= 1

    def _collect_oldest(self) -> bool:
        """Free the pool slot of the oldest launched bucket (waits for it); False if none holds one.

        A bucket whose all-reduce across the replicas is not issued yet (hybrid: the newest) is not
        collected, which would issue that collective here; its reduction inside the group is waited
        for and its part kept apart, so its slot is free all the same (no allocation outside the pool)."""
        for b in self._launched:
            state = self.states[b]
            if state.sent is None:
                continue
            if self._collectable(state):
                self._collect(b)
                return True
            if state.slot is None or not state.sent.uses_accum:
                return False
            state.codec.keep_part(self.comm, state.sent)  # waits inside the group; no collective
            self._drop_buffer(state)  # still in flight across the replicas; only the buffer goes back
            return True
        return False

    def _collect(self, bucket_index: int) -> None:
        state = self.states[bucket_index]
        assert state.sent is not None
        first = self.round.rounds == 0
        shard = self.grad_shards[bucket_index]
        with span(f"bucket {bucket_index}: collect", self.device):
            state.codec.collect(self.comm, state.sent, shard, first, self._inspect_reduced, self.replicas)
        self._release(state)

    # -- rounds and steps ----------------------------------------------------------------------------

    def end_round(self) -> None:
        """Every bucket collected: the next round starts with nothing launched or arrived."""
        self._launched, self._next_across = [], 0
        for state in self.states:
            state.waiting, state.launched = len(state.bucket.slots), False

    def reset(self) -> None:
        """Drop everything of this step (waits for anything in flight)."""
        for state in self.states:
            if state.sent is not None:
                self.comm.wait(state.sent.handle)
            self._release(state)
        self.end_round()

    def forget_sent(self) -> None:
        """A skipped step: codecs that carry something from one send to the next (error feedback's
        residuals) drop it."""
        for state in self.states:
            state.codec.forget()
