"""ShardedAdamW without any process group equals torch.optim.AdamW / Adam step for step."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_zero import ShardedAdamW, ZeroConfig
from tests.distributed.models import TinyNet, param_groups


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("adamw", [True, False])
def test_equals_torch_optimizer(amsgrad: bool, maximize: bool, adamw: bool) -> None:
    torch.manual_seed(0)
    model = TinyNet().double()
    reference = copy.deepcopy(model)
    torch_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref_opt = torch_cls(param_groups(reference), lr=1e-2, amsgrad=amsgrad, maximize=maximize)
    opt = ShardedAdamW.from_optimizer(
        torch_cls(param_groups(model), lr=1e-2, amsgrad=amsgrad, maximize=maximize),
        # the extra layer is unused every third step: torch skips it, as we do when unused are tracked
        config=ZeroConfig(bucket_cap_mb=0.0004, first_bucket_cap_mb=0.0002, find_unused_parameters=True),
    )
    for step in range(8):
        x = torch.randn(6, 7, dtype=torch.float64)
        for m, o in ((model, opt), (reference, ref_opt)):
            m(x, use_extra=step % 3 != 2).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kernel", [{}, {"foreach": True}, {"fused": True}])
def test_fp32_equals_torch_bit_for_bit_with_the_users_kernel(kernel: dict) -> None:
    """The update runs the kernel family the user's AdamW asked for (torch's default, foreach, fused):
    fp32 results are identical to torch's, including where Adam amplifies rounding (tiny gradients)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, **kernel)
    opt = ShardedAdamW.from_optimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **kernel),
        config=ZeroConfig(bucket_cap_mb=0.004, first_bucket_cap_mb=0.002),
    )
    for step in range(8):
        x = torch.randn(16, 64) * (1e-4 if step % 2 else 1.0)
        for m, o in ((model, opt), (reference, ref_opt)):
            m(x).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("max_norm", [1e-3, 1e3], ids=["norm_above_max", "norm_below_max"])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clipping_equals_torch_on_both_sides_of_max_norm(max_norm: float, norm_type: float) -> None:
    """Clipping scales gradients down when the global norm exceeds ``max_norm`` and leaves them alone
    when it does not (never up), as ``torch.nn.utils.clip_grad_norm_``; the returned norm is torch's."""
    torch.manual_seed(0)
    model = TinyNet().double()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(param_groups(reference), lr=1e-2)
    opt = ShardedAdamW.from_optimizer(
        torch.optim.AdamW(param_groups(model), lr=1e-2),
        config=ZeroConfig(bucket_cap_mb=0.0004, first_bucket_cap_mb=0.0002),
    )
    for _ in range(4):
        x = torch.randn(6, 7, dtype=torch.float64)
        model(x).pow(2).mean().backward()
        reference(x).pow(2).mean().backward()
        total = opt.clip_grad_norm_(max_norm, norm_type)
        ref_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
        torch.testing.assert_close(total, ref_total, rtol=1e-12, atol=0)
        assert (ref_total > max_norm) == (max_norm == 1e-3), "the case must cross the threshold as named"
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_an_unused_parameter_counts_as_zero_on_one_rank_as_on_n_unless_tracked() -> None:
    """Without ``find_unused_parameters`` a parameter that got no gradient is stepped with a zero
    gradient (weight decay moves it) and a warning names the option, at world size 1 exactly as on N
    ranks; with it, the parameter is skipped as torch skips a ``None`` gradient."""
    for tracked in (False, True):
        torch.manual_seed(0)
        model = TinyNet().double()
        before = model.extra.detach().clone()
        opt = ShardedAdamW(
            model.parameters(), lr=1e-2, weight_decay=0.1, config=ZeroConfig(find_unused_parameters=tracked)
        )
        x = torch.randn(6, 7, dtype=torch.float64)
        if tracked:
            model(x, use_extra=False).pow(2).mean().backward()
            opt.step()
            torch.testing.assert_close(model.extra, before, rtol=0, atol=0)
        else:
            with pytest.warns(UserWarning, match="counts as a zero gradient.*find_unused_parameters=True"):
                model(x, use_extra=False).pow(2).mean().backward()
            opt.step()
            torch.testing.assert_close(model.extra, before * (1 - 1e-2 * 0.1), rtol=0, atol=1e-15)


