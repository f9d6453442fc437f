"""Sharded checkpoints: save on N ranks, load on M, continue exactly as one process would."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from lightning_zero.checkpoint import META, read_meta, shard_name
from tests.distributed.harness import run_ranks
from tests.distributed.models import TinyNet, param_groups
from tests.distributed.workers_ckpt import global_batch, load_error, resume_phase, save_phase


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
    # 2 -> 2 is test_same_world_size_resume_is_bit_identical's (and the Fabric tests reload 2 -> 2 too)
    ("saved_on", "loaded_on", "stages"),
    [(2, 3, (2, 2)), (3, 2, (1, 2)), (2, 1, (2, 1))],
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
    from tests.distributed.workers_ckpt import build, train

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


def test_verify_cli_reports_and_exits(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_zero.cli import main

    assert main(["verify", str(saved)]) == 0
    report = capsys.readouterr().out
    assert "world size 2" in report and report.rstrip().endswith("OK")
    path = corrupt_copy(saved, tmp_path)
    (path / shard_name(0, 2)).write_bytes(b"garbage")
    (path / "stray.pt").write_bytes(b"")
    assert main(["verify", str(path)]) == 1
    report = capsys.readouterr().out
    assert f"FAIL {path / shard_name(0, 2)}" in report and "stray.pt: not part of this checkpoint" in report
    assert main(["verify", str(tmp_path / "nope")]) == 1


def test_estimate_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_zero.cli import main

    assert main(["estimate", "--params", "1e9", "--world-size", "8", "--precision", "32-true"]) == 0
    lines = {line.split()[0]: float(line.split()[1]) for line in capsys.readouterr().out.splitlines()[1:4]}
    # fp32 Adam: DDP 20 bytes/param (with its bucket copy); zero2 4 + 12/8 bytes/param + 75 MiB in flight
    assert lines["ddp"] == pytest.approx(20e9 / 2**30, rel=1e-3)
    assert lines["zero2"] == pytest.approx((5.5e9 + 75 * 2**20) / 2**30, rel=1e-3)
