"""Wire codecs: how one bucket's summed local gradients become this rank's averaged gradient shard.

A codec owns the three steps between the accumulation buffer and the shard, so that a new way of
sending gradients is one class:

  1. **encode** the bucket for the wire: divide by the world size first (a 16-bit wire then carries
     the mean, not a sum that may overflow) and cast to the wire dtype — in place when the wire dtype
     is the accumulation dtype, so no buffer is allocated;
  2. **send** it: stage 2 reduce-scatters into this rank's shard (directly into the shard when the
     dtypes match and it holds nothing yet), stage 1 all-reduces the bucket and keeps the owned
     slice. This is the only place where the two stages differ;
  3. **decode** the result into the shard: copy (first round of a step) or add (later rounds, e.g.
     several backward passes before one step), converting to the shard's dtype.

:class:`WireCodec` does all three for any wire dtype (``reduce_dtype``: ``None`` sends the master
dtype, ``"bf16"``/``"fp16"`` halve the bytes, ``"fp32"``). A codec that sends something other than a
summable tensor (e.g. int8 with per-block scales, which a reduce-scatter cannot add) overrides
:meth:`WireCodec.launch` and :meth:`WireCodec.collect` with its own collectives (an all-to-all of
blocks and scales, then a local sum) and is picked by :func:`codec_for` from the config.

Non-finite checks (``skip_nonfinite_steps``): :meth:`WireCodec.launch` hands what goes on the wire to
an ``inspect`` callback just before sending (a cast to a narrower wire that overflows shows there).
A sum of finite values can overflow only on a wire narrower than the accumulation dtype (``"fp16"``
for fp32 gradients, ``"fp32"`` for fp64 ones): there :meth:`WireCodec.collect` inspects this rank's
reduced part as well.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_zero.comm.communicator import Comm
from lightning_zero.config import ZeroConfig, master_dtype
from lightning_zero.layout.partition import shard_range


@dataclass
class InFlight:
    """One launched bucket: its pending collective and the tensors it reads and writes."""

    handle: Any
    wire: Tensor
    """What is on the wire: the accumulation buffer itself, or its cast."""
    output: Tensor | None
    """Stage 2: where the reduce-scatter writes (the shard itself, or a buffer of the wire dtype)."""
    uses_accum: bool
    """``wire`` is the accumulation buffer: its pool slot is busy until the bucket is collected."""
    narrower: bool = False
    """The wire dtype has less range than the accumulation dtype: the reduction itself may overflow."""
    across: bool = False
    """Hybrid sharding: ``handle`` is now the all-reduce of this rank's part across the replicas
    (:meth:`WireCodec.start_across`), the reduction inside the shard group being done."""
    local_only: bool = False
    """Sharded accumulation inside ``no_sync``: no all-reduce across the replicas for this round."""
    part: Tensor | None = None
    """This rank's reduced part, kept apart from ``wire`` (:meth:`WireCodec.keep_part`)."""
    folded: bool = False
    """The part is already in the shard, and ``handle`` all-reduces the whole shard across the
    replicas (the step's last round after rounds inside ``no_sync``)."""


Inspect = Callable[[Tensor], None]
"""Called with a tensor that must be checked for inf/NaN (device-side; it must not synchronise)."""


