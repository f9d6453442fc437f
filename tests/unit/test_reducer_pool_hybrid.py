"""Under node-aware sharding the newest launched bucket cannot be collected before the next launch
issues its all-reduce across the replicas (the fixed collective order, engine/reducer.py); a bucket
that needs its pool slot meanwhile must still get the slot, not a buffer allocated outside the pool
each step (no process group: a 2-replica Comm whose collectives are local copies)."""

from __future__ import annotations

import pytest
import torch

from lightning_zero import ShardedAdamW, ZeroConfig
from lightning_zero.comm import Comm, CommGroups
from lightning_zero.comm.backends import SingleProcess
from lightning_zero.engine.reducer import GradReducer


def _allocations_outside_pool(replicas: int, stage: int, dtype: torch.dtype, align: int) -> list[int]:
    torch.manual_seed(0)
    # bias-free layers one bucket each; bf16 (or padded) buckets cannot adopt their gradient
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8, bias=False) for _ in range(6)]).to(dtype)
    config = ZeroConfig(stage=stage, bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4, align_numel=align)
    engine = ShardedAdamW(model.parameters(), config=config).engine
    engine.reducer.remove_hooks()
    groups = CommGroups(
        engine.comm, Comm(None, SingleProcess(None, 0, replicas, torch.device("cpu"))), engine.world
    )
    reducer = GradReducer(engine.params_in_order, engine.plan, engine.flat, groups, config)
    out = []
    for _ in range(3):
        model(torch.ones(2, 8, dtype=dtype)).float().pow(2).sum().backward()
        reducer.finalize()
        reducer.reset()
        out.append(reducer.allocations_outside_pool)
    return out


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize(("dtype", "align"), [(torch.bfloat16, 1), (torch.float64, 3)])
def test_hybrid_sharding_allocates_nothing_outside_the_pool(
    stage: int, dtype: torch.dtype, align: int
) -> None:
    assert _allocations_outside_pool(1, stage, dtype, align) == [0, 0, 0]
    assert _allocations_outside_pool(2, stage, dtype, align) == [0, 0, 0]
