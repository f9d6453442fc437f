"""Sharded checkpoints of ``Trainer(strategy=ZeroStrategy(pipeline_parallel_size=2))`` on 4 CPU ranks:
every stage writes its data-parallel shards into one directory (the pipeline rank in the file names),
``meta.pt`` describes the joined model; a fit resumed in the same pipeline layout (stage 2 -> 3), in
none (P=2 -> P=1, the unsplit model on 4 data-parallel ranks) and back (P=1 -> P=2, stage 1,
interleaved) continues the unbroken run of one unsplit model under torch AdamW on the same global
batches (float64, accumulation 2, clipping 0.5, 2 micro-batches), and ``lightning-zero consolidate``,
``load_full_state_dict`` and ``verify`` read the whole model, Adam's moments included (numbered in the
unsplit model's order). One launch (``tests/distributed/pp_checkpoint_fit.py``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_zero.checkpoint import load_full_state_dict
from lightning_zero.checkpoint.consolidate import consolidate
from lightning_zero.cli import verify
from tests.distributed.pp_checkpoint_fit import ACCUM, CLIP, FITS, LR, CheckpointModule, dataset, shifts
from tests.launch import launch_env, run_script

ROOT = Path(__file__).resolve().parents[2]
WORLD = 4
NAMES = [name for name, *_ in FITS]


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("pp_checkpoint_fit") / "result.pt"
    command = [sys.executable, "-m", "tests.distributed.pp_checkpoint_fit", "--out", str(out)]
    proc = run_script(command, WORLD, cwd=ROOT, env=launch_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out, weights_only=False)


def _data(fit: str) -> int:
    pipeline = next(p for name, p, *_ in FITS if name == fit)
    return WORLD // pipeline


@pytest.fixture(scope="module")
def unbroken(launched: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One process, the whole model, torch AdamW, trained without a break on the global batches the four
    fits trained on (batch ``i`` of data-parallel rank ``d`` of a fit: ``seen[d][i]``, rank ``d`` the
    first stage's); the parameters and Adam's state after each fit."""
    torch.set_default_dtype(torch.float64)
    try:
        model = CheckpointModule()
        with torch.no_grad():
            for block, shift in zip(model.blocks, shifts(), strict=True):
                block.get_buffer("shift").copy_(shift)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        inputs, targets, _ = dataset().tensors
        after: dict[str, dict[str, Any]] = {}
        for name in NAMES:
            seen = [launched[d][name]["seen"] for d in range(_data(name))]
            for window in range(len(seen[0]) // ACCUM):
                for micro in range(ACCUM):
                    rows = torch.cat([samples[window * ACCUM + micro] for samples in seen])
                    (F.mse_loss(model(inputs[rows]), targets[rows]) / ACCUM).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                opt.zero_grad()
            after[name] = {
                "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "state": [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()],
            }
        return after
    finally:
        torch.set_default_dtype(torch.float32)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max())


@pytest.mark.parametrize("fit", NAMES)
def test_each_resumed_fit_continues_the_unbroken_unsplit_run(
    fit: str, launched: list[dict[str, Any]], unbroken: dict[str, dict[str, Any]]
) -> None:
    """At the end of each fit every rank's parameters (its stage's) equal the unbroken run's <= 1e-10,
    every parameter held by the data-parallel ranks of one stage, every block's buffer loaded."""
    data = _data(fit)
    expected = unbroken[fit]["params"]
    start = dict(CheckpointModule().named_parameters())
    assert max(_diff(expected[n], start[n]) for n in start) > 1e-2, "barely moved: the test would be vacuous"
    held: dict[str, int] = {}
    for rank, everyone in enumerate(launched):
        result = everyone[fit]
        assert torch.equal(result["seen"], launched[rank % data][fit]["seen"]), "a stage saw other batches"
        for name, param in result["params"].items():
            assert _diff(param, expected[name]) <= 1e-10, (fit, rank, name, _diff(param, expected[name]))
            held[name] = held.get(name, 0) + 1
        for name, buffer in result["buffers"].items():  # each stage's own blocks' buffers, loaded
            assert torch.equal(buffer, shifts()[int(name.split(".")[1])]), (fit, rank, name)
    assert held == {name: data for name in expected}
    background = [everyone[fit]["background"] for everyone in launched]
    assert background == [fit == "b"] * WORLD, "fit b saves in the background, the others at once"


def test_every_stage_writes_its_shards_into_one_directory(launched: list[dict[str, Any]]) -> None:
    """The pipeline rank in the file names of the P=2 checkpoints; none in the P=1 one."""
    paths = {name: Path(launched[0][name]["path"]) for name in NAMES}
    assert len({launched[r]["a"]["path"] for r in range(WORLD)}) == 1
    for name in ("a", "b", "d"):
        shards = sorted(p.name for p in paths[name].glob("shard-*"))
        assert shards == [f"shard-0000{d}-of-00002-pipeline-0{p}-of-02.pt" for d in (0, 1) for p in (0, 1)]
    assert sorted(p.name for p in paths["c"].glob("shard-*")) == [
        f"shard-0000{d}-of-00004.pt" for d in range(4)
    ]
    meta = torch.load(paths["b"] / "meta.pt", weights_only=True)
    assert meta["pipeline"]["size"] == 2 and meta["stage"] == 3
    assert [sorted(meta["pipeline"]["stage_of"]).count(n) for n in meta["pipeline"]["stage_of"]] == [1] * 8


