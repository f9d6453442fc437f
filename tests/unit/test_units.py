"""Stage 3's layout without a process group: units of gathering, unit-aligned buckets, freed buffers."""

from __future__ import annotations

import contextlib
import random
from typing import Any

import pytest
import torch
from torch import nn

import lightning_zero
from lightning_zero import ShardedAdamW, ZeroConfig
from lightning_zero.layout.buckets import ParamSpec, plan_buckets
from lightning_zero.layout.flat import FlatParams
from lightning_zero.layout.placeholders import FreedParameterError
from lightning_zero.layout.units import find_units
from tests.distributed.models import Block, BlockNet
from tests.unit.test_partition import CAPS


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _index(params: list[nn.Parameter], param: nn.Parameter) -> int:
    return next(i for i, p in enumerate(params) if p is param)


def test_blocks_of_a_module_list_and_large_layers_are_units_and_the_rest_is_the_root() -> None:
    model = BlockNet()
    params = _trainable(model)
    layout = find_units(model, params)
    assert layout.names == ("", "inp", "blocks.0", "blocks.1", "blocks.2", "out")
    names = {p: n for n, p in model.named_parameters()}
    for param, unit in zip(params, layout.of_param, strict=True):
        parts = names[param].split(".")
        assert layout.names[unit] == ".".join(parts[:2] if parts[0] == "blocks" else parts[:1])
    # a layer of its own: above the threshold by its own parameters; the frozen one holds none
    above_output_layer = find_units(model, params, min_unit_numel=104)
    assert above_output_layer.names == ("", "inp", "blocks.0", "blocks.1", "blocks.2")


def test_small_blocks_join_the_root_and_classes_choose_units() -> None:
    model = BlockNet()
    params = _trainable(model)
    block_numel = sum(p.numel() for p in model.blocks[0].parameters())
    assert find_units(model, params, min_unit_numel=block_numel + 1).names == ("",)
    blocks = ("blocks.0", "blocks.1", "blocks.2")
    assert find_units(model, params, min_unit_numel=block_numel).names[1:] == blocks
    by_class = find_units(model, params, unit_modules=(nn.Linear,))
    assert by_class.names == ("", "inp", "blocks.0.fc", "blocks.1.fc", "blocks.2.fc", "out")
    norm_weight = _index(params, model.blocks[1].norm.weight)
    assert by_class.of_param[norm_weight] == 0, "a LayerNorm outside every unit belongs to the root"


def test_a_blocks_own_sequential_is_part_of_the_block_unit() -> None:
    """The default policy takes the outermost blocks: the MLP ``nn.Sequential`` inside each block of a
    ``ModuleList`` holds layers above the threshold, yet each block is one unit (one gather)."""
    model = nn.ModuleList(
        nn.Sequential(nn.LayerNorm(8), nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 8))) for _ in range(2)
    )
    params = _trainable(model)
    layout = find_units(model, params, min_unit_numel=100)
    assert layout.names == ("", "0", "1")
    assert layout.of_param == (1,) * 6 + (2,) * 6
    assert find_units(model, params, unit_modules=(nn.Linear,)).names == (
        "",
        "0.1.0",
        "0.1.1",
        "1.1.0",
        "1.1.1",
    )


def test_a_weight_tied_across_units_belongs_to_the_root() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    model[2].weight = model[0].weight
    params = list(dict.fromkeys(model.parameters()))
    layout = find_units(model, params)
    assert layout.of_param[_index(params, model[0].weight)] == 0
    assert layout.of_param[_index(params, model[1].weight)] == 2
    assert layout.names == ("", "0", "1", "2")


def test_a_bucket_never_holds_two_units() -> None:
    rng = random.Random(3)
    for _ in range(50):
        n = rng.randint(1, 30)
        specs = [ParamSpec(f"p{i}", (rng.randint(1, 300),), torch.float32) for i in range(n)]
        units = sorted(rng.randint(0, 5) for _ in range(n))
        plan = plan_buckets(
            specs,
            rng.randint(1, 4),
            bucket_cap_mb=0.0004,
            first_bucket_cap_mb=0.0002,
            align_numel=1,
            units=units,
        )
        for bucket in plan.buckets:
            assert {units[s.param_index] for s in bucket.slots} == {bucket.unit}
        assert sorted(s.param_index for b in plan.buckets for s in b.slots) == list(range(n))
    with pytest.raises(ValueError, match="units has 1 entries for 2 parameters"):
        plan_buckets(specs[:2], 1, **CAPS, units=[0])


