"""``load_full_state_dict`` and ``save_safetensors``: a checkpoint directory written by 2 ranks becomes
the model's own ``state_dict``, bit for bit (float64), and a safetensors export of it loads back equal.

One launch of 2 ranks writes three directories (stage 2, stage 3 with units, a tied weight at stage 2);
each rank returns the model's full ``state_dict`` at the save, the expected value."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_zero import ShardedAdamW, ZeroConfig
from lightning_zero.checkpoint import (
    CheckpointError,
    load_full_state_dict,
    save_safetensors,
    save_sharded,
)
from tests.distributed.harness import ranks, run_ranks_each
from tests.distributed.models import param_groups
from tests.distributed.workers_ckpt import NETS, train

safetensors_torch = pytest.importorskip("safetensors.torch")


class TiedNet(nn.Module):
    """Two layers sharing one weight (saved once, under ``mid.weight``) and a buffer."""

    def __init__(self, width: int = 13) -> None:
        super().__init__()
        self.inp = nn.Linear(7, width)
        self.mid = nn.Linear(width, width)
        self.tied = nn.Linear(width, width)
        self.tied.weight = self.mid.weight
        self.out = nn.Linear(width, 5)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.relu(self.inp(x))) * self.scale)
        return self.out(torch.tanh(self.tied(h)))


def save_for_export(rank: int, world_size: int, path: str, stage: int, net: str) -> dict[str, Any]:
    """Train 3 steps, save the directory with the model's buffers, frozen parameters and tied names;
    return the full ``state_dict`` (one entry per name) and the tied names."""
    torch.manual_seed(0)
    model = (TiedNet() if net == "tied" else NETS[net]()).double()
    units: dict[str, Any] = {"min_unit_numel": 0} if stage == 3 else {}
    opt = ShardedAdamW(
        param_groups(model),
        lr=3e-2,
        config=ZeroConfig(stage=stage, bucket_cap_mb=0.0004, first_bucket_cap_mb=0.0002, **units),
        param_order=model.parameters(),
        param_names={p: n for n, p in model.named_parameters()},
        module=model if stage == 3 else None,
    )
    train(model, opt, range(3), rank, world_size)
    first = {id(p): n for n, p in model.named_parameters()}
    aliases = {
        n: first[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if n != first[id(p)]
    }
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    with opt.full_parameters():
        full = {n: t.detach().clone() for n, t in model.state_dict(keep_vars=True).items()}
    extras = {n: t for n, t in full.items() if n not in trainable and n not in aliases}
    save_sharded(opt.engine, path, {"global_step": 3}, extras, stage, aliases=aliases)
    return {"state_dict": full, "aliases": aliases}


Saved = dict[str, tuple[Path, dict[str, Any]]]  # case -> (directory, rank 0's expected state)
CASES = {"stage2": (2, "tiny"), "stage3": (3, "blocks"), "tied": (2, "tied")}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    tmp = tmp_path_factory.mktemp("export")
    calls = [(save_for_export, (str(tmp / case), stage, net)) for case, (stage, net) in CASES.items()]
    runs = dict(zip(CASES, run_ranks_each(calls, 2, timeout_s=300), strict=True))
    return {case: (tmp / case, ranks(runs, case)[0]) for case in CASES}


def assert_bitwise_equal(ours: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(expected)
    for name, value in expected.items():
        assert ours[name].dtype == value.dtype == torch.float64, name
        assert torch.equal(ours[name], value), name


@pytest.mark.parametrize("case", ["stage2", "stage3"])
def test_full_state_dict_equals_the_models(saved: Saved, case: str) -> None:
    directory, expected = saved[case]
    state_dict = load_full_state_dict(directory)
    assert_bitwise_equal(state_dict, expected["state_dict"])
    assert "frozen.weight" in state_dict  # from model_extra.pt, not the shards


def test_tied_weight_is_one_tensor(saved: Saved) -> None:
    directory, expected = saved["tied"]
    assert expected["aliases"] == {"tied.weight": "mid.weight"}
    state_dict = load_full_state_dict(directory)
    assert_bitwise_equal(state_dict, expected["state_dict"])
    assert state_dict["tied.weight"] is state_dict["mid.weight"]
    assert "scale" in state_dict


def test_safetensors_single_file_round_trip(saved: Saved, tmp_path: Path) -> None:
    state_dict = load_full_state_dict(saved["stage3"][0])
    written = save_safetensors(state_dict, tmp_path / "out")
    assert written == [tmp_path / "out" / "model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    assert_bitwise_equal(safetensors_torch.load_file(written[0]), state_dict)


def test_safetensors_sharded_with_index(saved: Saved, tmp_path: Path) -> None:
    state_dict = load_full_state_dict(saved["stage2"][0])
    largest = max(t.numel() * t.element_size() for t in state_dict.values())
    written = save_safetensors(state_dict, tmp_path, max_shard_bytes=largest)
    *files, index_file = written
    count = len(files)
    assert count >= 2 and index_file.name == "model.safetensors.index.json"
    assert [f.name for f in files] == [
        f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)
    ]
    index = json.loads(index_file.read_text())
    assert sorted(index["weight_map"]) == sorted(state_dict)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state_dict.values())
    loaded: dict[str, torch.Tensor] = {}
    for file in files:
        part = safetensors_torch.load_file(file)
        assert sum(t.numel() * t.element_size() for t in part.values()) <= largest
        assert all(index["weight_map"][name] == file.name for name in part)
        loaded.update(part)
    assert_bitwise_equal(loaded, state_dict)


def test_safetensors_tied_weight_written_once(saved: Saved, tmp_path: Path) -> None:
    from safetensors import safe_open

    state_dict = load_full_state_dict(saved["tied"][0])
    (file,) = save_safetensors(state_dict, tmp_path)
    loaded = safetensors_torch.load_file(file)
    assert "tied.weight" not in loaded and "mid.weight" in loaded
    with safe_open(file, framework="pt") as f:
        metadata = f.metadata()
    assert metadata["format"] == "pt"
    aliases = json.loads(metadata["aliases"])
    assert aliases == {"tied.weight": "mid.weight"}
    loaded.update({alias: loaded[name] for alias, name in aliases.items()})
    assert_bitwise_equal(loaded, state_dict)
    # sharded: the alias goes in the index's metadata, not in its weight_map
    *_, index_file = save_safetensors(state_dict, tmp_path / "sharded", max_shard_bytes=1)
    index = json.loads(index_file.read_text())
    assert index["metadata"]["aliases"] == aliases and "tied.weight" not in index["weight_map"]


def test_refusals(saved: Saved, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = saved["stage2"][0]
    single = tmp_path / "model.ckpt"
    torch.save({"state_dict": {}}, single)
    with pytest.raises(CheckpointError, match=rf"{single} is not a sharded checkpoint directory.*meta\.pt"):
        load_full_state_dict(single)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=rf"{empty}.*meta\.pt does not exist"):
        load_full_state_dict(empty)
    state_dict = load_full_state_dict(directory)
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("mine\n")
    with pytest.raises(FileExistsError, match=rf"{out} is not empty; pass overwrite=True"):
        save_safetensors(state_dict, out)
    assert sorted(p.name for p in out.iterdir()) == ["README.md"]
    save_safetensors(state_dict, out, max_shard_bytes=1, overwrite=True)  # an older split, replaced below
    assert save_safetensors(state_dict, out, overwrite=True) == [out / "model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "model.safetensors"]
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "safetensors.torch", None)  # as if not installed
        with pytest.raises(ImportError, match="pip install safetensors"):
            save_safetensors(state_dict, tmp_path / "never")
    assert not (tmp_path / "never").exists()
