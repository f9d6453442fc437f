"""Sharded checkpoints: save on N ranks, load on M, continue exactly as one process would.

Every distributed run goes in a module fixture of two rounds, one launch per world size each: the saves,
then (after the damaged copies are made) the resumes and the refused loads. Each test reads its own
runs by name."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero.checkpoint import META, read_meta, shard_name
from tests.distributed.harness import ranks, run_ranks_each
from tests.distributed.models import param_groups
from tests.distributed.workers_ckpt import NETS, global_batch, load_error, resume_phase, save_phase


def reference_params(steps: int, net: str = "tiny") -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = NETS[net]().double()
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


RESHARD = [  # (saved on, loaded on, (stage saved, loaded), model): stage 3's buckets follow its units
    (2, 3, (2, 2), "tiny"),
    (3, 2, (1, 2), "tiny"),
    (2, 1, (2, 1), "tiny"),
    (2, 3, (3, 2), "blocks"),
    (2, 1, (3, 3), "blocks"),
    (3, 2, (2, 3), "blocks"),
]
DAMAGES = ["missing", "truncated", "altered"]


def save_phase_then_more(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    from tests.distributed.workers_ckpt import build, train

    model, opt = build(2)
    train(model, opt, range(10), rank, world_size)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def corrupt_copy(saved: Path, target: Path) -> Path:
    shutil.copytree(saved, target)
    return target


def damage_shard(path: Path, damage: str) -> None:
    victim = path / shard_name(1, 2)
    if damage == "missing":
        victim.unlink()
    elif damage == "truncated":
        victim.write_bytes(victim.read_bytes()[:-100])
    else:
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))


def run_round(named: dict[str, tuple[int, Callable[..., Any], tuple]]) -> dict[str, list[Any] | RuntimeError]:
    """The named ``(world size, worker, arguments)`` runs, one launch per world size, in the given order."""
    results: dict[str, list[Any] | RuntimeError] = {}
    for world_size in sorted({size for size, _, _ in named.values()}):
        names = [name for name, (size, _, _) in named.items() if size == world_size]
        out = run_ranks_each([named[name][1:] for name in names], world_size, timeout_s=300)
        results.update(zip(names, out, strict=True))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[Any] | RuntimeError]]:
    """Round 1 saves (``saved``: 3 steps on 2 ranks, stage 2, the source of the damaged copies); round 2
    resumes and loads what round 1 wrote."""
    tmp = tmp_path_factory.mktemp("checkpoint")
    saves: dict[str, tuple[int, Callable[..., Any], tuple]] = {
        f"save_{a}_{b}_s{s[0]}{s[1]}_{net}": (
            a,
            save_phase,
            (str(tmp / f"reshard_{a}_{b}_s{s[0]}{s[1]}_{net}"), s[0], 5, net),
        )
        for a, b, s, net in RESHARD
    }
    saves["same_save"] = (2, save_phase, (str(tmp / "same"), 2, 5))
    saves["same_uninterrupted"] = (2, save_phase_then_more, (str(tmp / "other"),))
    saves["saved"] = (2, save_phase, (str(tmp / "saved"), 2, 3))
    results = run_round(saves)
    ranks(results, "saved")
    for damage in DAMAGES:
        damage_shard(corrupt_copy(tmp / "saved", tmp / f"damaged_{damage}"), damage)
    future = corrupt_copy(tmp / "saved", tmp / "future")
    meta = torch.load(future / META, weights_only=True)
    torch.save(dict(meta, format_version=99), future / META)
    loads: dict[str, tuple[int, Callable[..., Any], tuple]] = {
        f"resume_{a}_{b}_s{s[0]}{s[1]}_{net}": (
            b,
            resume_phase,
            (str(tmp / f"reshard_{a}_{b}_s{s[0]}{s[1]}_{net}"), s[1], 5, 5, 0.0004, net),
        )
        for a, b, s, net in RESHARD
    }
    loads["same_resumed"] = (2, resume_phase, (str(tmp / "same"), 2, 5, 5))
    for damage in DAMAGES:
        loads[f"damaged_{damage}"] = (2, load_error, (str(tmp / f"damaged_{damage}"),))
    loads["mismatch"] = (2, load_error, (str(tmp / "saved"), 14))
    loads["future"] = (2, load_error, (str(future),))
    results.update(run_round(loads))
    return tmp, results


@pytest.mark.parametrize(
    # 2 -> 2 is test_same_world_size_resume_is_bit_identical's (and the Fabric tests reload 2 -> 2 too)
    ("saved_on", "loaded_on", "stages", "net"),
    RESHARD,
)
def test_reshard_and_continue_equals_single_process(
    saved_on: int, loaded_on: int, stages: tuple[int, int], net: str, runs: tuple[Path, dict]
) -> None:
    """Across world sizes and stages: stage 3 saves the same format, and loads any other stage's."""
    run = f"{saved_on}_{loaded_on}_s{stages[0]}{stages[1]}_{net}"
    path = runs[0] / f"reshard_{run}"
    saved_state = ranks(runs[1], f"save_{run}")[0]
    assert sorted(p.name for p in Path(path).iterdir()) == sorted(
        [META, "model_extra.pt"] + [shard_name(r, saved_on) for r in range(saved_on)]
    )
    results = ranks(runs[1], f"resume_{run}")
    assert_same_state(results[0]["loaded"], saved_state)  # bit-identical state after resharding
    expected = reference_params(10, net)
    for rank_result in results:
        for name, value in rank_result["final"].items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-10)


