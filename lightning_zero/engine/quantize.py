"""Block-wise int8 quantization for the wire (:class:`~lightning_zero.engine.codecs.Int8Codec`).

A tensor is cut into blocks of :data:`BLOCK` elements (the last one zero-padded); each block is sent
as int8 values and one fp32 scale, ``amax / 127`` of the block, so that ``round(x / scale)`` lands in
``[-127, 127]``. Per element on the wire: ``1 + 4 / BLOCK`` bytes (1.016 at 256), against 4 for fp32
and 2 for bf16.

**Error bound** (asserted by ``tests/unit/test_quantize.py``): rounding to the nearest step puts every
element within half a step of its value, ``|dequantize(quantize(x)) - x| <= scale / 2 = amax / 254``
of its block, plus the fp32 rounding of the product ``q * scale``. Why 256: smaller blocks follow
local magnitudes more closely (a tighter bound for a block of small gradients next to large ones) but
pay more scale bytes (128: 1.031 bytes/element; 64: 1.063); larger blocks share one outlier's scale
with more elements. 256 is ZeRO++'s and bitsandbytes' block size for the same trade.

**Non-finite values are not hidden by a scale**: a block holding inf or NaN gets a NaN scale, so the
whole block dequantizes to NaN and the receiver's non-finite check sees it (a finite scale would turn
the inf into a finite garbage value, or NaN into 0).

**Rows** (:func:`pack`, :func:`unpack`): what one collective carries for one destination or one
source: a tensor cut into equal chunks, each quantized into a byte row of its int8 values followed by
its fp32 scales (``(1 + 4/BLOCK)`` bytes per element, the chunk padded to whole blocks), so a
collective of ``uint8`` tensors moves values and scales together. :class:`Residual` is error
feedback: the quantization error of one send, added to the next.
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 256
"""Elements per block (one fp32 scale each)."""
LEVELS = 127
"""The int8 values used: ``[-LEVELS, LEVELS]`` (symmetric; -128 is never produced)."""


def blocks_of(numel: int, block: int = BLOCK) -> int:
    """How many blocks ``numel`` elements take (the last one padded)."""
    return -(-numel // block)


def wire_bytes(numel: int, block: int = BLOCK) -> int:
    """Bytes on the wire for ``numel`` elements: one int8 each (padding included) and an fp32 scale
    per block."""
    blocks = blocks_of(numel, block)
    return blocks * block + 4 * blocks


@torch.no_grad()
def quantize(x: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """``(values, scales)``: ``values`` int8 of ``blocks * block`` elements, ``scales`` fp32 of one per
    block (NaN for a block that holds a non-finite value). ``x`` is read as a flat tensor of any
    floating dtype."""
    flat = x.detach().reshape(-1).float()  # fp32 input: a view (read only here)
    blocks = blocks_of(flat.numel(), block)
    if flat.numel() == blocks * block:
        grid = flat.view(blocks, block)
    else:
        grid = torch.zeros(blocks, block, dtype=torch.float32, device=flat.device)
        grid.view(-1)[: flat.numel()] = flat
    amax = grid.abs().amax(dim=1)  # inf or NaN for a block holding either (amax propagates NaN)
    finite = torch.isfinite(amax)
    scales = torch.where(finite, amax, torch.zeros_like(amax)) / LEVELS
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block: values 0
    values = (grid / safe[:, None]).round_().clamp_(-LEVELS, LEVELS).to(torch.int8)
    values.masked_fill_(~finite[:, None], 0)  # whatever a non-finite value became: its scale is NaN
    scales = torch.where(finite, scales, torch.full_like(scales, float("nan")))
    return values.reshape(-1), scales


@torch.no_grad()
def dequantize(values: Tensor, scales: Tensor, numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """The ``numel`` elements that :func:`quantize` encoded, in ``dtype`` (a block with a NaN scale is
    all NaN)."""
    blocks = scales.numel()
    grid = values.view(blocks, -1).float() * scales[:, None]
    return grid.reshape(-1)[:numel].to(dtype)


class Residual:
    """Error feedback for one bucket: the quantization error of the last send, added to the next."""

    def __init__(self) -> None:
        self.value: Tensor | None = None

    def quantize(self, grid: Tensor) -> tuple[Tensor, Tensor]:
        """:func:`quantize` of ``grid`` plus the carried residual (``grid`` is scratch: changed in
        place); keeps the new residual."""
        if self.value is None or self.value.shape != grid.shape or self.value.dtype != grid.dtype:
            self.value = torch.zeros_like(grid)
        grid.add_(self.value)
        values, scales = quantize(grid)
        sent = dequantize(values, scales, grid.numel(), grid.dtype).view_as(grid)
        torch.sub(grid, sent, out=self.value)
        self.value.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # a non-finite block carries nothing over
        return values, scales


@torch.no_grad()
def pack(part: Tensor, rows: int, residual: Residual | None = None) -> Tensor:
    """``part`` cut into ``rows`` equal chunks (zero-padded to whole blocks), each quantized into one
    byte row of int8 values then fp32 scales: ``(rows, row_bytes)`` uint8."""
    flat = part.reshape(-1)
    chunk = -(-flat.numel() // rows)
    padded = blocks_of(chunk) * BLOCK
    if residual is None and padded == chunk and chunk * rows == flat.numel():
        grid = flat.view(rows, padded)  # whole blocks already: quantized where it lies (read only)
    else:
        grid = torch.zeros(rows, padded, dtype=part.dtype, device=part.device)
        full = flat.numel() // chunk  # rows filled whole; under node-aware sharding the last may be short
        grid[:full, :chunk] = flat[: full * chunk].view(full, chunk)
        if full < rows:
            rest = flat[full * chunk :]
            grid[full, : rest.numel()] = rest
    values, scales = quantize(grid.view(-1)) if residual is None else residual.quantize(grid.view(-1))
    as_bytes = [values.view(rows, padded).view(torch.uint8), scales.view(rows, -1).view(torch.uint8)]
    return torch.cat(as_bytes, dim=1)


@torch.no_grad()
def unpack_rows(rows: Tensor, numel: int, out: Tensor | None = None) -> Tensor:
    """The inverse of :func:`pack`: the ``numel`` elements whose chunks ``rows`` (``(R, row_bytes)``)
    hold, dequantized, in fp32 or into ``out`` (``(numel,)``, any floating dtype)."""
    chunk = -(-numel // rows.shape[0])
    if out is None:
        out = torch.empty(numel, dtype=torch.float32, device=rows.device)
    for j in range(rows.shape[0]):
        piece = out[j * chunk : (j + 1) * chunk]
        piece.copy_(unpack(rows[j])[: piece.numel()])
    return out


@torch.no_grad()
def unpack(row: Tensor) -> Tensor:
    """One byte row of :func:`pack`, dequantized: ``(padded,)`` fp32."""
    padded = row.numel() * BLOCK // (BLOCK + 4)  # int8 values, then one fp32 scale per block
    values = row[:padded].view(torch.int8)
    scales = row[padded:].contiguous().view(torch.float32)
    return dequantize(values, scales, padded)


def unpack_sum(rows: Tensor) -> Tensor:
    """The sum of the dequantized rows of ``rows`` (``(R, row_bytes)``), in fp32."""
    total = unpack(rows[0])
    for source in range(1, rows.shape[0]):
        total.add_(unpack(rows[source]))
    return total