def test_a_freed_bucket_holds_no_storage_and_its_parameters_refuse_reads_and_writes() -> None:
    block = Block(6).double()
    params = list(block.parameters())
    values = [p.detach().clone() for p in params]
    plan = plan_buckets([ParamSpec(str(i), tuple(p.shape), p.dtype) for i, p in enumerate(params)], 2, **CAPS)
    flat = FlatParams(params, plan, rank=1, sharded=True)
    bucket = plan.buckets[0]
    assert flat.shard(bucket).untyped_storage().data_ptr() != flat.bucket(bucket).untyped_storage().data_ptr()
    flat.free(bucket)
    assert flat.bucket(bucket).untyped_storage().nbytes() == 0
    assert all(p.shape == v.shape for p, v in zip(params, values, strict=True))
    with pytest.raises(FreedParameterError, match="sum reads parameter '3'"):  # fc.weight
        block.fc.weight.sum()
    with pytest.raises(RuntimeError, match="add_ would write into parameter '3'"):  # fc.weight
        block.fc.weight.data.add_(1)
    with pytest.raises(RuntimeError, match="zero_ would write into parameter '4'"):  # no overlap check
        block.fc.bias.zero_()
    with pytest.raises(FreedParameterError, match="isnan reads parameter '4'"):
        torch.isnan(block.fc.bias)
    assert flat.is_bound(params)
    flat.materialize(bucket)
    start = plan.shard_numel(bucket)
    flat.bucket(bucket)[start:].copy_(flat.shard(bucket))  # what rank 1 contributes to the all-gather
    assert plan.buckets[0].slots[-1].param_index == 0  # buckets run backwards: the norm's weight is last
    torch.testing.assert_close(params[0], values[0], rtol=0, atol=0)  # in rank 1's half


