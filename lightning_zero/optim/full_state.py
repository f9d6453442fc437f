"""Full (unsharded) optimizer state in ``torch.optim.AdamW``'s own format, to and from shards.

``gather_full_state`` builds, on one rank, the state dict a single-process ``torch.optim.AdamW``
over the same param groups would have: ``{"state": {i: {"step", "exp_avg", "exp_avg_sq"[,
"max_exp_avg_sq"]}}, "param_groups": [... "params": [i, ...]]}`` with ``i`` numbering the
parameters of all groups in order. It goes bucket by bucket (one ``gather`` per state tensor per
bucket), so the destination holds one bucket's worth of every rank's shards at a time on top of
the result. ``scatter_full_state`` is the inverse and needs no communication: every rank reads the
same full state and keeps the pieces it owns under *its* partition, whatever world size wrote it.
That is what lets a checkpoint saved on N ranks (or by plain ``"ddp"``) resume on M ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_zero.engine.engine import ShardEngine
from lightning_zero.engine.tensor_parallel import TensorParallel


def _group_indices(engine: ShardEngine) -> dict[torch.nn.Parameter, int]:
    """torch's numbering: parameters of all groups, in order."""
    numbering: dict[torch.nn.Parameter, int] = {}
    for group in engine.param_groups:
        for p in group["params"]:
            numbering.setdefault(p, len(numbering))
    return numbering


def gather_full_state(engine: ShardEngine, dst: int = 0) -> dict[str, Any] | None:
    """The full AdamW state dict on rank ``dst`` (``None`` elsewhere). Call on all ranks.

    Under hybrid sharding ``dst`` must be a rank of the first replica group (``dst < G``): that group
    gathers its shards to ``dst``; the other groups, which hold the same, send nothing."""
    TensorParallel.refuse(engine.tensor, "consolidate_state_dict")
    comm, plan, shards = engine.comm, engine.plan, engine.state
    if not 0 <= dst < comm.world_size:
        raise ValueError(
            f"dst={dst}: the optimizer state is gathered to a rank of the first shard group, "
            f"0..{comm.world_size - 1}"
        )
    if engine.groups.replicas.rank != 0:
        return None  # another replica group: the first holds the same shards (a gather inside each group)
    numbering = _group_indices(engine)
    state: dict[int, dict[str, Tensor]] = {}
    for b, bucket in enumerate(plan.buckets):
        for name, moment in shards.records[b].moments.items():
            with comm.only_some_groups():  # the first replica group's (all of them, flat)
                full = comm.gather(moment, dst)  # (padded_numel,) on dst
            if full is None:
                continue
            for slot in bucket.slots:
                param = engine.params_in_order[slot.param_index]
                if shards.steps[slot.param_index] == 0:
                    continue  # torch keeps no state for a parameter never stepped
                values = full[slot.bucket_offset : slot.bucket_offset + slot.numel].view(param.shape).clone()
                entry = state.setdefault(numbering[param], {})
                entry[name] = values
                entry["step"] = torch.tensor(float(shards.steps[slot.param_index]), dtype=torch.float32)
    if engine.world.rank != dst:
        return None
    groups = []
    for group in engine.param_groups:
        saved = {k: v for k, v in group.items() if k not in ("params", "decoupled_weight_decay")}
        saved.update(
            params=[numbering[p] for p in group["params"]],
            foreach=None,
            fused=None,
            capturable=False,
            differentiable=False,
            decoupled_weight_decay=group["decoupled_weight_decay"],
        )
        groups.append(saved)
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def scatter_full_state(engine: ShardEngine, full: dict[str, Any]) -> None:
    """Load a torch-format Adam/AdamW state dict into this rank's shards (no communication)."""
    TensorParallel.refuse(engine.tensor, "load_state_dict")
    numbering = _group_indices(engine)
    saved_groups = full.get("param_groups", [])
    if len(saved_groups) != len(engine.param_groups):
        raise ValueError(
            f"checkpoint has {len(saved_groups)} optimizer param groups, the optimizer has "
            f"{len(engine.param_groups)}"
        )
    for g, (group, saved) in enumerate(zip(engine.param_groups, saved_groups, strict=True)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"param group {g}: checkpoint has {len(saved['params'])} parameters, the optimizer "
                f"has {len(group['params'])}"
            )
        for key, value in saved.items():
            if key not in ("params", "foreach", "fused", "capturable", "differentiable"):
                group[key] = value
    remap = {
        saved_i: numbering[p]
        for group, saved in zip(engine.param_groups, saved_groups, strict=True)
        for saved_i, p in zip(saved["params"], group["params"], strict=True)
    }
    state = {remap[int(k)]: v for k, v in full.get("state", {}).items()}
    shards, plan = engine.state, engine.plan
    for index, param in enumerate(engine.params_in_order):
        entry = state.get(numbering[param], {})
        shards.steps[index] = int(entry["step"]) if "step" in entry else 0
    for b, bucket in enumerate(plan.buckets):
        for seg in plan.segments(bucket, engine.comm.rank):
            param = engine.params_in_order[seg.param_index]
            entry = state.get(numbering[param], {})
            window = slice(seg.shard_offset, seg.shard_offset + seg.numel)
            for name, target in shards.records[b].moments.items():
                source = entry.get(name)
                if source is None:
                    target[window].zero_()
                    continue
                if source.shape != param.shape:
                    raise ValueError(
                        f"state {name!r} of parameter {plan.params[seg.param_index].name!r} has shape "
                        f"{tuple(source.shape)}, the parameter {tuple(param.shape)}"
                    )
                target[window].copy_(source.reshape(-1)[seg.param_start : seg.param_end])
    shards.refresh_master()
