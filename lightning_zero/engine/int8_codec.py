"""``reduce_dtype="int8"``: gradients on the wire as int8 blocks with fp32 scales (experimental).

A quantized sum cannot ride a reduce-scatter: summing int8 values of different scales is
meaningless. So each rank quantizes, per destination rank ``r``, the part of the bucket that ``r``
owns (:mod:`lightning_zero.engine.quantize`: blocks of 256, ``amax / 127`` scales), packs the int8
values and the scales of each destination into one byte row, and one all-to-all delivers every row;
the receiver dequantizes the ``N`` parts it got, sums them in fp32 and adds the sum to its shard in
the master dtype (copy in the first round of a step, add in later ones). The wire goes through fp32:
fp64 gradients lose their extra precision on it, and a finite fp64 value beyond fp32's range makes
its block NaN (the step counts as non-finite). Stages 1, 2 and 3 reduce the same way (stage
1 keeps only its slice of the all-reduce anyway).

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

import torch
from torch import Tensor

from lightning_zero.comm.communicator import Comm
from lightning_zero.engine.codecs import InFlight, Inspect, WireCodec
from lightning_zero.engine.quantize import Residual, pack, unpack_rows, unpack_sum


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
