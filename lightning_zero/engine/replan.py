"""Carry the optimizer state from one bucket plan to the next when the trainable set changes.

A fine-tuning callback that unfreezes a backbone (``requires_grad=True`` plus ``add_param_group``),
or one that freezes a layer, changes which parameters the buckets hold. ``ShardedAdamW.replan``
builds a new plan, new flat buffers and new shards, then this module moves every surviving
parameter's Adam state (moments, step count, fp32 master) from its pieces under the old partition to
its pieces under the new one. Old buckets are all-gathered one at a time, so the transient memory is
one bucket's state, whatever the model size.

torch's Adam keeps the state of a parameter whose gradient is ``None`` and resumes from it when the
parameter trains again; a parameter leaving the plan is therefore *parked* (its full state, kept
on every rank) and restored if it comes back.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_zero.comm.communicator import Comm
from lightning_zero.engine.shard_state import ShardState
from lightning_zero.layout.buckets import BucketPlan
from lightning_zero.layout.partition import Segment


@dataclass
class Parked:
    """The full (unsharded) state of parameters that left the plan: ``{param: (tensors, step)}``."""

    entries: dict[torch.nn.Parameter, tuple[dict[str, Tensor], int]] = field(default_factory=dict)


@torch.no_grad()
def carry_state(
    comm: Comm,
    old: tuple[BucketPlan, Sequence[torch.nn.Parameter], ShardState],
    new: tuple[BucketPlan, Sequence[torch.nn.Parameter], ShardState],
    parked: Parked,
) -> None:
    """Fill ``new``'s shards with the state of ``old``'s (and parked) parameters. Call on all ranks.

    Parameters new to the optimizer start with no state (step 0), as in torch. A state tensor the new
    records do not keep (a moment of a setting switched off, a master of a dtype that needs none) is
    dropped; one they keep and the old ones lacked stays at its initial value.
    """
    old_plan, old_params, old_shards = old
    new_plan, new_params, new_shards = new
    position = {p: j for j, p in enumerate(new_params)}
    targets: dict[int, list[tuple[int, Segment]]] = defaultdict(list)
    for b, bucket in enumerate(new_plan.buckets):
        for seg in new_plan.segments(bucket, comm.rank):
            targets[seg.param_index].append((b, seg))

    def place(j: int, values: dict[str, Tensor], step: int) -> None:
        new_shards.steps[j] = step
        for b, seg in targets[j]:
            window = slice(seg.shard_offset, seg.shard_offset + seg.numel)
            destinations = new_shards.records[b].state()
            for key, value in values.items():
                if key in destinations:
                    destinations[key][window].copy_(value[seg.param_start : seg.param_end])

    for b, bucket in enumerate(old_plan.buckets):
        full = _gather_bucket_state(comm, old_shards.records[b].state(), bucket.padded_numel)
        for slot in bucket.slots:
            param = old_params[slot.param_index]
            values = {k: v[slot.bucket_offset : slot.bucket_offset + slot.numel] for k, v in full.items()}
            step = old_shards.steps[slot.param_index]
            if param in position:
                place(position[param], values, step)
            else:
                parked.entries[param] = ({k: v.clone() for k, v in values.items()}, step)
    for param in [p for p in parked.entries if p in position]:
        values, step = parked.entries.pop(param)
        place(position[param], values, step)


def _gather_bucket_state(comm: Comm, sources: dict[str, Tensor], padded_numel: int) -> dict[str, Tensor]:
    """Every state tensor of one old bucket, whole: ``{key: (padded_numel,)}``."""
    full = {}
    for key, shard in sources.items():
        # on the group's device: a state kept elsewhere (a weight average on the CPU) goes through it
        out = torch.empty(padded_numel, dtype=shard.dtype, device=comm.device)
        comm.wait(comm.all_gather(out, shard.to(comm.device)))
        full[key] = out.to(shard.device)
    return full
