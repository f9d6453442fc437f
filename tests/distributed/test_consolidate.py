"""`lightning-zero consolidate`: a directory becomes the file a "ddp" run would have written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_zero.cli import main
from tests.distributed.test_lightning_parity import ROOT, launch, max_diff

# 32-true: Lightning's single-device and "ddp" strategies load a checkpoint *before* converting a
# 64-true model, rounding it through float32 (1e-8), while "zero" loads after; in fp32 both are exact.
CASE = {
    "devices": 3,
    "stage": 2,
    "accum": 2,
    "clip": 0.05,
    "steps": 5,
    "batch_size": 4,
    "identical_batches": True,
    "unused_every": 0,
    "precision": "32-true",
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("consolidate")
    launch(
        [
            dict(CASE, save=str(tmp / "dir.ckpt")),
            dict(CASE, save=str(tmp / "file.ckpt"), sharded_checkpoint=False),
        ],
        tmp,
    )
    return tmp / "dir.ckpt", tmp / "file.ckpt"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The command as a user runs it (one fresh interpreter: ~8 s of imports on a small machine)."""
    return subprocess.run(
        [sys.executable, "-m", "lightning_zero.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def cli_here(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """The same command's ``main`` in this process: (exit status, stdout)."""
    capsys.readouterr()
    status = main(list(args))
    return status, capsys.readouterr().out


def test_consolidated_equals_gathered_single_file(checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    directory, gathered = checkpoints
    out = tmp_path / "consolidated.ckpt"
    result = cli("consolidate", str(directory), str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    ours = torch.load(out, weights_only=True)
    ref = torch.load(gathered, weights_only=True)
    assert ours["state_dict"].keys() == ref["state_dict"].keys()
    for name, value in ref["state_dict"].items():
        assert torch.equal(ours["state_dict"][name], value), name
    opt, ref_opt = ours["optimizer_states"][0], ref["optimizer_states"][0]
    assert opt["state"].keys() == ref_opt["state"].keys()
    for i, entry in ref_opt["state"].items():
        for key, value in entry.items():
            assert torch.equal(opt["state"][i][key], value), (i, key)
    assert [g["params"] for g in opt["param_groups"]] == [g["params"] for g in ref_opt["param_groups"]]
    assert [g["lr"] for g in opt["param_groups"]] == [g["lr"] for g in ref_opt["param_groups"]]
    assert ours["global_step"] == ref["global_step"] == 5 and ours["lr_schedulers"] == ref["lr_schedulers"]


def test_consolidated_file_resumes_under_ddp(
    checkpoints: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory, _ = checkpoints
    out = tmp_path / "for_ddp.ckpt"
    assert cli_here(capsys, "consolidate", str(directory), str(out))[0] == 0
    ddp, zero = launch(  # one launch, the two fits in turn
        [
            dict(CASE, strategy="ddp", devices=2, batch_size=6, steps=8, resume=str(out)),
            dict(CASE, devices=2, batch_size=6, steps=8, resume=str(directory)),
        ],
        tmp_path,
    )
    assert max_diff(ddp, zero) <= 1e-5  # fp32 summation order only


def test_weights_only_and_refusals(
    checkpoints: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory, gathered = checkpoints
    out = tmp_path / "weights.ckpt"
    assert cli_here(capsys, "consolidate", str(directory), str(out), "--weights-only")[0] == 0
    weights = torch.load(out, weights_only=True)
    assert (
        "optimizer_states" not in weights
        and weights["state_dict"].keys() == torch.load(gathered, weights_only=True)["state_dict"].keys()
    )
    status, stdout = cli_here(capsys, "consolidate", str(directory), str(out))
    assert status == 1 and "exists; pass --force" in stdout
    broken = tmp_path / "broken.ckpt"
    broken.mkdir()
    status, stdout = cli_here(capsys, "consolidate", str(broken), str(tmp_path / "never.ckpt"))
    assert status == 1 and "meta.pt does not exist" in stdout
    assert not (tmp_path / "never.ckpt").exists()


def test_consolidated_file_loads_without_lightning_zero(
    checkpoints: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory, _ = checkpoints
    out = tmp_path / "plain.ckpt"
    assert cli_here(capsys, "consolidate", str(directory), str(out))[0] == 0
    code = (
        "import sys; sys.modules['lightning_zero'] = None\n"  # any import of it now fails
        "from tests.distributed.lit_fit import TinyLit\n"
        f"model = TinyLit.load_from_checkpoint({str(out)!r}, weights_only=True)\n"
        "print('loaded', sum(p.numel() for p in model.parameters()))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "loaded 395" in result.stdout, result.stderr[-3000:]