@pytest.mark.usefixtures("nan_before_free")
def test_stage3_at_world_size_one_equals_adamw_and_frees_every_unit_between_steps() -> None:
    torch.manual_seed(0)
    model, reference = BlockNet().double(), BlockNet().double()
    reference.load_state_dict(model.state_dict())
    opt = ShardedAdamW(
        _trainable(model),
        lr=1e-2,
        config=ZeroConfig(stage=3, min_unit_numel=0, find_unused_parameters=True),
        module=model,
    )
    ref_opt = torch.optim.AdamW(_trainable(reference), lr=1e-2)
    gathered_in_forward = []
    for block in model.blocks:
        block.register_forward_pre_hook(
            lambda *_: gathered_in_forward.append(sum(opt.engine.units.gathered(u) for u in range(1, 6)))
        )
    for step in range(4):
        x = torch.randn(3, 7, dtype=torch.float64)
        for net, optimizer in ((model, opt), (reference, ref_opt)):
            net(x, step % 2 == 0).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        flat = opt.engine.flat
        assert all(flat.bucket(b).untyped_storage().nbytes() == 0 for b in opt.engine.plan.buckets)
        with pytest.raises(FreedParameterError, match="'out.weight'"):  # outside a forward: placeholders
            model.out.weight.sum()
        with opt.engine.full_parameters():
            for a, b in zip(model.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
    assert max(gathered_in_forward) == 2, "a block and the next one prefetched, never more"
    with pytest.raises(ValueError, match="pass the model"):
        ShardedAdamW(_trainable(model), config=ZeroConfig(stage=3))


class _HeadFirst(nn.Module):
    """The output layer registered before the blocks it follows (registration order is not forward
    order), and a second head registered there too that replaces it where ``aux`` says."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(13, 5)
        self.out = nn.Linear(13, 5)
        self.inp = nn.Linear(7, 13)
        self.blocks = nn.ModuleList(Block(13) for _ in range(3))

    def forward(self, x: torch.Tensor, aux: bool = False) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for block in self.blocks:
            h = block(h, True)
        return (self.aux if aux else self.out)(h)


def _stage3_twins(
    prefetch_units: int = 1,
) -> tuple[_HeadFirst, _HeadFirst, ShardedAdamW, torch.optim.AdamW, dict[str, int], list]:
    """A stage-3 model and its AdamW twin; the units by name; a list that each gather appends its unit to."""
    torch.manual_seed(0)
    model, reference = _HeadFirst().double(), _HeadFirst().double()
    reference.load_state_dict(model.state_dict())
    config = ZeroConfig(stage=3, min_unit_numel=0, find_unused_parameters=True, prefetch_units=prefetch_units)
    opt = ShardedAdamW(model.parameters(), lr=1e-2, config=config, module=model)
    units = opt.engine.units
    names = {units.units[u].name: u for u in range(1, len(units.units))}
    assert list(names) == ["aux", "out", "inp", "blocks.0", "blocks.1", "blocks.2"]
    launched: list[int] = []
    launch = units._launch

    def counted(bucket: Any, quantized: bool) -> Any:
        launched.append(bucket.unit)
        return launch(bucket, quantized)

    units._launch = counted  # type: ignore[method-assign]
    return model, reference, opt, torch.optim.AdamW(reference.parameters(), lr=1e-2), names, launched


def _step(model: nn.Module, opt: Any, x: torch.Tensor, aux: bool, after_forward: Any = None) -> None:
    loss = model(x, aux).pow(2).mean()
    if after_forward is not None:
        after_forward()
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_the_unit_that_ran_last_stays_gathered_for_its_backward_and_is_learnt_from_the_forward() -> None:
    """With ``reshard_after_forward`` every unit is freed after its forward but the one that ran last
    in the previous forward (registration order before the first): it is held through the loss and
    gathered once per step instead of twice. Step 1 guesses the last block (registered last), which
    is freed when the output layer starts after it, and the output layer prefetches nothing (the unit
    registered after it already ran); from step 2 on the output layer is held. When
    the head changes (steps 3 and 5) the new one is gathered again for its backward, and is held from
    the step after. Each backward frees every unit; every step equals AdamW."""
    model, reference, opt, ref_opt, names, launched = _stage3_twins()
    units = opt.engine.units
    held: list[list[str]] = []
    heads = [False, False, True, True, False]  # aux on steps 3 and 4
    for step, aux in enumerate(heads):
        x = torch.randn(4, 7, dtype=torch.float64)
        launched.clear()
        _step(model, opt, x, aux, lambda: held.append([n for n, u in names.items() if units.gathered(u)]))
        assert not any(units.gathered(u) for u in names.values()), "the backward frees every unit"
        head, other = ("aux", "out") if aux else ("out", "aux")
        repeated = step > 0 and heads[step - 1] == aux
        assert launched.count(names[head]) == (1 if repeated else 2), (step, launched)
        # where the head changed, the other one was prefetched once (the order said it came next)
        assert launched.count(names[other]) == (0 if repeated else 1), (step, launched)
        for block in ("inp", "blocks.0", "blocks.1", "blocks.2"):
            assert launched.count(names[block]) == 2, (step, block, launched)
        assert (head in held[-1]) == repeated and len(held[-1]) <= 1, (step, held)
        _step(reference, ref_opt, x, aux)
        with opt.engine.full_parameters():
            for a, b in zip(model.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
    assert units.last_in_forward() == names["out"]


def test_a_held_unit_is_freed_by_a_new_forward_and_by_the_step() -> None:
    """The last unit held after a forward with gradients that gets no backward: the next forward frees
    it as it starts (one that never runs it, without prefetching, so that nothing gathers it again),
    and an optimizer step with no backward behind it leaves only shards, as every step does."""
    model, _, opt, _, names, _ = _stage3_twins(prefetch_units=0)
    units = opt.engine.units
    x = torch.randn(4, 7, dtype=torch.float64)
    _step(model, opt, x, False)  # the output layer ran last: held from now on
    model(x)  # with gradients, no backward
    assert [n for n, u in names.items() if units.gathered(u)] == ["out"]
    model(x, aux=True)  # the other head: "out" is not run, and freed as this forward starts
    assert not any(units.gathered(u) for u in names.values()), "a new forward left the held unit gathered"
    model(x)
    opt.step()  # no backward since the last step: nothing changes, nothing stays gathered
    assert not any(units.gathered(u) for u in names.values()), "the step left a unit gathered"


def test_gathered_gives_a_unit_held_at_its_entry_back_as_it_was_held() -> None:
    """``lightning_zero.gathered`` between a forward and its backward: the held output layer is gathered
    again from the shards at the exit (its backward gathers nothing more), a block gathered inside is
    freed; after an exception inside, both are freed (no collective on that path) and the backward
    gathers the output layer again. Every step equals AdamW's. (A write into a parameter there is
    autograd's error: the forward saved it for the backward.)"""
    model, reference, opt, ref_opt, names, launched = _stage3_twins()
    units = opt.engine.units
    x = torch.randn(4, 7, dtype=torch.float64)
    _step(model, opt, x, False)  # the output layer ran last: held from now on
    _step(reference, ref_opt, x, False)
    for fails in (False, True):
        launched.clear()
        loss = model(x).pow(2).mean()
        block = lightning_zero.gathered(model.blocks[0])
        with contextlib.suppress(KeyError), lightning_zero.gathered(model.out), block:
            assert model.out.weight.isfinite().all() and model.blocks[0].fc.weight.isfinite().all()
            if fails:
                raise KeyError("inside")
        held = [n for n, u in names.items() if units.gathered(u)]
        assert held == ([] if fails else ["out"]), held
        loss.backward()
        opt.step()
        opt.zero_grad()
        # out: its forward, then the exit's gather or (after the exception) its backward's
        assert launched.count(names["out"]) == 2 and launched.count(names["blocks.0"]) == 3, launched
        _step(reference, ref_opt, x, False)
        with opt.engine.full_parameters():
            for a, b in zip(model.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-14)


def test_a_unit_gathered_again_at_the_exit_is_still_the_held_one() -> None:
    """After ``gathered`` gave the held output layer back, a new forward that never runs it frees it
    as it starts, as it frees the held unit (no prefetch here, which would gather it again)."""
    model, _, opt, _, names, _ = _stage3_twins(prefetch_units=0)
    units = opt.engine.units
    x = torch.randn(4, 7, dtype=torch.float64)
    _step(model, opt, x, False)
    model(x)  # the output layer held
    with lightning_zero.gathered(model.out):
        pass
    assert units.gathered(names["out"])
    model(x, aux=True)
    assert not units.gathered(names["out"]), "the unit given back is no longer the held one"


def test_gathered_gives_a_unit_held_from_int8_rows_back_from_int8_rows() -> None:
    """``gather_dtype="int8"``: inside ``gathered`` the held output layer holds exact values; at the exit
    it holds again the int8 values its forward ran on, which its backward must see."""
    torch.manual_seed(0)
    model = _HeadFirst().double()
    config = ZeroConfig(stage=3, min_unit_numel=0, find_unused_parameters=True, gather_dtype="int8")
    opt = ShardedAdamW(model.parameters(), lr=1e-2, config=config, module=model)
    out = opt.engine.units.units[2]
    assert out.name == "out"
    x = torch.randn(4, 7, dtype=torch.float64)
    _step(model, opt, x, False)  # the output layer ran last: held from now on
    loss = model(x).pow(2).mean()
    forward_values = model.out.weight.detach().clone()
    with lightning_zero.gathered(model.out):
        exact = model.out.weight.detach().clone()
    assert not torch.equal(exact, forward_values), "int8 rows equal exact values: the test is vacuous"
    assert out.quantized and torch.equal(model.out.weight.detach(), forward_values)
    loss.backward()


class _Shared(nn.Linear):
    """A unit run on its own and inside the head."""


class _Head(nn.Module):
    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.shared, self.proj = shared, nn.Linear(13, 13)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(self.shared(h)))


