"""The in-flight half of :class:`~lightning_zero.engine.reducer.GradReducer`: launching a bucket's
collective, issuing its all-reduce across the replicas (hybrid sharding) at fixed points of the
program, and collecting finished buckets into the gradient shards while at most ``MAX_IN_FLIGHT``
wait uncollected. :class:`BucketFlight` is a part of the reducer (its base), kept apart from the
hooks and rounds; the attributes it reads are the reducer's. The collective-order rule it keeps is
in the reducer's module docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_zero.comm.communicator import Comm
from lightning_zero.config import ZeroConfig
from lightning_zero.engine.accum_buffers import AccumBuffers
from lightning_zero.engine.codecs import InFlight, WireCodec
from lightning_zero.layout.buckets import Bucket

MAX_IN_FLIGHT = 2
"""Launched buckets that may wait uncollected at once (bounds stage 2's transient gradient memory)."""
POOL_SLOTS = MAX_IN_FLIGHT + 1
"""Accumulation buffers of bucket size the pool holds: one bucket filling, the others in flight
(what ``lightning-zero estimate`` counts as transient gradient memory)."""


def _is_completed(sent: InFlight) -> bool:
    done = getattr(sent.handle, "is_completed", None)
    return bool(done()) if done is not None else True


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

    def clear(self) -> None:
        self.accum = self.sent = None


class BucketFlight:
    """Launch, across, collect (the attributes :class:`GradReducer` sets)."""

    comm: Comm
    replicas: Comm
    config: ZeroConfig
    buffers: AccumBuffers
    grad_shards: list[Tensor]
    _buckets: list[BucketState]
    _ranks: int
    _rounds: int
    _sync: bool
    _awaiting_sync: bool
    _launched: list[int]
    """The buckets launched in this round, in launch order (bucket order at stages 1 and 2)."""
    _next_across: int
    """Position in ``_launched`` of the first bucket whose all-reduce across is not issued."""
    _max_in_flight: int
    """Launched buckets that may wait uncollected at once: ``MAX_IN_FLIGHT``, or at stage 3 the most
    buckets one unit has (a unit's buckets launch together; the unit before it is collected then)."""
    _inspect: Callable[[Tensor], None] | None
    _inspect_reduced: Callable[[Tensor], None] | None

    def _accum(self, bucket_index: int) -> Tensor:
        return self.buffers.take(self._buckets[bucket_index], self._collect_oldest)

    def _collect_oldest(self) -> bool:
        """Free the pool slot of the oldest launched bucket (waits for it); False if none holds one.

        A bucket whose all-reduce across the replicas is not issued yet (hybrid: the newest) is not
        collected, which would issue that collective here; its reduction inside the group is waited
        for and its part kept apart, so its slot is free all the same (no allocation outside the pool)."""
        for b in self._launched:
            state = self._buckets[b]
            if state.sent is None:
                continue
            if self._collectable(state):
                self._collect(b)
                return True
            if state.slot is None or not state.sent.uses_accum:
                return False
            state.codec.keep_part(self.comm, state.sent)  # waits inside the group; no collective
            self.buffers.drop(state)
            return True
        return False

    def _release(self, state: BucketState) -> None:
        """Give the bucket's pool slot back and drop its buffers."""
        self.buffers.drop(state)
        state.clear()

    def _launch_ready(self) -> None:
        """Stages 1 and 2: launch, in bucket order, every bucket whose parameters have all arrived and
        whose predecessors are launched (the launched buckets are a prefix of the plan)."""
        if not self.config.overlap_comm:
            return
        while len(self._launched) < len(self._buckets) and self._buckets[len(self._launched)].waiting == 0:
            self._launch(len(self._launched))

    def _launch(self, bucket_index: int) -> None:
        state = self._buckets[bucket_index]
        accum, shard = self._accum(bucket_index), self.grad_shards[bucket_index]
        sent = state.codec.launch(self.comm, accum, shard, self._rounds == 0, self._inspect, self._ranks)
        sent.local_only = not self._sync  # sharded accumulation inside no_sync: across once, at the end
        if not sent.uses_accum:
            self._release(state)  # the wire copy is all that is needed from here on
        state.sent = sent
        state.launched = True
        self._launched.append(bucket_index)
        self._start_across(len(self._launched) - 1)
        self._collect_finished()

    def _start_across(self, end: int) -> None:
        """Hybrid sharding: issue the all-reduce across the replicas of every bucket launched before
        position ``end`` of the launch order that has none yet, in launch order. Called right after a
        launch (for the buckets before it) and at the end of a round (for all) only: fixed points of
        the program (the module docstring's collective order)."""
        if self.replicas.world_size == 1 or not self._sync:
            return
        for b in self._launched[self._next_across : end]:  # every bucket before it has its across issued
            state = self._buckets[b]
            if state.sent is not None and not state.sent.across:
                # after rounds folded inside no_sync: this round's part joins the shard, and the whole
                # accumulated shard is all-reduced across the replicas, once per step
                fold = self.grad_shards[b] if self._awaiting_sync else None
                state.codec.start_across(self.comm, state.sent, self.replicas, fold)
        self._next_across = max(self._next_across, end)

    def _collectable(self, state: BucketState) -> bool:
        """Collecting ``state`` issues no collective (hybrid: its all-reduce across is issued)."""
        sent = state.sent
        return sent is not None and (self.replicas.world_size == 1 or sent.across or sent.local_only)

    def _collect_finished(self) -> None:
        """Collect launched buckets that have finished; keep at most ``_max_in_flight`` uncollected
        (the newest included: it is never waited for here). Collecting issues no collective, so which
        buckets a completion check finds done changes no rank's collective sequence."""
        in_flight = [b for b in self._launched if self._buckets[b].sent is not None]
        excess = len(in_flight) - self._max_in_flight
        for b in in_flight[:-1]:  # oldest first
            state = self._buckets[b]
            assert state.sent is not None
            if not self._collectable(state):
                break
            if excess > 0 or _is_completed(state.sent):
                self._collect(b)
                excess -= 1

    def _collect_all(self) -> None:
        for bucket_index, state in enumerate(self._buckets):
            if state.sent is not None:
                self._collect(bucket_index)

    def _collect(self, bucket_index: int) -> None:
        state = self._buckets[bucket_index]
        assert state.sent is not None
        state.codec.collect(
            self.comm,
            state.sent,
            self.grad_shards[bucket_index],
            self._rounds == 0,
            self._inspect_reduced,
            self.replicas,
        )
        self._release(state)