def test_bf16_params_keep_fp32_master() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3).to(torch.bfloat16)
    opt = ShardedAdamW(model.parameters(), lr=1e-3)
    assert all(m.dtype == torch.float32 for m in (r.master for r in opt.engine.state.records))
    before = model.weight.detach().float().clone()
    for _ in range(3):
        model(torch.ones(2, 5, dtype=torch.bfloat16)).sum().backward()
        opt.step()
        opt.zero_grad()
    # at world size 1 the shard is the whole bucket: the parameter is its fp32 master rounded to bf16
    bucket_index, slot = opt.engine.plan.locate()[opt.engine.params_in_order.index(model.weight)]
    master = opt.engine.state.records[bucket_index].master[
        slot.bucket_offset : slot.bucket_offset + slot.numel
    ]
    assert not torch.equal(before, model.weight.float())
    torch.testing.assert_close(model.weight, master.view(3, 5).to(torch.bfloat16), rtol=0, atol=0)
    assert not torch.equal(master.view(3, 5), model.weight.float()), "master keeps more precision than bf16"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stage": 4}, "stage must be 1, 2 or 3, got 4"),
        ({"reshard_after_forward": False}, "reshard_after_forward only apply to stage 3"),
        ({"stage": 1, "prefetch_units": 2}, "prefetch_units only apply to stage 3.*got stage=1"),
        ({"stage": 3, "prefetch_units": -1}, "prefetch_units must be an integer >= 0, got -1"),
        ({"stage": 3, "unit_modules": [torch.nn.Linear]}, "unit_modules must be None or a tuple"),
        ({"stage": 3, "min_unit_numel": 1.5}, "min_unit_numel must be an integer >= 0, got 1.5"),
        ({"stage": 3, "overlap_param_gather": True}, "overlap_param_gather applies to stages 1 and 2"),
        ({"bucket_cap_mb": 0}, "bucket_cap_mb must be a number > 0"),
        ({"reduce_dtype": "int4"}, "reduce_dtype must be None or one of"),
        (
            {"error_feedback": True},
            "error_feedback=True applies to reduce_dtype='int8' only.*got reduce_dtype=None",
        ),
        ({"reduce_dtype": "int8", "error_feedback": 1}, "error_feedback must be True or False, got 1"),
        ({"stage": 3, "gather_dtype": "int4"}, "gather_dtype must be None .* or 'int8', got 'int4'"),
        ({"stage": 2, "gather_dtype": "int8"}, "gather_dtype='int8' applies to stage 3 only.*got stage=2"),
        ({"overlap_comm": "yes"}, "overlap_comm"),
        ({"skip_nonfinite_steps": -1}, r"skip_nonfinite_steps must be an integer >= 0 .*got -1"),
        ({"skip_nonfinite_steps": 2.5}, r"skip_nonfinite_steps must be an integer >= 0 .*got 2.5"),
        ({"skip_nonfinite_steps": True}, r"skip_nonfinite_steps must be an integer >= 0 .*got True"),
        ({"skip_nonfinite_steps": "3"}, r"skip_nonfinite_steps must be an integer >= 0 .*got '3'"),
    ],
)
def test_bad_config_names_the_value(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ZeroConfig(**kwargs)


def test_refuses_other_optimizers_and_options() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="got SGD"):
        ShardedAdamW.from_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="differentiable=True is not supported"):
        ShardedAdamW.from_optimizer(torch.optim.AdamW(model.parameters(), differentiable=True))
    with pytest.raises(ValueError, match="lr must be >= 0, got -1"):
        ShardedAdamW(model.parameters(), lr=-1)
    with pytest.raises(ValueError, match="fused=True and foreach=True cannot be set together"):
        ShardedAdamW(model.parameters(), fused=True, foreach=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stage": 3, "sharded_checkpoint": False}, "sharded_checkpoint=False is not supported at stage 3"),
        ({"stage": 3, "unit_modules": ["torch.nn.Linear", "torch.nn.nope"]}, "'torch.nn.nope' is not an"),
        ({"stage": 3, "unit_modules": "os.path"}, "'os.path' is not an importable torch.nn.Module class"),
        ({"unit_modules": ["torch.nn.Linear"]}, "unit_modules only apply to stage 3.*got stage=2"),
    ],
)
def test_stage3_arguments_are_checked(kwargs: dict, match: str) -> None:
    from lightning_zero import ZeroStrategy

    with pytest.raises(ValueError, match=match):
        ZeroStrategy(**kwargs)
    strategy = ZeroStrategy(stage=3, unit_modules=["torch.nn.Linear"])
    assert strategy.zero_config.unit_modules == (torch.nn.Linear,)