class WireCodec:
    """Averaging, cast to ``wire_dtype``, the stage's collective, and accumulation into the shard."""

    def __init__(self, wire_dtype: torch.dtype, stage: int) -> None:
        self.wire_dtype, self.stage = wire_dtype, stage

    def encode(self, accum: Tensor, world_size: int) -> Tensor:
        """The bucket's mean over ranks, in the wire dtype: ``accum`` itself (divided in place) when it
        already has that dtype, else a new ``(padded_numel,)`` tensor."""
        if accum.dtype == self.wire_dtype:
            return accum.div_(world_size)
        wire = torch.empty(accum.numel(), dtype=self.wire_dtype, device=accum.device)
        torch.div(accum, world_size, out=wire)
        return wire

    def decode(self, result: Tensor, shard: Tensor, accumulate: bool) -> None:
        """Fold the reduced ``result`` (this rank's slice) into ``shard``, in the shard's dtype."""
        if result is shard:
            return
        if accumulate:
            shard.add_(result)
        else:
            shard.copy_(result)

    def launch(
        self,
        comm: Comm,
        accum: Tensor,
        shard: Tensor,
        first_round: bool,
        inspect: Inspect | None = None,
        ranks: int | None = None,
    ) -> InFlight:
        """Start sending ``accum`` (``(padded_numel,)``, scratch afterwards) towards ``shard``;
        ``inspect`` sees the encoded bucket before it is sent. ``ranks``: how many ranks the
        gradient is averaged over (hybrid sharding: all of them, not only ``comm``'s)."""
        wire = self.encode(accum, ranks or comm.world_size)
        if inspect is not None:
            inspect(wire)
        narrower = torch.finfo(wire.dtype).max < torch.finfo(accum.dtype).max
        if self.stage == 1:
            return InFlight(
                comm.all_reduce(wire, what="gradient all-reduce"), wire, None, wire is accum, narrower
            )
        direct = first_round and shard.dtype == wire.dtype  # the shard holds nothing of this step yet
        output = shard if direct else torch.empty(shard.numel(), dtype=wire.dtype, device=shard.device)
        handle = comm.reduce_scatter(output, wire, what="gradient reduce-scatter")
        return InFlight(handle, wire, output, wire is accum, narrower)

    def collect(
        self,
        comm: Comm,
        sent: InFlight,
        shard: Tensor,
        first_round: bool,
        inspect: Inspect | None = None,
        replicas: Comm | None = None,
    ) -> None:
        """Wait for ``sent`` and fold this rank's part into ``shard``; ``inspect`` sees that part when
        the reduction on a narrower wire may have overflowed. ``replicas`` (hybrid sharding): the
        part is first summed across them, in the wire dtype; :meth:`start_across` must have been
        called (collecting issues no collective: the caller decides where each one is issued)."""
        if replicas is not None and replicas.world_size > 1 and not sent.local_only:
            if not sent.across:
                raise RuntimeError(
                    "a bucket was collected before its all-reduce across the replicas was issued; the "
                    "reducer issues it at a fixed point of the program (engine/reducer.py)"
                )
            replicas.wait(sent.handle)
            if sent.folded:
                if inspect is not None and sent.narrower:
                    inspect(shard)
                return
        else:
            comm.wait(sent.handle)
        result = self._part(comm, sent)
        if inspect is not None and sent.narrower:
            inspect(result)
        self.decode(result, shard, accumulate=not first_round)

    def start_across(self, comm: Comm, sent: InFlight, replicas: Comm, fold: Tensor | None = None) -> None:
        """Hybrid sharding: start the all-reduce of this rank's part across the replicas, after the
        reduction inside the shard group (on CUDA ordered on a side stream, so the compute stream does
        not wait for it); ``sent.handle`` becomes that one. ``fold`` (the shard, holding earlier
        rounds of the step): add the part to it first and all-reduce the whole shard instead, in its
        dtype."""
        with comm.after(sent.handle):
            part = self._part(comm, sent)
            if fold is not None:
                self.decode(part, fold, accumulate=True)
                part, sent.folded = fold, True
            sent.handle = replicas.all_reduce(part, what="gradient all-reduce across replicas")
        sent.across = True

    def forget(self) -> None:
        """Drop whatever is carried from one send to the next (nothing here; error feedback's residual
        in :class:`~lightning_zero.engine.int8_codec.Int8Codec`)."""

    def keep_part(self, comm: Comm, sent: InFlight) -> None:
        """Wait for the reduction inside the group and keep this rank's part apart from the wire
        buffer (stage 1: a copy of its slice; stage 2: the reduce-scatter's output already is), so the
        accumulation buffer can go back to its pool before the all-reduce across the replicas is
        issued. Issues no collective."""
        comm.wait(sent.handle)
        part = self._part(comm, sent)
        sent.part = part.clone() if self.stage == 1 else part
        sent.uses_accum = False

    def _part(self, comm: Comm, sent: InFlight) -> Tensor:
        """This rank's part of the reduced bucket."""
        if sent.part is not None:
            return sent.part
        if self.stage == 1:
            start, end = shard_range(sent.wire.numel(), comm.world_size, comm.rank)
            return sent.wire[start:end]
        assert sent.output is not None
        return sent.output


def codec_for(config: ZeroConfig, param_dtype: torch.dtype, hierarchical: bool = False) -> WireCodec:
    """The codec for the buckets of ``param_dtype`` under ``config`` (the one place that chooses);
    ``hierarchical``: node-aware sharding (a reduction inside the group, then one across the groups)."""
    if config.reduce_dtype == "int8":
        from lightning_zero.engine.int8_codec import Int8Codec  # it builds on this module

        return Int8Codec(config.stage, master_dtype(param_dtype), hierarchical, config.error_feedback)
    return WireCodec(config.wire_dtype(param_dtype), config.stage)
