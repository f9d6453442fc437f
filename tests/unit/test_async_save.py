"""AsyncCheckpointWriter at world size 1 (no process group), the writer held at a gate.

The gate (a patched ``lightning_zero.checkpoint._write`` that waits for an event) makes "the save is
still in flight" a fact rather than a race: returns, snapshots, removals after the commit, failures.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, namedtuple
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric.utilities.data import AttributeDict

import lightning_zero.checkpoint.format as checkpoint_module
from lightning_zero import ShardedAdamW, ZeroConfig
from lightning_zero.checkpoint import META, CheckpointError, save_sharded
from lightning_zero.checkpoint.async_save import AsyncCheckpointWriter, HostSnapshot
from tests.distributed.models import TinyNet, param_groups


class Gate:
    """Holds every file write until ``open``; ``fail`` makes the held writes raise instead."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.fail = False

    def open(self) -> None:
        self.opened.set()


def install_gate(monkeypatch: pytest.MonkeyPatch) -> Gate:
    gate, original = Gate(), checkpoint_module._write

    def write(obj: Any, path: Path) -> Any:
        assert gate.opened.wait(timeout=30), "the test never opened the gate"
        if gate.fail:
            raise OSError("injected: disk full")
        return original(obj, path)

    monkeypatch.setattr(checkpoint_module, "_write", write)
    return gate


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    gate = install_gate(monkeypatch)
    yield gate
    gate.open()  # a failing test must not leave the writer thread blocked


def tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in nested dicts and lists, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list | tuple) else []
    return [t for v in values for t in tensors(v)]


def trained(steps: int = 2) -> tuple[TinyNet, ShardedAdamW]:
    torch.manual_seed(0)
    model = TinyNet().double()
    opt = ShardedAdamW(param_groups(model), lr=3e-2, config=ZeroConfig(bucket_cap_mb=0.0004))
    train(model, opt, steps)
    return model, opt


def train(model: TinyNet, opt: ShardedAdamW, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(4, 7, dtype=torch.float64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_save_returns_before_the_commit_and_writes_the_state_it_was_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = trained()
    state = {"loops": {"step": 2}, "callbacks": {"best_k": OrderedDict(a=1.0)}, "score": torch.tensor([1.0])}
    extra = {"frozen": model.frozen.weight.detach()}
    save_sharded(opt.engine, tmp_path / "blocking", state, extra, 2)  # the reference, before any change

    gate = install_gate(monkeypatch)
    writer = AsyncCheckpointWriter()
    try:
        writer.save(opt.engine, tmp_path / "async", state, extra, 2)
        assert writer.pending and not (tmp_path / "async").exists()
        train(model, opt, 2)  # training goes on: parameters and moments change in place
        state["loops"]["step"] = 4
        state["callbacks"]["best_k"]["b"] = 2.0
        state["score"].add_(1.0)
        with torch.no_grad():
            model.frozen.weight.add_(1.0)
    finally:
        gate.open()
    writer.wait()
    assert not writer.pending
    for name in sorted(p.name for p in (tmp_path / "blocking").iterdir()):
        ours, ref = (torch.load(tmp_path / d / name, weights_only=True) for d in ("async", "blocking"))
        if name == META:
            assert ours["lightning"]["loops"] == {"step": 2}
            assert ours["lightning"]["callbacks"] == {"best_k": OrderedDict(a=1.0)}
            assert torch.equal(ours["lightning"]["score"], torch.tensor([1.0]))
            ours, ref = ours["steps"], ref["steps"]
        assert len(tensors(ours)) == len(tensors(ref)) > 0
        assert all(torch.equal(a, b) for a, b in zip(tensors(ours), tensors(ref), strict=True)), name


def test_a_removal_waits_for_the_commit(tmp_path: Path, gate: Gate) -> None:
    _, opt = trained()
    writer = AsyncCheckpointWriter()
    writer.save(opt.engine, tmp_path / "new", {}, {}, 2)
    seen: list[bool] = []
    writer.remove_after_commit(lambda: seen.append((tmp_path / "new" / META).is_file()))
    assert seen == [] and writer.pending
    gate.open()
    writer.wait()
    assert seen == [True]  # ran, and after the commit
    writer.remove_after_commit(lambda: seen.append(False))  # nothing in flight: at once
    assert seen == [True, False]


def test_a_failed_save_keeps_what_it_was_to_replace_and_raises_once(tmp_path: Path, gate: Gate) -> None:
    _, opt = trained()
    (tmp_path / "old").mkdir()
    writer = AsyncCheckpointWriter()
    writer.save(opt.engine, tmp_path / "new", {}, {}, 2)
    removed: list[str] = []
    writer.remove_after_commit(lambda: removed.append("queued behind the failing save"))
    gate.fail = True
    gate.open()
    while writer.pending:
        threading.Event().wait(0.01)
    writer.remove_after_commit(lambda: removed.append("requested after it failed"))
    with pytest.raises(CheckpointError, match="injected: disk full"):
        writer.save(opt.engine, tmp_path / "newer", {}, {}, 2)  # the next save raises, and starts nothing
    assert removed == []
    assert not (tmp_path / "new").exists() and not (tmp_path / "newer").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]  # no temporary directory either
    writer.wait()  # raised once


def test_a_failed_removal_is_raised_at_the_next_wait(tmp_path: Path) -> None:
    writer = AsyncCheckpointWriter()

    def remove() -> None:
        raise PermissionError("injected")

    writer.remove_after_commit(remove)
    with pytest.raises(PermissionError, match="injected"):
        writer.wait()


def test_snapshot_copies_tensors_and_keeps_container_types() -> None:
    Pair = namedtuple("Pair", "a b")
    t = torch.arange(3.0)
    state = {
        "od": OrderedDict(x=t),
        "hp": AttributeDict(lr=0.1, sizes=[1, 2]),
        "pair": Pair(t, (t, 1)),
        "list": [t, {"k": "v"}],
    }
    copied = HostSnapshot().tree(state)
    t.add_(10.0)
    state["hp"]["sizes"].append(3)
    assert type(copied["od"]) is OrderedDict and type(copied["hp"]) is AttributeDict
    assert type(copied["pair"]) is Pair and type(copied["pair"].b) is tuple
    assert torch.equal(copied["od"]["x"], torch.arange(3.0))
    assert torch.equal(copied["pair"].b[0], torch.arange(3.0)) and copied["hp"]["sizes"] == [1, 2]
    assert copied["list"][1] == {"k": "v"} and copied["list"][1] is not state["list"][1]
