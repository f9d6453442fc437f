"""Named ranges on 2 gloo ranks (issue 43, item 3): a ``torch.profiler`` trace of one training step
shows the schedule by name, in its order. One launch; each rank profiles its second step (the first
one fixes stage 3's prefetch order) at stage 2 and at stage 3 and returns the names of the
``lightning_zero`` ranges in the order they opened.

What the order must be (docs/architecture.md, "The life of one training step"):
  * every bucket is launched, collected and updated once per step, in that order, every collection
    before the first update; at stages 1 and 2 the launches go in bucket order and each bucket's
    parameter all-gather follows its update;
  * stage 3: every unit is gathered and freed; a unit other than the last forward's is freed between
    its forward and its backward, the step's last range of every unit is a free, and the updates
    come after every gather and free (the step gathers nothing);
  * both ranks open the same launch, update, gather and free ranges in the same order (collections
    and waits go where the collectives happen to finish, so they may differ).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lightning_zero import ShardedAdamW, ZeroConfig
from tests.distributed.harness import ranks, run_ranks_each
from tests.distributed.models import Block, BlockNet, batch

PREFIX = "lightning_zero "
FIXED = (": launch", ": update", ": gather", ": free")
"""Ranges whose place in the sequence is the program's, not timing's."""


def profiled_step(rank: int, world_size: int, stage: int) -> dict[str, Any]:
    """BlockNet (its blocks stage 3's units) in small buckets; two steps, the second profiled."""
    torch.manual_seed(0)
    model = BlockNet().double()
    units: dict[str, Any] = {"unit_modules": (Block,)} if stage == 3 else {}
    config = ZeroConfig(stage=stage, bucket_cap_mb=0.0005, first_bucket_cap_mb=0.0002, **units)
    opt = ShardedAdamW(model.parameters(), lr=1e-2, config=config, module=model if stage == 3 else None)
    names: list[str] = []
    for step in range(2):
        x, y = batch(step, 0, rank, 4, torch.float64)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        events = sorted(
            (e for e in prof.events() if e.name.startswith(PREFIX)), key=lambda e: e.time_range.start
        )
        names = [e.name.removeprefix(PREFIX) for e in events]
    engine = opt.engine
    unit_names = [] if engine.units is None else [u.name for u in engine.units.units]
    return {"names": names, "buckets": len(engine.plan.buckets), "units": unit_names}


STAGES = (1, 2, 3)


@pytest.fixture(scope="module")
def runs() -> dict[str, list[Any] | RuntimeError]:
    out = run_ranks_each([(profiled_step, (stage,)) for stage in STAGES], 2, timeout_s=300)
    return {f"stage{stage}": result for stage, result in zip(STAGES, out, strict=True)}


def _at(names: list[str], name: str) -> list[int]:
    return [i for i, n in enumerate(names) if n == name]


def _check_buckets(names: list[str], buckets: int) -> None:
    """Each bucket launched, collected and updated once, in that order; every collection before the
    first update."""
    first_update = min(i for i, n in enumerate(names) if n.endswith(": update"))
    for b in range(buckets):
        (launch,), (collect,), (update,) = (
            _at(names, f"bucket {b}: {p}") for p in ("launch", "collect", "update")
        )
        assert launch < collect < first_update <= update, (b, names)
    assert sum(n.startswith("bucket ") for n in names) == 3 * buckets, names


@pytest.mark.parametrize("stage", [1, 2])
def test_a_step_names_each_buckets_launch_collection_and_update_in_order(stage: int, runs: dict) -> None:
    per_rank = ranks(runs, f"stage{stage}")
    for result in per_rank:
        names, buckets = result["names"], result["buckets"]
        assert buckets >= 5, buckets  # enough buckets that an order is a claim
        _check_buckets(names, buckets)
        launches = [int(n.split()[1][:-1]) for n in names if n.endswith(": launch")]
        assert launches == list(range(buckets)), launches  # strictly in bucket order
        updates = [i for i, n in enumerate(names) if n.endswith(": update")]
        for i in updates:  # each bucket's update is followed by its parameter all-gather
            assert names[i + 1] == "world: parameter all-gather", names[i : i + 2]
    assert [n for n in per_rank[0]["names"] if n.endswith(FIXED)] == [
        n for n in per_rank[1]["names"] if n.endswith(FIXED)
    ]


def test_stage3_names_each_units_gather_and_free_in_order(runs: dict) -> None:
    per_rank = ranks(runs, "stage3")
    for result in per_rank:
        names, units = result["names"], result["units"]
        assert units == ["<root>", "blocks.0", "blocks.1", "blocks.2"], units
        _check_buckets(names, result["buckets"])
        first_gathers = sorted(units, key=lambda u: names.index(f"unit {u}: gather"))
        assert first_gathers == units, first_gathers  # forward order
        first_update = min(i for i, n in enumerate(names) if n.endswith(": update"))
        for unit in units:
            gathers, frees = _at(names, f"unit {unit}: gather"), _at(names, f"unit {unit}: free")
            assert gathers and frees, (unit, names)
            assert max(gathers) < max(frees) < first_update, (unit, names)  # freed last, then updated
        for unit in ("blocks.0", "blocks.1"):  # freed after the forward, gathered again for backward
            forward, backward = (
                names.index(f"unit {unit}: gather"),
                max(_at(names, f"unit {unit}: gather")),
            )
            assert any(forward < i < backward for i in _at(names, f"unit {unit}: free")), (unit, names)
        held = _at(names, "unit blocks.2: free")  # the last forward's unit: held into its backward
        assert min(held) > max(_at(names, "unit blocks.2: gather")), names
    assert [n for n in per_rank[0]["names"] if n.endswith(FIXED)] == [
        n for n in per_rank[1]["names"] if n.endswith(FIXED)
    ]
