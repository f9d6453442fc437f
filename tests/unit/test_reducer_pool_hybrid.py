"""Under node-aware sharding the newest launched bucket cannot be collected before the next launch
issues its all-reduce across the replicas (the fixed collective order, engine/reducer.py); a bucket
that needs its pool slot meanwhile must still get the slot, not a buffer allocated outside the pool
each step (no process group: a 2-replica Comm whose collectives are local copies)."""

from __future__ import annotations

import contextlib
from typing import Any

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


def _hybrid_reducer(stage: int = 2) -> tuple[torch.nn.Module, GradReducer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)]).double()
    config = ZeroConfig(stage=stage, bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4, sharded_accumulation=True)
    engine = ShardedAdamW(model.parameters(), config=config).engine
    engine.reducer.remove_hooks()
    replicas = Comm(None, _TwoEqualReplicas(None, 0, 2, torch.device("cpu")))
    groups = CommGroups(engine.comm, replicas, engine.world)
    return model, GradReducer(engine.params_in_order, engine.plan, engine.flat, groups, config)


class _TwoEqualReplicas(SingleProcess):
    """Two replica groups that hold the same gradients: an all-reduce across them doubles."""

    def all_reduce(self, tensor: torch.Tensor, op: str) -> Any:
        tensor.mul_(2)
        return super().all_reduce(tensor, op)


def _backward(model: torch.nn.Module, seed: int) -> None:
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).sum().backward()


def test_a_window_whose_last_backward_ran_inside_no_sync_is_closed_by_the_step() -> None:
    """Sharded accumulation: the step's last round inside ``no_sync`` (a manual loop) is closed at the
    step, with the same shards as a window whose last backward ran outside it."""
    model, reducer = _hybrid_reducer()
    for seed in range(3):
        with reducer.no_sync():
            _backward(model, seed)
    reducer.finalize()
    closed = [s.clone() for s in reducer.grad_shards]
    reducer.reset()
    for seed in range(3):
        with reducer.no_sync() if seed < 2 else contextlib.nullcontext():
            _backward(model, seed)
    reducer.finalize()
    assert all(torch.equal(a, b) for a, b in zip(closed, reducer.grad_shards, strict=True))


def test_a_backward_inside_no_sync_after_one_outside_it_is_refused_at_the_step() -> None:
    """Under node-aware sharding the part of a round outside ``no_sync`` is already summed across the
    replicas; closing the window would sum it again, once per replica group: refused, by name."""
    model, reducer = _hybrid_reducer()
    _backward(model, 0)
    with reducer.no_sync():
        _backward(model, 1)
    with pytest.raises(RuntimeError, match="last backward ran inside no_sync after one outside it"):
        reducer.finalize()
