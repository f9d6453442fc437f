"""Stage 3: one unit's gather state, and the all-gathers that fill its buckets, exact or from int8 rows
(:mod:`lightning_zero.engine.unit_gather` decides when; this module how)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightning_zero.comm.communicator import Comm
from lightning_zero.engine.quantize import pack, unpack_rows
from lightning_zero.layout.buckets import Bucket
from lightning_zero.layout.flat import FlatParams

Pending = tuple[object, Bucket, torch.Tensor | None]
"""A gather in flight: its handle, its bucket and (int8) the byte rows it fills."""


@dataclass
class UnitState:
    """One unit's buckets and per-step state (lives and dies together)."""

    index: int
    name: str
    buckets: list[Bucket]
    params: list[int]
    pending: list[Pending] = field(default_factory=list)
    """Gathers launched and not yet waited for: the handle, the bucket, and (int8 gathers) the byte
    rows it fills, dequantized into the bucket once it completes."""
    quantized: bool = False
    """What the gathered buffers hold (or will once ``pending`` completes) are dequantized int8 values."""
    forward_quantized: bool = False
    """The unit's last forward with gradients ran on dequantized values: its backward (and a
    recomputation) gathers them again. A forward without gradients (evaluation) between a training
    forward and its backward leaves it as it is."""
    trained: bool = False
    """A forward with gradients ran since the last optimizer step (else a recomputation is of a
    reentrant checkpoint's forward, which ran without gradients, on exact values)."""
    arrived: set[int] = field(default_factory=set)
    """Parameters whose gradient arrived in this backward."""


def launch(comm: Comm, flat: FlatParams, bucket: Bucket, quantized: bool, unit: str = "") -> Pending:
    """Start ``bucket``'s all-gather from every rank's shard into its full buffer: exact, or
    (``quantized``) each shard as one byte row of int8 blocks and fp32 scales
    (:func:`~lightning_zero.engine.quantize.pack`). ``unit``: its name, in what a failure or a
    signature check says."""
    if not quantized:
        what = f"parameter all-gather of unit {unit!r}"
        handle = comm.all_gather(flat.bucket(bucket), flat.shard(bucket), what=what, params=True)
        return handle, bucket, None
    row = pack(flat.shard(bucket), 1)
    rows = row.new_empty(comm.world_size, row.shape[1])  # (world_size, row bytes)
    handle = comm.all_gather(
        rows.view(-1), row.view(-1), what=f"parameter all-gather (int8) of unit {unit!r}", params=True
    )
    return handle, bucket, rows


@torch.no_grad()
def complete(comm: Comm, flat: FlatParams, state: UnitState) -> None:
    """Wait for ``state``'s gathers in flight; int8 rows are dequantized into their buckets (every rank,
    the owner too, from the same bytes)."""
    for handle, bucket, rows in state.pending:
        comm.wait(handle)
        if rows is not None:
            full = flat.bucket(bucket)
            unpack_rows(rows, full.numel(), out=full)
    state.pending.clear()
