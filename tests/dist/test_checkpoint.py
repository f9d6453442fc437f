"""Sharded checkpoints: save on N ranks, load on M, continue exactly as one process would."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from lightning_zero.checkpoint import META, read_meta, shard_name
from tests.dist.harness import run_ranks
from tests.dist.models import TinyNet, param_groups
from tests.dist.workers_ckpt import global_batch, load_error, resume_phase, save_phase


def reference_params(steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyNet().double()
    opt = torch.optim.AdamW(param_groups(model), lr=3e-2)
    for step in range(steps):
        x, y = global_batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 0.5)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_state(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for key in a["state"][i]:
            torch.testing.assert_close(a["state"][i][key], b["state"][i][key], rtol=0, atol=0)
    assert [g["lr"] for g in a["param_groups"]] == [g["lr"] for g in b["param_groups"]]


@pytest.mark.parametrize(
    ("saved_on", "loaded_on", "stages"), [(2, 2, (2, 2)), (2, 3, (2, 2)), (3, 2, (1, 2)), (2, 1, (2, 1))]
)
def test_reshard_and_continue_equals_single_process(
    saved_on: int, loaded_on: int, stages: tuple[int, int], tmp_path: Path
) -> None:
    path = str(tmp_path / "ckpt")
    saved_state = run_ranks(save_phase, saved_on, path, stages[0], 5)[0]
    assert sorted(p.name for p in Path(path).iterdir()) == sorted(
        [META, "model_extra.pt"] + [shard_name(r, saved_on) for r in range(saved_on)]
    )
    results = run_ranks(resume_phase, loaded_on, path, stages[1], 5, 5)
    assert_same_state(results[0]["loaded"], saved_state)  # bit-identical state after resharding
    expected = reference_params(10)
    for rank_result in results:
        for name, value in rank_result["final"].items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-10)


def test_same_world_size_resume_is_bit_identical(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_ranks(save_phase, 2, path, 2, 5)
    resumed = run_ranks(resume_phase, 2, path, 2, 5, 5)[0]["final"]
    uninterrupted = run_ranks(save_phase_then_more, 2, str(tmp_path / "other"))[0]
    for name in resumed:
        assert torch.equal(resumed[name], uninterrupted[name]), name


def save_phase_then_more(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    from tests.dist.workers_ckpt import build, train

    model, opt = build(2)
    train(model, opt, range(10), rank, world_size)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    run_ranks(save_phase, 2, str(path), 2, 3)
    return path


def corrupt_copy(saved: Path, tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(saved, target)
    return target


@pytest.mark.parametrize("damage", ["missing", "truncated", "altered"])
def test_damaged_shard_is_named_on_every_rank_and_nothing_changes(
    damage: str, saved: Path, tmp_path: Path
) -> None:
    path = corrupt_copy(saved, tmp_path)
    victim = path / shard_name(1, 2)
    if damage == "missing":
        victim.unlink()
    elif damage == "truncated":
        victim.write_bytes(victim.read_bytes()[:-100])
    else:
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    messages = run_ranks(load_error, 2, str(path), timeout_s=60)
    for message in messages:
        assert (
            shard_name(1, 2) in message
            and {"missing": "missing", "truncated": "truncated", "altered": "altered"}[damage] in message
        )
        assert message.endswith("unchanged=True")


def test_model_mismatch_lists_the_parameters(saved: Path) -> None:
    for message in run_ranks(load_error, 2, str(saved), 14, timeout_s=60):
        assert "shape mismatch" in message and "inp.weight: checkpoint [13, 7] vs model [14, 7]" in message
        assert message.endswith("unchanged=True")


def test_future_format_version_is_refused(saved: Path, tmp_path: Path) -> None:
    path = corrupt_copy(saved, tmp_path)
    meta = torch.load(path / META, weights_only=True)
    torch.save(dict(meta, format_version=99), path / META)
    for message in run_ranks(load_error, 2, str(path), timeout_s=60):
        assert "format version 99" in message and str(path / META) in message


def test_every_file_loads_weights_only(saved: Path) -> None:
    for file in saved.iterdir():
        torch.load(file, weights_only=True)
    assert read_meta(saved)["world_size"] == 2