def test_same_world_size_resume_is_bit_identical(runs: tuple[Path, dict]) -> None:
    ranks(runs[1], "same_save")
    resumed = ranks(runs[1], "same_resumed")[0]["final"]
    uninterrupted = ranks(runs[1], "same_uninterrupted")[0]
    for name in resumed:
        assert torch.equal(resumed[name], uninterrupted[name]), name


@pytest.fixture(scope="module")
def saved(runs: tuple[Path, dict]) -> Path:
    ranks(runs[1], "saved")
    return runs[0] / "saved"


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_shard_is_named_on_every_rank_and_nothing_changes(
    damage: str, runs: tuple[Path, dict]
) -> None:
    messages = ranks(runs[1], f"damaged_{damage}")
    # the problem as stated after the file's name (the directory names hold the damage words too)
    problem = {"missing": ": missing", "truncated": "(truncated or replaced)", "altered": ": sha256 mismatch"}
    for message in messages:
        line = next(line for line in message.splitlines() if shard_name(1, 2) in line)
        assert problem[damage] in line.split(shard_name(1, 2), 1)[1], (damage, line)
        assert message.endswith("unchanged=True")


def test_model_mismatch_lists_the_parameters(runs: tuple[Path, dict]) -> None:
    for message in ranks(runs[1], "mismatch"):
        assert "shape mismatch" in message and "inp.weight: checkpoint [13, 7] vs model [14, 7]" in message
        assert message.endswith("unchanged=True")


def test_future_format_version_is_refused(runs: tuple[Path, dict]) -> None:
    path = runs[0] / "future"
    for message in ranks(runs[1], "future"):
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
    path = corrupt_copy(saved, tmp_path / "ckpt")
    (path / shard_name(0, 2)).write_bytes(b"garbage")
    (path / "stray.pt").write_bytes(b"")
    assert main(["verify", str(path)]) == 1
    report = capsys.readouterr().out
    assert f"FAIL {path / shard_name(0, 2)}" in report and "stray.pt: not part of this checkpoint" in report
    assert main(["verify", str(tmp_path / "nope")]) == 1


def test_estimate_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_zero.cli import main

    assert main(["estimate", "--params", "1e9", "--world-size", "8", "--precision", "32-true"]) == 0
    lines = {line.split()[0]: float(line.split()[1]) for line in capsys.readouterr().out.splitlines()[1:5]}
    # fp32 Adam: DDP 20 bytes/param (with its bucket copy); zero2 4 + 12/8 bytes/param + 75 MiB in flight
    assert lines["ddp"] == pytest.approx(20e9 / 2**30, rel=1e-3)
    assert lines["zero2"] == pytest.approx((5.5e9 + 75 * 2**20) / 2**30, rel=1e-3)
    assert lines["zero3"] == pytest.approx((2e9 + 75 * 2**20) / 2**30, abs=0.006)  # 16/8 bytes/param
    argv = ["estimate", "--params", "1e9", "--world-size", "8", "--stage", "3", "--unit-params", "1e7"]
    assert main([*argv, "--precision", "bf16-true"]) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:3]]
    assert rows == ["ddp", "zero3"]


def test_estimate_cli_with_node_aware_sharding(capsys: pytest.CaptureFixture[str]) -> None:
    """``--shard-group-size G``: the state is split over G ranks, not the world (fp32: zero2 holds
    4 + 12/G bytes per parameter); a G that does not divide the world is refused, naming the valid ones."""
    from lightning_zero.cli import main

    argv = [
        "estimate",
        "--params",
        "1e9",
        "--world-size",
        "8",
        "--precision",
        "32-true",
        "--shard-group-size",
        "2",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert "8 ranks sharded in groups of 2 (replicated 4x)" in out[0]
    lines = {line.split()[0]: float(line.split()[1]) for line in out[1:5]}
    assert lines["zero2"] == pytest.approx((10e9 + 75 * 2**20) / 2**30, rel=1e-3)
    with pytest.raises(SystemExit):
        main([*argv[:-1], "3"])
    assert "--shard-group-size: shard_group_size=3 must divide the 8 data-parallel ranks" in (
        err := capsys.readouterr().err
    )
    assert "one of [1, 2, 4, 8]" in err