class _Reentered(nn.Module):
    """The head, the unit that runs last, runs twice per forward and each time calls another unit."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.shared = nn.Linear(7, 13), _Shared(13, 13)
        self.head = _Head(self.shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.head(self.shared(torch.relu(self.inp(x)))))


def test_the_held_unit_running_again_is_not_freed_by_a_unit_it_calls() -> None:
    """The unit held since its first call runs again in the same forward and calls another unit there:
    it stays gathered through that call (its own post-forward decides anew); every step equals AdamW."""
    torch.manual_seed(0)
    model, reference = _Reentered().double(), _Reentered().double()
    reference.load_state_dict(model.state_dict())
    # no prefetch: "shared" would launch "head"'s gather again, hiding a free (whose gather, on a
    # device, the head's next op would not wait for)
    config = ZeroConfig(stage=3, min_unit_numel=0, unit_modules=(_Shared, _Head), prefetch_units=0)
    opt = ShardedAdamW(model.parameters(), lr=1e-2, config=config, module=model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    units = opt.engine.units
    assert [units.units[u].name for u in range(1, len(units.units))] == ["shared", "head"]
    for _ in range(3):
        x = torch.randn(4, 7, dtype=torch.float64)
        for net, optimizer in ((model, opt), (reference, ref_opt)):
            net(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        with opt.engine.full_parameters():
            for a, b in zip(model.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
    assert units.last_in_forward() == 2


class _CallsNoOutputForward(BlockNet):
    """Uses the output layer's parameters without calling its forward."""

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = torch.tanh(self.frozen(torch.relu(self.inp(x))))
        return torch.nn.functional.linear(h, self.out.weight, self.out.bias)


