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

**int8** (:class:`Int8Codec`; ``reduce_dtype="int8"``, experimental): gradients on the wire as int8
blocks with fp32 scales. A quantized sum cannot ride a reduce-scatter: summing int8 values of
different scales is meaningless. So each rank quantizes, per destination rank ``r``, the part of the
bucket that ``r`` owns (:mod:`lightning_zero.engine.quantize`: blocks of 256, ``amax / 127``
scales), packs the int8 values and the scales of each destination into one byte row, and one
all-to-all delivers every row; the receiver dequantizes the ``N`` parts it got, sums them in fp32
and adds the sum to its shard in the master dtype (copy in the first round of a step, add in later
ones). The wire goes through fp32: fp64 gradients lose their extra precision on it, and a finite
fp64 value beyond fp32's range makes its block NaN (the step counts as non-finite). Stages 1, 2 and
3 reduce the same way (stage 1 keeps only its slice of the all-reduce anyway).

Bytes that leave a rank per bucket: ``(N-1)/N`` of ``N`` rows of ``(1 + 4/256)`` bytes per element
(the rows padded to whole blocks), against 4 bytes per element for an fp32 reduce-scatter: 0.254x.

**Node-aware sharding** (``G`` ranks per shard group, ``R`` groups; ZeRO++'s hierarchical choice):
the reduction inside a group (fast links) stays in the master dtype, exactly as without int8; only
the all-reduce of each rank's part across the ``R`` groups (the links between nodes) is quantized, as
two steps: an all-to-all of int8 rows (each replica's chunk ``j`` of the part goes to replica ``j``,
which dequantizes and sums the ``R`` chunks), then an all-gather of each summed chunk, quantized
again. Every replica dequantizes the same bytes, so the replicas' shards stay identical. (A step
whose every backward ran inside ``no_sync`` with sharded accumulation is all-reduced across the
groups when the window closes, in the master dtype: the reducer's own path.) Bytes that
leave a rank across the groups: ``2 (R-1)`` rows of a chunk, ``2 (R-1)/R (1 + 4/256)`` bytes per
element of the part against ``2 (R-1)/R * 4`` for the fp32 all-reduce.

**Error**: each rank's part is within half a quantization step of its block (``amax / 254``), so the
summed mean is within the sum of the ``N`` senders' bounds (hybrid: of the ``R`` replicas' chunks,
plus half a step of the summed chunk's block for the all-gather). A block holding inf/NaN arrives
as NaN (its scale is NaN), and the summed part is shown to the non-finite check as a narrower wire's
is.

**Error feedback** (``error_feedback=True``): before quantizing, each rank adds the residual its
last send of this bucket left (what was meant minus what the receiver dequantized) and keeps the new
one, so over ``T`` sends the sum of what arrived differs from the sum of the gradients by the last
residual alone, not by ``T`` of them. The residual is a bucket-sized tensor in the master dtype on
every rank; a non-finite block leaves no residual (it is zeroed), a step skipped for non-finite
gradients (``skip_nonfinite_steps``) or by the loss scaler (``16-mixed``) drops every residual, and it
is not checkpointed (a resume starts from zero). Under node-aware sharding it applies to each rank's
contribution (the all-to-all; a residual of its part, ``1/G`` of the bucket), not to the
re-quantization of the summed chunk, whose error is not carried over: there the one-step bound of
the summed error does not hold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_zero.comm.communicator import Comm
from lightning_zero.config import ZeroConfig, master_dtype
from lightning_zero.engine.quantize import Residual, pack, unpack_rows, unpack_sum
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
        in :class:`Int8Codec`)."""

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


class Int8Codec(WireCodec):
    """Quantize per destination, all-to-all, dequantize and sum (the module docstring); under
    node-aware sharding, the master dtype inside a group and the quantized all-reduce across."""

    def __init__(self, stage: int, master: torch.dtype, hierarchical: bool, error_feedback: bool) -> None:
        super().__init__(torch.int8, stage)
        self.inner = WireCodec(master, stage) if hierarchical else None
        """Node-aware sharding: the codec of the reduction inside the shard group."""
        self.residual = Residual() if error_feedback else None

    def launch(
        self,
        comm: Comm,
        accum: Tensor,
        shard: Tensor,
        first_round: bool,
        inspect: Inspect | None = None,
        ranks: int | None = None,
    ) -> InFlight:
        if self.inner is not None:
            return self.inner.launch(comm, accum, shard, first_round, inspect, ranks)
        n = comm.world_size
        mean = accum.div_(ranks or n)  # the accumulation buffer is scratch once launched
        if inspect is not None:
            inspect(mean)
        rows = pack(mean, n, self.residual)  # blocks never straddle two destinations
        received = torch.empty_like(rows)
        handle = comm.all_to_all(received, rows.view(-1), what="gradient all-to-all (int8)")
        return InFlight(handle, received, None, uses_accum=False, narrower=True)

    def collect(
        self,
        comm: Comm,
        sent: InFlight,
        shard: Tensor,
        first_round: bool,
        inspect: Inspect | None = None,
        replicas: Comm | None = None,
    ) -> None:
        if self.inner is not None:
            if replicas is None or replicas.world_size == 1 or sent.local_only:
                self.inner.collect(comm, sent, shard, first_round, inspect, replicas)
                return
            self._collect_across(comm, sent, shard, first_round, inspect, replicas)
            return
        comm.wait(sent.handle)
        result = unpack_sum(sent.wire.view(comm.world_size, -1))[: shard.numel()].to(shard.dtype)
        if inspect is not None:
            inspect(result)
        self.decode(result, shard, accumulate=not first_round)

    def start_across(self, comm: Comm, sent: InFlight, replicas: Comm, fold: Tensor | None = None) -> None:
        """The quantized all-reduce of this rank's part across the replicas: the all-to-all of its
        chunks, the sum of the chunk this replica owns, and the all-gather of the sums, issued here in
        that order (on CUDA on the side stream, which waits for each step: no host synchronisation);
        :meth:`collect` dequantizes what the all-gather brought."""
        assert self.inner is not None
        r = replicas.world_size
        with comm.after(sent.handle):
            part = self.inner._part(comm, sent)
            if fold is not None:
                self.inner.decode(part, fold, accumulate=True)
                part, sent.folded = fold, True
            rows = pack(part, r, self.residual)
            received = torch.empty_like(rows)
            what = "gradient all-to-all across replicas (int8)"
            replicas.wait(replicas.all_to_all(received, rows.view(-1), what=what))
            summed = pack(unpack_sum(received), 1)
            gathered = torch.empty_like(rows)
            sent.handle = replicas.all_gather(
                gathered.view(-1), summed.view(-1), what="gradient all-gather across replicas (int8)"
            )
        sent.part, sent.output = part, gathered
        sent.across = sent.narrower = True

    def forget(self) -> None:
        """A skipped step (non-finite gradients): the residual of its sends is dropped, not carried."""
        if self.residual is not None:
            self.residual.value = None

    def keep_part(self, comm: Comm, sent: InFlight) -> None:
        assert self.inner is not None, "keep_part is called under node-aware sharding only"
        self.inner.keep_part(comm, sent)

    def _collect_across(
        self,
        comm: Comm,
        sent: InFlight,
        shard: Tensor,
        first_round: bool,
        inspect: Inspect | None,
        replicas: Comm,
    ) -> None:
        if not sent.across:
            raise RuntimeError(
                "a bucket was collected before its all-reduce across the replicas was issued; the "
                "reducer issues it at a fixed point of the program (engine/reducer.py)"
            )
        replicas.wait(sent.handle)
        assert sent.output is not None and sent.part is not None
        comm.read_here(sent.output)  # made inside comm.after (a side stream on CUDA), read on this one
        result = unpack_rows(sent.output, sent.part.numel()).to(shard.dtype)
        if inspect is not None:
            inspect(result)
        if sent.folded:  # the part was the shard, holding the step's earlier rounds: it is the sum now
            shard.copy_(result)
            return
        self.decode(result, shard, accumulate=not first_round)


def codec_for(config: ZeroConfig, param_dtype: torch.dtype, hierarchical: bool = False) -> WireCodec:
    """The codec for the buckets of ``param_dtype`` under ``config`` (the one place that chooses);
    ``hierarchical``: node-aware sharding (a reduction inside the group, then one across the groups)."""
    if config.reduce_dtype == "int8":
        return Int8Codec(config.stage, master_dtype(param_dtype), hierarchical, config.error_feedback)
    return WireCodec(config.wire_dtype(param_dtype), config.stage)
