"""Run on every rank by tests/distributed/test_host_syncs.py: host synchronisations per optimizer step."""

from __future__ import annotations

from typing import Any

import torch

from lightning_zero import ShardedAdamW, ZeroConfig
from lightning_zero.comm import hybrid_mesh
from tests.distributed.host_syncs import HostSyncs
from tests.distributed.models import BlockNet, TinyNet, batch, param_groups, uses_extra


def host_syncs(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_case(rank, world_size, **case) for case in cases]


def _case(
    rank: int,
    world_size: int,
    *,
    stage: int = 2,
    accum: int = 3,
    steps: int = 3,
    clip: float | None = 0.05,
    find_unused_parameters: bool = False,
    skip_nonfinite_steps: int = 0,
    reduce_dtype: str | None = None,
    net: str = "tiny",
    shard_group_size: int | None = None,
) -> dict[str, Any]:
    """Train ``steps`` optimizer steps of ``accum`` micro-batches (``no_sync`` on all but the last) after
    one warm-up step; count host synchronisations in forward, backward, clipping and the step, per
    optimizer step and in the micro-batches that do not step."""
    torch.manual_seed(0)
    model = (TinyNet if net == "tiny" else BlockNet)(13).to(torch.float64)
    config = ZeroConfig(
        stage=stage,
        bucket_cap_mb=0.0004,
        first_bucket_cap_mb=0.0002,
        find_unused_parameters=find_unused_parameters,
        skip_nonfinite_steps=skip_nonfinite_steps,
        reduce_dtype=reduce_dtype,
        **({"min_unit_numel": 0} if stage == 3 else {}),
    )
    opt = ShardedAdamW(
        param_groups(model),
        lr=1e-2,
        config=config,
        param_order=model.parameters(),
        module=model if stage == 3 else None,
        device_mesh=None if shard_group_size is None else hybrid_mesh(shard_group_size, "cpu"),
    )
    per_step, per_micro = [], []
    for step in range(steps + 1):
        xs = [batch(step, m, rank, 4, torch.float64) for m in range(accum)]
        extra = uses_extra(step, rank)
        with HostSyncs() as syncs:
            for micro, (x, y) in enumerate(xs):
                loss = torch.nn.functional.mse_loss(model(x, extra) if net == "tiny" else model(x), y)
                if micro < accum - 1:
                    with opt.no_sync():
                        loss.backward()
                else:
                    before_last = syncs.total
                    loss.backward()
            if clip is not None:
                opt.clip_grad_norm_(clip)
            opt.step()
            opt.zero_grad()
        if step > 0:  # the first step builds what later steps reuse
            per_step.append(syncs.total)
            per_micro.append(before_last)
    return {"per_step": per_step, "in_non_stepping_micro_batches": per_micro, "names": dict(syncs.count)}
