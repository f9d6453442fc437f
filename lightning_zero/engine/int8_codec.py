"""``reduce_dtype="int8"``: gradients on the wire as int8 blocks with fp32 scales (experimental).

A quantized sum cannot ride a reduce-scatter: summing int8 values of different scales is
meaningless. So each rank quantizes, per destination rank ``r``, the part of the bucket that ``r``
owns (:mod:`lightning_zero.engine.quantize`: blocks of 256, ``amax / 127`` scales), packs the int8
values and the scales of each destination into one byte row, and one all-to-all delivers every row;
the receiver dequantizes the ``N`` parts it got and sums them in the master dtype into its shard
(copy in the first round of a step, add in later ones). Stages 1, 2 and 3 reduce the same way (stage
1 keeps only its slice of the all-reduce anyway).

Bytes that leave a rank per bucket: ``(N-1)/N`` of ``N`` rows of ``(1 + 4/256)`` bytes per element
(the rows padded to whole blocks), against 4 bytes per element for an fp32 reduce-scatter: 0.254x.

Error: each rank's part is within half a quantization step of its block (``amax / 254``), so the
summed mean is within the sum of the ``N`` senders' bounds. A block holding inf/NaN arrives as NaN
(its scale is NaN), and the summed part is shown to the non-finite check as a narrower wire's is.

Not yet: node-aware sharding (the all-reduce across the replicas would need its own quantized
scheme; refused at construction), error feedback, quantized parameter gathers at stage 3, and a
convergence measurement (issue 30).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_zero.comm.communicator import Comm
from lightning_zero.engine.codecs import InFlight, Inspect, WireCodec
from lightning_zero.engine.quantize import BLOCK, blocks_of, dequantize, quantize


class Int8Codec(WireCodec):
    """Quantize per destination, all-to-all, dequantize and sum (the module docstring)."""

    def __init__(self, stage: int) -> None:
        super().__init__(torch.int8, stage)

    def launch(
        self,
        comm: Comm,
        accum: Tensor,
        shard: Tensor,
        first_round: bool,
        inspect: Inspect | None = None,
        ranks: int | None = None,
    ) -> InFlight:
        n = comm.world_size
        mean = accum.div_(ranks or n)  # the accumulation buffer is scratch once launched
        if inspect is not None:
            inspect(mean)
        part = mean.numel() // n  # buckets are padded to a multiple of the world size
        padded = blocks_of(part) * BLOCK
        grid = torch.zeros(n, padded, dtype=mean.dtype, device=mean.device)
        grid[:, :part] = mean.view(n, part)
        values, scales = quantize(grid.view(-1))  # blocks never straddle two destinations
        rows = torch.cat(
            [values.view(n, padded).view(torch.uint8), scales.view(n, -1).view(torch.uint8)], dim=1
        )
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
        comm.wait(sent.handle)
        result = self._part(comm, sent)[: shard.numel()].to(shard.dtype)
        if inspect is not None:
            inspect(result)
        self.decode(result, shard, accumulate=not first_round)

    def _part(self, comm: Comm, sent: InFlight) -> Tensor:
        """The sum of the ``N`` parts this rank received, in fp32 (dequantized)."""
        n = comm.world_size
        rows = sent.wire.view(n, -1)
        row_bytes = rows.shape[1]
        padded = row_bytes * BLOCK // (BLOCK + 4)  # int8 values, then one fp32 scale per block
        total: Tensor | None = None
        for source in range(n):
            values = rows[source, :padded].view(torch.int8)
            scales = rows[source, padded:].contiguous().view(torch.float32)
            part = dequantize(values, scales, padded)
            total = part if total is None else total.add_(part)
        assert total is not None
        return total

    def start_across(self, comm: Comm, sent: InFlight, replicas: Comm, fold: Tensor | None = None) -> None:
        raise RuntimeError("reduce_dtype='int8' does not support node-aware sharding yet")

    def keep_part(self, comm: Comm, sent: InFlight) -> None:
        raise RuntimeError("reduce_dtype='int8' does not support node-aware sharding yet")