def test_fabric_takes_the_stage3_arguments() -> None:
    from lightning_zero import ZeroFabricStrategy

    strategy = ZeroFabricStrategy(stage=3, unit_modules=["torch.nn.Linear"], prefetch_units=2)
    assert (
        strategy.zero_config.unit_modules == (torch.nn.Linear,) and strategy.zero_config.prefetch_units == 2
    )
    with pytest.raises(ValueError, match="prefetch_units"):
        ZeroFabricStrategy(stage=2, prefetch_units=2)  # a stage-3 setting below stage 3 is refused


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stage": 4}, "got 4"),
        ({"bucket_cap_mb": 0}, "got 0"),
        ({"reduce_dtype": "fp8"}, "'fp8'"),
        ({"sharded_checkpoint": "no"}, "sharded_checkpoint must be True or False, got 'no'"),
        ({"async_checkpoint": 1}, "async_checkpoint must be True or False, got 1"),
        ({"log_comm_stats": "yes"}, "log_comm_stats must be True or False, got 'yes'"),
        ({"broadcast_buffers": None}, "broadcast_buffers must be True or False, got None"),
        (
            {"skip_nonfinite_steps": -2},
            r"skip_nonfinite_steps must be an integer >= 0 \(0: off; K > 0: .*got -2",
        ),
        ({"skip_nonfinite_steps": None}, "skip_nonfinite_steps must be an integer >= 0 .*got None"),
    ],
)
@pytest.mark.parametrize("strategy", ["ZeroStrategy", "ZeroFabricStrategy"])
def test_strategy_rejects_bad_arguments_before_any_work(strategy: str, kwargs: dict, match: str) -> None:
    import lightning_zero

    with pytest.raises(ValueError, match=match):
        getattr(lightning_zero, strategy)(**kwargs)


def test_strategy_names_are_registered() -> None:
    import lightning.pytorch as pl

    import lightning_zero  # noqa: F401

    trainer = pl.Trainer(strategy="zero1", accelerator="cpu", devices=1, logger=False)
    assert type(trainer.strategy).__name__ == "ZeroStrategy" and trainer.strategy.zero_config.stage == 1
    assert (
        pl.Trainer(strategy="zero", accelerator="cpu", devices=1, logger=False).strategy.zero_config.stage
        == 2
    )
    zero3 = pl.Trainer(strategy="zero3", accelerator="cpu", devices=1, logger=False).strategy
    assert zero3.zero_config.stage == 3
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    assert "zero2" in STRATEGY_REGISTRY and STRATEGY_REGISTRY["zero3"]["init_params"] == {"stage": 3}


