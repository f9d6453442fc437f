"""Issue 39, the collective order when ranks use different parameters inside a unit, checked on
simulated ranks (``CommGroups.simulated``: rank ``r`` of ``N`` in this process, its collectives logged
in a list): each rank trains the same model on its own data, so a gate, a router's experts or an
auxiliary head get gradients on some ranks and not on others, and ``compare_ranks`` (the recorder's
rules: per group, and interleaved across groups) must find every rank's sequence the same, at every
stage, flat and node-aware. At stage 3 it used not to be: the buckets launched from the gradient hooks
in bucket order, a bucket waiting for a gradient held the later ones, and the units' backward gathers
went between them at places that followed the data."""

from __future__ import annotations

import pytest
import torch

from lightning_zero import ShardedAdamW, ZeroConfig
from lightning_zero.comm import CommGroups
from lightning_zero.comm.recorder import Entry, compare_ranks
from tests.distributed.paths_models import KINDS, UNITS, PathNet, batch, loss_of, path_of

WORLD = 4


def _log(kind: str, stage: int, rank: int, group: int | None, find_unused: bool) -> list[Entry]:
    log: list[Entry] = []
    torch.manual_seed(0)
    model = PathNet(kind).double()
    config = ZeroConfig(
        stage=stage,
        bucket_cap_mb=0.0004,
        first_bucket_cap_mb=0.0002,
        find_unused_parameters=find_unused,
        **({"unit_modules": UNITS, "min_unit_numel": 0} if stage == 3 else {}),
    )
    groups = CommGroups.simulated(rank, WORLD, group, log=log)
    opt = ShardedAdamW(model.parameters(), lr=1e-2, config=config, groups=groups, module=model)
    for step in range(4):
        for micro in range(2):
            x, y = batch(step, micro, rank)
            with opt.no_sync() if micro == 0 else _nothing():
                (loss_of(model(x, path_of(step, micro, rank)), y) / 2).backward()
        opt.step()
        opt.zero_grad()
    return log


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.filterwarnings("ignore:parameter .* got no gradient")
@pytest.mark.parametrize("group", [None, 2], ids=["flat", "2x2"])
@pytest.mark.parametrize("find_unused", [True, False], ids=["find_unused", "zeros"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_ranks_that_use_different_parameters_issue_the_same_collectives(
    kind: str, stage: int, find_unused: bool, group: int | None
) -> None:
    logs = {rank: _log(kind, stage, rank, group, find_unused) for rank in range(WORLD)}
    assert compare_ranks("simulated", logs) == []
    ops = [e.op for e in logs[0]]
    assert "reduce_scatter" in ops or "all_reduce_sum" in ops


def test_the_check_sees_the_order_a_bucket_launched_from_its_hooks_would_give(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The test above can fail: with stage 3's buckets launched as stage 2's are (from the gradient
    hooks, in bucket order), the gate model's ranks issue different sequences."""
    from lightning_zero.engine import reducer

    init = reducer.GradReducer.__init__

    def from_hooks(self: reducer.GradReducer, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        self._by_unit = False

    monkeypatch.setattr(reducer.GradReducer, "__init__", from_hooks)
    monkeypatch.setattr(reducer.GradReducer, "launch_units", lambda self, units: None)
    logs = {rank: _log("gate", 3, rank, None, True) for rank in range(WORLD)}
    problems = compare_ranks("simulated", logs)
    assert problems and "reduce_scatter" in problems[0], problems


class _Child(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class _Parent(torch.nn.Module):
    """A unit holding a unit: its own parameters are used after the child's forward, one of them only
    where ``gate`` is set (so the parent's own gradients all arrive on some ranks and not others)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Child()
        self.out = torch.nn.Linear(8, 8)
        self.gate = torch.nn.Parameter(torch.ones(8))
        self.use_gate = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.out(self.inner(x))
        return h * self.gate if self.use_gate else h


def _nested_log(rank: int) -> list[Entry]:
    log: list[Entry] = []
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), _Parent(), torch.nn.Linear(8, 2)).double()
    config = ZeroConfig(stage=3, unit_modules=(_Parent, _Child), find_unused_parameters=True)
    opt = ShardedAdamW(
        model.parameters(), config=config, groups=CommGroups.simulated(rank, 2, log=log), module=model
    )
    for step in range(2):
        model[1].use_gate = (step + rank) % 2 == 0
        model(torch.randn(3, 4, dtype=torch.float64)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return log


def test_a_unit_whose_own_gradients_all_arrived_on_one_rank_is_not_gathered_again_there() -> None:
    """A parent unit whose own parameters are all used after its child's forward has all its gradients
    before the child's backward on the ranks that used its gate, and is freed there; the child's
    backward hook prefetches the unit before it, the parent: a gather on those ranks only, unless a
    unit whose gradients all arrived is done with for that backward on every rank."""
    logs = {rank: _nested_log(rank) for rank in (0, 1)}
    assert compare_ranks("simulated", logs) == []