@pytest.mark.parametrize("fit", ["a", "b", "d"])
def test_consolidate_and_load_full_state_dict_read_the_whole_model(
    fit: str, launched: list[dict[str, Any]], unbroken: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """A P=2 checkpoint joined by name: the consolidated file's weights and AdamW state (in the unsplit
    model's parameter order, as ``"ddp"`` would load it) equal the unbroken run's <= 1e-10, every block's
    buffer included; ``load_full_state_dict`` gives the same tensors; ``verify`` passes."""
    path = Path(launched[0][fit]["path"])
    assert verify(path) == 0
    consolidate(path, tmp_path / "model.ckpt")
    checkpoint = torch.load(tmp_path / "model.ckpt", weights_only=True)
    expected = unbroken[fit]
    state_dict = checkpoint["state_dict"]
    assert set(state_dict) == set(expected["params"]) | {f"blocks.{i}.shift" for i in range(len(shifts()))}
    for name, param in expected["params"].items():
        assert _diff(state_dict[name], param) <= 1e-10, name
    for i, shift in enumerate(shifts()):
        assert torch.equal(state_dict[f"blocks.{i}.shift"], shift)
    saved = checkpoint["optimizer_states"][0]
    assert saved["param_groups"][0]["params"] == list(range(len(expected["state"])))
    for index, state in enumerate(expected["state"]):
        assert float(saved["state"][index]["step"]) == float(state["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert _diff(saved["state"][index][key], state[key]) <= 1e-10, (index, key)
    full = load_full_state_dict(path)
    assert full.keys() == state_dict.keys()
    assert all(torch.equal(full[k], v) for k, v in state_dict.items())


def test_validate_with_a_checkpoint_loads_each_stages_whole_parameters(
    launched: list[dict[str, Any]],
) -> None:
    """``validate(ckpt_path=...)`` of a zeroed module at pipeline 2 (no optimizer) takes fit b's weights
    exactly, each stage its own parameters and buffers."""
    for rank, everyone in enumerate(launched):
        loaded, saved = everyone["validated"], everyone["b"]
        assert loaded["params"].keys() == saved["params"].keys() and len(loaded["params"]) == 4, rank
        assert all(torch.equal(loaded["params"][n], p) for n, p in saved["params"].items()), rank
        for name, buffer in loaded["buffers"].items():
            assert torch.equal(buffer, shifts()[int(name.split(".")[1])]), (rank, name)


def test_a_weight_average_with_each_stages_buffers_resumes_as_it_ran(launched: list[dict[str, Any]]) -> None:
    """EMAWeightAveraging at PP2 x DP2: a fit saved at step 2 and resumed to step 4 ends with the averaged
    parameters and buffers of an unbroken fit to step 4, on every stage (each stage's averaged buffers
    travel in the callback's state, written by rank 0 of the first stage)."""
    for rank, everyone in enumerate(launched):
        resumed, unbroken = everyone["averaged"]["resumed"], everyone["averaged"]["unbroken"]
        assert resumed["buffers"].keys() == unbroken["buffers"].keys() != set()
        for kind in ("params", "buffers"):
            for name, value in unbroken[kind].items():
                assert _diff(resumed[kind][name], value) <= 1e-12, (rank, kind, name)
        drifted = CheckpointModule().get_buffer(next(iter(unbroken["buffers"])))
        assert _diff(next(iter(unbroken["buffers"].values())), drifted) > 1e-3, "the buffers never moved"


def test_tensor_parallel_stages_resume_and_consolidate(
    launched: list[dict[str, Any]], tmp_path: Path
) -> None:
    """PP2 x TP2 at stage 3: every (pipeline, tensor) rank writes its shards (the pipeline rank, then
    the tensor rank, in the file names); a fit resumed from step 2 to 4 equals the unbroken fit to 4
    on every stage (<= 1e-12); the consolidated checkpoint holds the whole parameters the saving fit
    ended with."""
    for rank, everyone in enumerate(launched):
        resumed, unbroken = everyone["tensor"]["resumed"]["params"], everyone["tensor"]["unbroken"]["params"]
        assert resumed.keys() == unbroken.keys() != set()
        for name, value in unbroken.items():
            assert _diff(resumed[name], value) <= 1e-12, (rank, name, _diff(resumed[name], value))
    path = Path(launched[0]["tensor"]["saved"]["path"])
    shards = sorted(p.name for p in path.glob("shard-*"))
    names = "shard-00000-of-00001-pipeline-0{}-of-02-tensor-0{}-of-02.pt"
    assert shards == [names.format(p, t) for p in (0, 1) for t in (0, 1)]
    assert verify(path) == 0
    consolidate(path, tmp_path / "model.ckpt")
    state_dict = torch.load(tmp_path / "model.ckpt", weights_only=True)["state_dict"]
    saved = {n: p for everyone in launched for n, p in everyone["tensor"]["saved"]["params"].items()}
    assert set(state_dict) == set(saved) and len(saved) == 16  # 4 blocks of 2 linear layers, on 2 stages
    for name, param in saved.items():
        assert _diff(state_dict[name], param) <= 1e-12, name