def test_second_backward_before_step_accumulates_like_torch() -> None:
    """Two backward passes without ``no_sync`` (the second opens a new round of communication after
    the first was sent) give torch's accumulated gradient; one parameter per bucket."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
    reference = copy.deepcopy(model)
    config = ZeroConfig(bucket_cap_mb=1e-5, first_bucket_cap_mb=1e-5)
    opt = ShardedAdamW(model.parameters(), lr=0.1, config=config, param_order=model.parameters())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.1)
    assert len(opt.engine.plan.buckets) == 4
    for m, o in ((model, opt), (reference, ref_opt)):
        for scale in (1.0, -3.0):
            (m(torch.ones(1, 3, dtype=torch.float64)) * scale).pow(2).sum().backward()
        o.step()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_bf16_master_follows_in_place_writes() -> None:
    """A write into a bf16 parameter between steps (weights loaded by a callback) is what the next
    update starts from: with lr 0 the parameter stays exactly the written value."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3).to(torch.bfloat16)
    opt = ShardedAdamW(model.parameters(), lr=1e-2)
    x = torch.ones(2, 5, dtype=torch.bfloat16)
    model(x).sum().backward()
    opt.step()
    with torch.no_grad():
        model.weight.fill_(0.25)
    for group in opt.param_groups:
        group["lr"] = 0.0
    model(x).sum().backward()
    opt.step()
    assert torch.equal(model.weight, torch.full_like(model.weight, 0.25))


