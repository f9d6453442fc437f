"""The simulated world (``lightning_zero.comm.simulated``, issue 31's first step): rank ``r`` of ``N``
in one process. Each collective's result is what ``N`` ranks sending what this rank sends would
deliver; the real engine runs on it at ``N = 64`` (flat) and ``8 x 8`` (hybrid): the elements counted
per step are the formula's for that ``N``, and this rank's own shard of the parameters after a step
is a single-process AdamW's on the same gradient (every simulated rank's gradient is this one's)."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_zero import ZeroConfig
from lightning_zero.comm import Comm, CommGroups
from lightning_zero.comm.simulated import Simulated
from lightning_zero.engine.engine import ShardEngine
from lightning_zero.layout.partition import shard_range
from lightning_zero.optim.adam import AdamRule

N = 64


def _comm(rank: int, world_size: int = N) -> Comm:
    return Comm(None, Simulated(rank, world_size, torch.device("cpu")))


def test_collectives_deliver_what_n_equal_ranks_would() -> None:
    comm = _comm(5, 8)
    x = torch.arange(16.0)
    out = torch.empty(2)
    comm.wait(comm.reduce_scatter(out, x))
    assert out.tolist() == [80.0, 88.0]  # chunk 5 of 8, summed over 8 equal contributions
    t = torch.tensor([1.5, -2.0])
    comm.wait(comm.all_reduce(t))
    assert t.tolist() == [12.0, -16.0]
    comm.wait(comm.all_reduce(t, op="max"))
    assert t.tolist() == [12.0, -16.0]
    full = torch.zeros(16)
    comm.wait(comm.all_gather(full, full[10:12].fill_(3.0)))  # in place: the input is chunk 5's view
    assert full.tolist() == [3.0] * 16
    sent, got = torch.arange(8, dtype=torch.int8), torch.empty(8, dtype=torch.int8)
    comm.wait(comm.all_to_all(got, sent))
    assert got.tolist() == [5] * 8  # what each sender sends rank 5, as this rank sends it
    assert comm.all_gather_object({"rank": 5}) == [{"rank": 5}] * 8
    # counted as rank 5 of 8: a ring's (N-1)/N of each collective
    assert comm.stats.elements_sent == 16 * 7 // 8 + 2 * (2 * 7 // 8) * 2 + 16 * 7 // 8 + 8 * 7 // 8


def test_bad_rank_and_group_size_are_refused() -> None:
    with pytest.raises(ValueError, match=r"a simulated rank must be in 0\.\.63 \(world_size\), got 64"):
        Simulated(64, N, torch.device("cpu"))
    with pytest.raises(ValueError, match="shard_group_size must divide the simulated world size 64, got 6"):
        CommGroups.simulated(0, N, 6)
    with pytest.raises(RuntimeError, match="a simulated world has no process groups"):
        _comm(0).backend.new_group("gloo", None)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def _groups(model: torch.nn.Module) -> list[dict]:
    hyper = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=False)
    return [
        dict(params=list(model.parameters()), foreach=None, fused=None, decoupled_weight_decay=True, **hyper)
    ]


@pytest.mark.parametrize(("rank", "group"), [(0, None), (37, None), (63, None), (0, 8), (43, 8)])
@pytest.mark.parametrize("stage", [1, 2])
def test_the_engine_runs_as_rank_r_of_n(rank: int, group: int | None, stage: int) -> None:
    model = _model()
    reference = copy.deepcopy(model)
    groups = CommGroups.simulated(rank, N, group)
    config = ZeroConfig(stage=stage, bucket_cap_mb=0.004, first_bucket_cap_mb=0.002)
    engine = ShardEngine(_groups(model), config, groups, AdamRule(), model.parameters())
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    engine.reset_comm_stats()
    model(x).pow(2).mean().backward()
    engine.step()
    reference(x).pow(2).mean().backward()
    torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1).step()

    g = groups.shard.world_size
    assert groups.layout == ("1x64" if group is None else "8x8")
    assert (groups.shard.rank, groups.replicas.rank, groups.world.rank) == (rank % g, rank // g, rank)
    sent = engine.comm_stats.elements_sent
    formula = engine.min_elements_per_step()  # 2 Psi (G-1)/G over the padded buckets
    assert sent == (formula if stage == 2 else formula + formula // 2)  # stage 1: all-reduce + gather
    assert engine.replica_comm_stats.elements_sent == engine.min_replica_elements_per_step()
    assert engine.plan.world_size == g and len({b.padded_numel % g for b in engine.plan.buckets}) == 1
    # this rank's own shard is exact (what the gathers bring for the other ranks' chunks is not)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    want = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    checked = 0
    for bucket in engine.plan.buckets:
        start, end = shard_range(bucket.padded_numel, g, rank % g)
        for slot in bucket.slots:
            lo, hi = max(start, slot.bucket_offset), min(end, slot.bucket_offset + slot.numel)
            if lo < hi:
                offset = sum(p.numel() for p in list(model.parameters())[: slot.param_index])
                index = slice(offset + lo - slot.bucket_offset, offset + hi - slot.bucket_offset)
                torch.testing.assert_close(flat[index], want[index], rtol=1e-6, atol=1e-7)
                checked += hi - lo
    assert checked > 0
