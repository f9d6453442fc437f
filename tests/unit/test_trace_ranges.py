"""Named ranges in profiler traces (issue 43, item 3): a ``torch.profiler`` trace of a step names every
bucket's launch, collection and update, every collective and wait by its group and purpose, every
stage-3 unit's gather and free, and a checkpoint's phases; outside a profiler no range is made."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import lightning_zero.comm.trace as trace
from lightning_zero import ShardedAdamW, ZeroConfig
from lightning_zero.checkpoint import read_meta, save_sharded
from lightning_zero.checkpoint.async_save import AsyncCheckpointWriter
from lightning_zero.checkpoint.reshard import load_sharded, preflight
from lightning_zero.comm import CommGroups
from tests.distributed.models import TinyNet, param_groups


def _names(prof: profile) -> set[str]:
    return {e.name for e in prof.events() if e.name.startswith("lightning_zero")}


def _step(model: torch.nn.Module, opt: ShardedAdamW) -> None:
    model(torch.randn(4, 7 if isinstance(model, TinyNet) else 8, dtype=torch.float64)).pow(
        2
    ).mean().backward()
    opt.step()
    opt.zero_grad()


def test_a_step_names_each_bucket_and_each_collective() -> None:
    torch.manual_seed(0)
    model = TinyNet().double()
    config = ZeroConfig(bucket_cap_mb=0.0001, first_bucket_cap_mb=0.00005)
    opt = ShardedAdamW(param_groups(model), lr=1e-2, config=config, groups=CommGroups.simulated(0, 2))
    buckets = len(opt.engine.plan.buckets)
    assert buckets > 2
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(model, opt)
    names = _names(prof)
    for b in range(buckets):
        for part in ("launch", "collect", "update"):
            assert f"lightning_zero bucket {b}: {part}" in names, (b, part, sorted(names))
    assert "lightning_zero world: gradient reduce-scatter" in names
    assert "lightning_zero world: parameter all-gather" in names
    assert any(
        n.startswith("lightning_zero world: gradient reduce-scatter") and n.endswith("(wait)") for n in names
    )


def test_stage3_names_each_units_gather_and_free() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(3))).double()
    config = ZeroConfig(stage=3, min_unit_numel=1)
    groups = CommGroups.simulated(0, 2)
    opt = ShardedAdamW(model.parameters(), lr=1e-2, config=config, groups=groups, module=model)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(model, opt)
    names = _names(prof)
    for unit in ("0", "1", "2"):
        assert f"lightning_zero unit {unit}: gather" in names, sorted(names)
        assert f"lightning_zero unit {unit}: free" in names, sorted(names)


def test_a_checkpoint_names_its_phases(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyNet().double()
    opt = ShardedAdamW(param_groups(model), lr=1e-2, config=ZeroConfig(bucket_cap_mb=0.0004))
    _step(model, opt)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        save_sharded(opt.engine, tmp_path / "ckpt", {}, {}, 2)
        meta = read_meta(tmp_path / "ckpt")
        preflight(opt.engine, tmp_path / "ckpt", meta)
        load_sharded(opt.engine, tmp_path / "ckpt", meta)
    names = _names(prof)
    for phase in ("stage", "write", "agree and commit", "load"):
        assert f"lightning_zero checkpoint: {phase}" in names, sorted(names)


def test_an_async_checkpoint_names_its_snapshot_and_the_wait_for_it(tmp_path: Path) -> None:
    """The training thread's part: the snapshot (``stage``) and the wait for the background write;
    the write and commit run on the writer's thread, which torch's profiler does not record."""
    torch.manual_seed(0)
    model = TinyNet().double()
    opt = ShardedAdamW(param_groups(model), lr=1e-2, config=ZeroConfig(bucket_cap_mb=0.0004))
    _step(model, opt)
    writer = AsyncCheckpointWriter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        writer.save(opt.engine, tmp_path / "ckpt", {}, {}, 2)
        writer.wait()
    names = _names(prof)
    for phase in ("stage", "wait"):
        assert f"lightning_zero checkpoint: {phase}" in names, sorted(names)
    assert read_meta(tmp_path / "ckpt")["stage"] == 2


def test_outside_a_profiler_no_range_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranges cost one check when nothing records: no profiler range is ever made."""

    def refuse(name: str) -> None:
        raise AssertionError(f"a profiler range {name!r} outside a profiler")

    monkeypatch.setattr(trace, "_record", refuse)
    torch.manual_seed(0)
    model = TinyNet().double()
    config = ZeroConfig(bucket_cap_mb=0.0001)
    opt = ShardedAdamW(param_groups(model), lr=1e-2, config=config, groups=CommGroups.simulated(0, 2))
    _step(model, opt)
