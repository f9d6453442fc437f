"""Stage 3 at its boundaries, at world size 1 (no process group): writes into a freed parameter, a
unit whose forward returns a dataclass or another object, and ``unshard`` back to a plain module."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import lightning_zero
from lightning_zero import ShardedAdamW, ZeroConfig
from lightning_zero.layout.placeholders import FreedParameterError
from tests.distributed.models import Block, BlockNet, batch, hooks_left


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x, y = batch(step, 0, 0, 4, torch.float64)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


# ---- writes into a freed parameter ---------------------------------------------------------------


class _Tempered(BlockNet):
    """BlockNet whose root holds a one-element parameter (a temperature)."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        return super().forward(x, use_extra) / self.temperature


WRITES: dict[str, tuple[str, Callable[[Any], object]]] = {  # Any: submodules by index
    "init.zeros_": ("blocks.0.fc.weight", lambda m: nn.init.zeros_(m.blocks[0].fc.weight)),
    "init.ones_": ("out.bias", lambda m: nn.init.ones_(m.out.bias)),
    "init.constant_": ("inp.weight", lambda m: nn.init.constant_(m.inp.weight, 0.5)),
    "fill_": ("blocks.1.gate", lambda m: m.blocks[1].gate.fill_(0.0)),
    ".data.zero_": ("blocks.2.norm.bias", lambda m: m.blocks[2].norm.bias.data.zero_()),
    "copy_": ("out.weight", lambda m: m.out.weight.copy_(torch.zeros(5, 13))),
    "one element add_": ("temperature", lambda m: m.temperature.add_(1.0)),
    "one element .data.mul_": ("temperature", lambda m: m.temperature.data.mul_(2.0)),
    "one element +=": ("temperature", lambda m: m.temperature.__iadd__(1.0)),
    "one element setitem": ("temperature", lambda m: m.temperature.__setitem__(0, 2.0)),
}


@pytest.mark.parametrize("write", list(WRITES))
def test_a_write_into_a_freed_parameter_raises_naming_it_and_no_other_parameter_changes(write: str) -> None:
    """Between steps every parameter is a placeholder: ``fill_``/``zero_`` (``nn.init``'s constants) and
    any in-place op, on a parameter of one element too, fail at that operation, naming the parameter
    and the way to full parameters; no placeholder reads anything but NaN afterwards, and the full
    values are those before the write."""
    torch.manual_seed(0)
    model = _Tempered().double()
    config = ZeroConfig(stage=3, min_unit_numel=0)
    opt = ShardedAdamW(_trainable(model), lr=1e-2, config=config, module=model)
    _train(model, opt, range(2))
    with opt.full_parameters():
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    name, fn = WRITES[write]
    with (
        torch.no_grad(),
        pytest.raises(FreedParameterError, match=rf"'{name}'.*gathered\(module, writeback=True\)"),
    ):
        fn(model)
    for other, param in model.named_parameters():
        if param.requires_grad:
            with pytest.raises(FreedParameterError, match=rf"isnan reads parameter '{other}'"):
                torch.isnan(param)
    with opt.full_parameters():
        for other, param in model.named_parameters():
            if param.requires_grad:
                assert torch.equal(param, before[other]), other
    _train(model, opt, range(2, 3))  # the parameters are still the engine's: training goes on


READS: dict[str, tuple[str, Callable[[Any], object]]] = {
    "sum": ("blocks.0.fc.weight", lambda m: m.blocks[0].fc.weight.sum()),
    "clone": ("out.bias", lambda m: m.out.bias.clone()),
    "detach().clone()": ("inp.weight", lambda m: m.inp.weight.detach().clone()),
    ".data arithmetic": ("blocks.1.gate", lambda m: m.blocks[1].gate.data * 2),
    "torch.norm": ("out.weight", lambda m: torch.norm(m.out.weight)),
    "float() of one element": ("temperature", lambda m: float(m.temperature)),
    "indexing": ("blocks.2.norm.bias", lambda m: m.blocks[2].norm.bias[0]),
    "copy from": ("out.weight", lambda m: torch.zeros(5, 13, dtype=torch.float64).copy_(m.out.weight)),
    "to another dtype": ("temperature", lambda m: m.temperature.float()),
}


@pytest.mark.parametrize("read", list(READS))
def test_a_read_of_a_freed_parameter_raises_naming_it(read: str) -> None:
    """Reading a value of a freed parameter (not NaN silently) fails at the op, naming the parameter and
    ``lightning_zero.gathered``; reading its metadata does not."""
    torch.manual_seed(0)
    model = _Tempered().double()
    ShardedAdamW(_trainable(model), lr=1e-2, config=ZeroConfig(stage=3, min_unit_numel=0), module=model)
    name, fn = READS[read]
    with pytest.raises(
        FreedParameterError, match=rf"reads parameter '{name}'.*lightning_zero\.gathered\(module\)"
    ):
        fn(model)
    param = model.get_parameter(name)
    assert (param.shape, param.dtype, param.numel(), param.requires_grad, param.grad) == (
        param.shape,
        torch.float64,
        param.numel(),
        True,
        None,
    )
    model.to(param.device)  # where it already is: nothing read, nothing moved