def test_a_unit_whose_parameters_are_used_without_its_forward_is_an_error_naming_it() -> None:
    """The read itself fails (not NaN carried into the loss), naming the parameter."""
    model = _CallsNoOutputForward().double()
    config = ZeroConfig(stage=3, unit_modules=(nn.Linear,))
    ShardedAdamW(_trainable(model), config=config, module=model)
    with pytest.raises(FreedParameterError, match=r"linear reads parameter 'out.weight'"):
        model(torch.randn(2, 7, dtype=torch.float64))


class _Checkpointed(BlockNet):
    """Each block and the output layer (the last unit, held from its forward to its backward) under
    activation checkpointing: their forwards run again inside backward."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = torch.tanh(self.frozen(torch.relu(self.inp(x))))
        for i, block in enumerate(self.blocks):
            h = torch.utils.checkpoint.checkpoint(
                block, h, use_extra and i == 1, use_reentrant=self.reentrant
            )
        return torch.utils.checkpoint.checkpoint(self.out, h, use_reentrant=self.reentrant)


@pytest.fixture
def nan_before_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """A freed buffer is filled with NaN first, so that a read of freed memory (which on the CPU often
    still holds the old values) shows in the result instead of passing unnoticed."""
    free = FlatParams.free

    def poisoned(self: FlatParams, bucket: Any) -> None:
        if self.is_gathered(bucket):
            self.bucket(bucket).fill_(float("nan"))
        free(self, bucket)

    monkeypatch.setattr(FlatParams, "free", poisoned)


@pytest.mark.usefixtures("nan_before_free")
@pytest.mark.parametrize(("reentrant", "early_stop"), [(False, True), (False, False), (True, True)])
def test_activation_checkpointing_gathers_again_for_the_recomputation(
    reentrant: bool, early_stop: bool
) -> None:
    """Without early stop the recomputation runs each block's whole forward, post-hook included."""
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        _train_checkpointed(reentrant)


def _train_checkpointed(reentrant: bool) -> None:
    torch.manual_seed(0)
    model = _Checkpointed(reentrant).double()
    reference = BlockNet().double()
    reference.load_state_dict(model.state_dict())
    config = ZeroConfig(stage=3, min_unit_numel=0, find_unused_parameters=True)
    opt = ShardedAdamW(_trainable(model), lr=1e-2, config=config, module=model)
    ref_opt = torch.optim.AdamW(_trainable(reference), lr=1e-2)
    for step in range(3):
        x = torch.randn(
            3, 7, dtype=torch.float64, requires_grad=reentrant
        )  # reentrant needs an input with grad
        for net, optimizer in ((model, opt), (reference, ref_opt)):
            net(x, step != 1).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    with opt.full_parameters():
        for a, b in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-14)


def test_writes_inside_full_parameters_are_kept_only_with_writeback() -> None:
    model = BlockNet().double()
    opt = ShardedAdamW(_trainable(model), config=ZeroConfig(stage=3, min_unit_numel=0), module=model)
    with torch.no_grad(), opt.full_parameters():
        before = model.out.weight.clone()
        model.out.weight.fill_(1.0)
    with opt.full_parameters():
        torch.testing.assert_close(model.out.weight, before, rtol=0, atol=0)  # dropped at the exit
    with torch.no_grad(), opt.full_parameters(writeback=True):
        model.out.weight.fill_(1.0)
    with opt.full_parameters():
        assert torch.equal(model.out.weight, torch.ones_like(before))


@pytest.mark.parametrize("stage", [2, 3])
def test_a_dropped_model_and_optimizer_free_their_buffers(stage: int) -> None:
    """The gradient hooks a parameter holds are invisible to the garbage collector: they must not keep
    the reducer, the unit gathers, the model or the flat buffers alive once user code drops them."""
    import gc
    import weakref

    def train() -> list[weakref.ref]:
        model = BlockNet()
        config = ZeroConfig(stage=stage, **({"min_unit_numel": 0} if stage == 3 else {}))
        opt = ShardedAdamW(_trainable(model), config=config, module=model if stage == 3 else None)
        model(torch.randn(3, 7)).sum().backward()
        opt.step()
        return [weakref.ref(o) for o in (model, model.inp.weight, opt, opt.engine, opt.engine.reducer)]

    refs = train()
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)