def _freeze_unfreeze_run(model: TinyNet, opt: torch.optim.Optimizer, replan: bool) -> None:
    """3 steps; freeze ``out``; 2 steps; unfreeze it and add the frozen layer as a new group; 3 steps."""

    def steps(n: int, start: int) -> None:
        for step in range(start, start + n):
            g = torch.Generator().manual_seed(step)
            model(torch.randn(6, 7, generator=g, dtype=torch.float64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    steps(3, 0)
    model.out.requires_grad_(False)
    if replan:
        opt.replan()  # type: ignore[attr-defined]
    steps(2, 3)
    model.out.requires_grad_(True)
    model.frozen.requires_grad_(True)
    opt.add_param_group({"params": list(model.frozen.parameters()), "lr": 5e-3, "weight_decay": 0.3})
    if replan:
        opt.replan()  # type: ignore[attr-defined]
    steps(3, 5)


def test_replan_after_freezing_and_adding_a_group_equals_torch() -> None:
    """A frozen parameter is skipped and keeps its state (torch), resumes from it when unfrozen; a
    group added later trains from its first step; one parameter per bucket, so buckets move."""
    torch.manual_seed(0)
    model = TinyNet().double()
    reference = copy.deepcopy(model)
    opt = ShardedAdamW(
        param_groups(model), lr=1e-2, config=ZeroConfig(bucket_cap_mb=1e-5, first_bucket_cap_mb=1e-5)
    )
    _freeze_unfreeze_run(model, opt, replan=True)
    _freeze_unfreeze_run(reference, torch.optim.AdamW(param_groups(reference), lr=1e-2), replan=False)
    assert not torch.equal(model.frozen.weight, TinyNet().double().frozen.weight)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_step_after_an_unplanned_trainable_change_is_an_error() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = ShardedAdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    model[0].requires_grad_(False)
    with pytest.raises(RuntimeError, match="call replan"):
        opt.step()


def test_reentrant_activation_checkpointing_stays_exact() -> None:
    """A reentrant checkpoint runs a nested backward whose end may close a gradient round early;
    the rest arrives in a second round, and the sum is still torch's gradient."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    )
    model = model.double()
    reference = copy.deepcopy(model)
    opt = ShardedAdamW(
        model.parameters(), lr=0.1, config=ZeroConfig(bucket_cap_mb=1e-5, first_bucket_cap_mb=1e-5)
    )
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.1)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    for m, o in ((model, opt), (reference, ref_opt)):
        for _ in range(3):
            h = checkpoint(m[:2], x, use_reentrant=True)
            m[3](m[2](h)).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def _train_three_steps(opt: ShardedAdamW, model: torch.nn.Module) -> list[list[int]]:
    """Three steps of ``opt`` and of torch's AdamW on a copy; returns the pool's buffers after each."""
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters())
    slots = []
    for step in range(3):
        for m, o in ((model, opt), (reference, ref_opt)):
            m(torch.full((2, 8), float(step), dtype=torch.float64)).pow(2).sum().backward()
            o.step()
            o.zero_grad()
        slots.append([b.data_ptr() for buffers in opt.engine.reducer.pool._buffers.values() for b in buffers])
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    return slots


def test_gradient_buffers_come_from_a_bounded_pool() -> None:
    """Many buckets, each padded (``align_numel=3``), steps without accumulation: every accumulation
    buffer is a pool slot (nothing allocated per step); the pool holds three slots as long as the
    longest bucket within the cap (the biases) and one as long as the longest above it (the
    weights); no_sync needs buffers of its own."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)]).double()
    config = ZeroConfig(bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4, align_numel=3)
    opt = ShardedAdamW(model.parameters(), config=config)
    buckets = opt.engine.plan.buckets
    assert len(buckets) == 12 and all(b.padding > 0 for b in buckets)
    slots = _train_three_steps(opt, model)
    assert opt.engine.reducer.allocations_outside_pool == 0 and opt.engine.reducer.adopted == 0
    assert slots[0] == slots[-1] and 0 < len(slots[0]) <= 4, "slots are allocated once and reused"
    biases = [b.padded_numel for b in buckets if b.numel == 8]
    weights = [b.padded_numel for b in buckets if b.numel == 64]
    lengths = sorted(b.numel() for buffers in opt.engine.reducer.pool._buffers.values() for b in buffers)
    assert lengths.count(max(weights)) == 1 and set(lengths) == {max(biases), max(weights)}, lengths
    with opt.no_sync():
        model(torch.ones(2, 8, dtype=torch.float64)).sum().backward()
    assert opt.engine.reducer.allocations_outside_pool == len(buckets) - 4


def test_a_gradient_alone_in_an_unpadded_bucket_is_the_buffer() -> None:
    """Without padding every bucket here is one parameter in the master dtype: autograd's gradient
    itself is reduced (adopted), so the pool never allocates; results equal torch's AdamW."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)]).double()
    opt = ShardedAdamW(model.parameters(), config=ZeroConfig(bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4))
    assert len(opt.engine.plan.buckets) == 12
    _train_three_steps(opt, model)
    assert opt.engine.reducer.adopted == 3 * 12 and opt.engine.reducer.pool.nbytes() == 0


def test_stage_3_frees_each_gradient_buffer_when_its_bucket_is_collected() -> None:
    """Stage 3 takes the pool's slots as stage 2 does (the same padded buckets, no adoption) but
    frees each buffer once its bucket is collected: nothing is held between steps, and results equal
    torch's AdamW."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)]).double()
    config = ZeroConfig(
        stage=3, bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4, align_numel=3, min_unit_numel=0
    )
    opt = ShardedAdamW(model.parameters(), config=config, module=model)
    taken = []
    take = opt.engine.reducer.pool.take
    opt.engine.reducer.pool.take = lambda *a: taken.append(take(*a)) or taken[-1]  # type: ignore[method-assign]
    with opt.engine.full_parameters():
        reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters())
    for step in range(3):
        for m, o in ((model, opt), (reference, ref_opt)):
            m(torch.full((2, 8), float(step), dtype=torch.float64)).pow(2).sum().backward()
            o.step()
            o.zero_grad()
        assert opt.engine.reducer.pool.nbytes() == 0, "every buffer freed after the step"
    assert taken and all(t is not None for t in taken), "the buckets did take slots"
    assert opt.engine.reducer.adopted == 0 and opt.engine.reducer.allocations_outside_pool == 0
    with opt.engine.full_parameters():
        for a, b in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