def test_gathered_gives_one_submodule_its_full_parameters_and_writes_back_on_request() -> None:
    """``lightning_zero.gathered(block)`` gathers that block's unit only; with ``writeback=True`` the
    values written inside are the shards' (and the optimizer's masters') after it."""
    torch.manual_seed(0)
    model = _Tempered().double()
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = ShardedAdamW(_trainable(model), lr=1e-2, config=ZeroConfig(stage=3, min_unit_numel=0), module=model)
    with lightning_zero.gathered(model.blocks[1]) as block:
        assert block is model.blocks[1]
        assert torch.equal(block.gate, expected["blocks.1.gate"])
        with pytest.raises(FreedParameterError):
            model.blocks[0].fc.weight.sum()  # another unit stays sharded
    with pytest.raises(FreedParameterError):
        model.blocks[1].gate.sum()  # freed again at the exit
    with lightning_zero.gathered(model.blocks[1], writeback=True), torch.no_grad():
        model.blocks[1].gate.fill_(0.25)
    with lightning_zero.gathered(model):
        for name, param in model.named_parameters():
            want = torch.full_like(param, 0.25) if name == "blocks.1.gate" else expected[name]
            assert torch.equal(param, want), name
    _train(model, opt, range(1))


# ---- a unit's output of another type -------------------------------------------------------------


@dataclass
class _BlockOut:
    h: torch.Tensor
    scale: float


class _DataclassBlock(Block):
    def forward(self, h: torch.Tensor, use_gate: bool) -> _BlockOut:  # type: ignore[override]
        return _BlockOut(super().forward(h, use_gate), 1.0)


class _Opaque:
    """Neither a pytree node nor a dataclass: the tensor it holds cannot be found."""

    def __init__(self, h: torch.Tensor) -> None:
        self.h = h


class _OpaqueBlock(Block):
    def forward(self, h: torch.Tensor, use_gate: bool) -> _Opaque:  # type: ignore[override]
        return _Opaque(super().forward(h, use_gate))


class _UnwrappingNet(BlockNet):
    """BlockNet whose blocks return an object holding the hidden state as ``.h``."""

    def __init__(self, block: type[Block] | None) -> None:
        super().__init__()
        if block is not None:
            self.blocks = nn.ModuleList(block(13) for _ in range(3))

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = torch.tanh(self.frozen(torch.relu(self.inp(x))))
        for i, block in enumerate(self.blocks):
            out = block(h, use_extra and i == 1)
            h = out if isinstance(out, torch.Tensor) else out.h
        return self.out(h)


def test_a_unit_returning_a_dataclass_trains_as_adamw() -> None:
    """The unit's backward hook finds the tensors in the dataclass's fields."""
    torch.manual_seed(0)
    model, reference = _UnwrappingNet(_DataclassBlock).double(), BlockNet().double()
    reference.load_state_dict(model.state_dict())
    config = ZeroConfig(stage=3, min_unit_numel=0, find_unused_parameters=True)  # gates 0 and 2: None
    opt = ShardedAdamW(_trainable(model), lr=1e-2, config=config, module=model)
    ref_opt = torch.optim.AdamW(_trainable(reference), lr=1e-2)
    _train(model, opt, range(3))
    _train(reference, ref_opt, range(3))
    with opt.full_parameters():
        for a, b in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-14)


def test_a_unit_returning_another_object_is_refused_at_its_forward_naming_it() -> None:
    """An object whose tensors cannot be found would leave the unit without its backward gather; a
    forward without gradients (evaluation) needs none and runs."""
    torch.manual_seed(0)
    model = _UnwrappingNet(_OpaqueBlock).double()
    ShardedAdamW(_trainable(model), config=ZeroConfig(stage=3, min_unit_numel=0), module=model)
    x, _ = batch(0, 0, 0, 4, torch.float64)
    with torch.no_grad():
        assert torch.isfinite(model(x)).all()
    with pytest.raises(TypeError, match=r"unit 'blocks\.0'.*_Opaque"):
        model(x)


# ---- unshard -------------------------------------------------------------------------------------


def test_unshard_leaves_a_plain_module_that_a_new_adamw_trains_as_one_never_sharded() -> None:
    torch.manual_seed(0)
    model = BlockNet().double()
    config = ZeroConfig(stage=3, min_unit_numel=0, find_unused_parameters=True)
    opt = ShardedAdamW(_trainable(model), lr=1e-2, config=config, module=model)
    _train(model, opt, range(2))
    plain = lightning_zero.unshard(model)
    assert hooks_left(model) == []
    with pytest.raises(RuntimeError, match="unshard"):
        opt.step()  # the sharded optimizer no longer trains the plain module
    copy = BlockNet().double()
    copy.load_state_dict(model.state_dict())
    start = [p.detach().clone() for p in model.parameters()]
    _train(model, torch.optim.AdamW(_trainable(model), lr=1e-2), range(2, 5))
    _train(copy, torch.optim.AdamW(_trainable(copy), lr=1e-2), range(2, 5))
    moved = max((p - s).abs().max().item() for p, s in zip(model.parameters(), start, strict=True))
    assert moved > 1e-2, "the unsharded model did not train"
    for a, b in zip(model.parameters(), copy.parameters(), strict=True):
        assert torch.equal(a, b)
    assert plain is model
