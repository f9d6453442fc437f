"""Deferred initialization (``lightning_zero.engine.deferred_init``) in one process: models of standard
layers, the recipe's GPT and Lightning's demo Transformer built on the meta device get bit for bit the
values eager construction gives them from the same seed, whole and (stage 3, world size 1) unit by
unit; what the rule cannot reproduce is refused, naming the module or the tensor."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from lightning.pytorch.demos import Transformer
from torch import nn

from lightning_zero import ShardedAdamW, ZeroConfig
from lightning_zero.engine.deferred_init import (
    DeferredInit,
    DeferredInitError,
    capture_rng,
    check_deferred,
    materialize,
)
from recipes.training.model import GPT, GPTConfig

CPU = torch.device("cpu")


def _layers() -> nn.Module:
    return nn.Sequential(
        nn.Embedding(40, 12),
        nn.Conv1d(12, 12, 3, padding=1),
        nn.Sequential(
            *[nn.Sequential(nn.Linear(12, 24), nn.LayerNorm(24), nn.Linear(24, 12)) for _ in range(3)]
        ),
        nn.BatchNorm1d(12),
        nn.RMSNorm(12),
        nn.Linear(12, 40),
    )


def _gpt(tie: bool) -> Callable[[], nn.Module]:
    config = GPTConfig(vocab_size=48, max_seq_len=8, n_layer=3, n_head=2, d_model=16, tie_embeddings=tie)
    return lambda: GPT(config)


BUILDERS = {
    "standard layers": _layers,
    "recipe GPT": _gpt(False),
    "recipe GPT, tied head": _gpt(True),
    "Lightning demo Transformer, one layer": lambda: Transformer(
        vocab_size=33, ninp=16, nhead=2, nhid=16, nlayers=1
    ),
}


def _eager_and_meta(build: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module, DeferredInit]:
    torch.manual_seed(7)
    eager = build()
    torch.manual_seed(7)
    init = DeferredInit(CPU, capture_rng(CPU))
    with torch.device("meta"):
        meta = build()
    torch.rand(5)  # draws between construction and setup (data, dropout masks) do not change the values
    return eager, meta, init


def _assert_same(eager: nn.Module, other: dict[str, torch.Tensor]) -> None:
    expected = eager.state_dict()
    assert expected.keys() == other.keys()
    for name, value in expected.items():
        assert torch.equal(value, other[name]), name


@pytest.mark.parametrize("name", list(BUILDERS))
def test_whole_model_initialization_is_bit_identical_to_eager_construction(name: str) -> None:
    eager, meta, init = _eager_and_meta(BUILDERS[name])
    state_before = torch.random.get_rng_state()
    check_deferred(meta)
    materialize(meta, init)
    _assert_same(eager, meta.state_dict())
    assert not any(t.is_meta for t in [*meta.parameters(), *meta.buffers()])
    assert torch.equal(torch.random.get_rng_state(), state_before), (
        "the replay must not advance the generators"
    )


@pytest.mark.parametrize("name", ["standard layers", "recipe GPT", "recipe GPT, tied head"])
def test_stage3_initializes_unit_by_unit_to_the_same_values(name: str) -> None:
    eager, meta, init = _eager_and_meta(BUILDERS[name])
    params = list(meta.parameters())
    check_deferred(meta)
    config = ZeroConfig(stage=3, min_unit_numel=400, bucket_cap_mb=0.001)
    opt = ShardedAdamW(params, lr=1e-3, config=config, module=meta, deferred_init=init)
    assert [p for p in meta.parameters()] == params, "the optimizer's parameters stay the model's"
    _assert_same(eager, meta.state_dict())  # gathers one unit at a time
    engine = opt.engine
    assert engine.units is not None
    units = [sum(b.padded_numel for b in unit.buckets) for unit in engine.units.units]
    assert len(units) >= 4, units
    assert engine.init_peak_elements <= units[0] + max(units[1:]) < sum(units)


def test_a_module_without_reset_parameters_is_refused_naming_it() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.randn(3))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), Scaled())
    with pytest.raises(DeferredInitError, match=r"1 \(Scaled: scale\).*reset_parameters"):
        check_deferred(model)


def test_stacks_of_copied_layers_are_refused_naming_them() -> None:
    """Lightning's demo Transformer at its default 2 layers: nn.TransformerEncoder/Decoder deep-copy one
    layer, which a replay of each layer's reset cannot reproduce (the values would silently differ)."""
    with torch.device("meta"):
        model = Transformer(vocab_size=33, ninp=16, nhead=2, nhid=16, nlayers=2)
    with pytest.raises(
        DeferredInitError,
        match=r"transformer\.encoder \(TransformerEncoder of 2 layers\); transformer\.decoder",
    ):
        check_deferred(model)


def test_a_model_partly_on_the_meta_device_is_refused() -> None:
    with torch.device("meta"):
        head = nn.Linear(3, 3)
    model = nn.Sequential(nn.Linear(3, 3), head)
    with pytest.raises(
        DeferredInitError, match=r"partly on the meta device \(1.weight.*partly not \(0.weight"
    ):
        check_deferred(model)


def test_a_tensor_no_reset_writes_is_named() -> None:
    class Forgetful(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.zeros(2))
            self.b = nn.Parameter(torch.zeros(2))

        def reset_parameters(self) -> None:
            nn.init.ones_(self.a)

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), Forgetful())
    with pytest.raises(DeferredInitError, match=r"1\.b still hold\(s\) NaN"):
        materialize(model, DeferredInit(CPU, capture_rng(CPU)))


class _WholeModelInit(nn.Module):
    """A root whose reset re-initializes every block (nanoGPT's pattern): fine whole, not per unit."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(20, 20) for _ in range(3))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for block in self.blocks:
            nn.init.normal_(block.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_stage3_refuses_a_reset_that_writes_into_units_already_sharded() -> None:
    eager, meta, init = _eager_and_meta(_WholeModelInit)
    materialize(meta, init)  # whole (stages 1 and 2): the model-level reset replays as it ran
    _assert_same(eager, meta.state_dict())
    with torch.device("meta"):
        meta = _WholeModelInit()
    config = ZeroConfig(stage=3, min_unit_numel=100)
    with pytest.raises(
        DeferredInitError, match=r"_WholeModelInit.reset_parameters\(\) of module '<root>'.*blocks\.0\.weight"
    ):
        ShardedAdamW(meta.parameters(), config=config, module=meta, deferred_init=init)


def test_meta_parameters_without_deferred_init_are_refused() -> None:
    with torch.device("meta"):
        model = nn.Linear(3, 3)
    with pytest.raises(ValueError, match=r"meta device \(weight, bias\).*deferred_init"):
        ShardedAdamW(
            model.parameters(),
            config=ZeroConfig(stage=2),
            param_names={model.weight: "weight", model.bias: "bias"},
        )


def _hf(arch: str) -> nn.Module:
    import transformers

    small = dict(
        vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    if arch == "gpt2":
        return transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=48, n_embd=16, n_layer=2, n_head=2)
        )
    cls, config = {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
    }[arch]
    return cls(config(**small, num_key_value_heads=1, max_position_embeddings=8, tie_word_embeddings=True))


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_hugging_face_model_replays_its_own_initializer_to_the_eager_values(arch: str, stage: int) -> None:
    """Issue 39, item 6: ``_init_weights`` (std 0.02), not ``reset_parameters()`` (torch's defaults), in
    the order an eager build runs it: the model's ``post_init()`` after every layer's constructor; at
    stage 3 unit by unit, from where the eager build's generators stood for each call."""
    torch.manual_seed(0)
    eager = _hf(arch)
    torch.manual_seed(0)
    rng = capture_rng(CPU)
    with torch.device("meta"):
        model = _hf(arch)
    check_deferred(model)
    if stage == 3:
        ShardedAdamW(
            model.parameters(),
            config=ZeroConfig(stage=3, min_unit_numel=0),
            module=model,
            deferred_init=DeferredInit(CPU, rng),
        )
    else:
        materialize(model, DeferredInit(CPU, rng))
    state, want = model.state_dict(), eager.state_dict()
    assert state.keys() == want.keys()
    for name in want:
        assert torch.equal(state[name], want[name]), name
    for (name, buffer), (_, expected) in zip(model.named_buffers(), eager.named_buffers(), strict=True):
        assert torch.equal(buffer, expected), name  # rotary inv_freq: computed, not left on meta
    assert model.lm_head.weight is model.get_input_embeddings().weight


def test_a_module_that_may_draw_in_its_constructor_is_refused_by_name() -> None:
    """GPT-2's ``Conv1D`` initializes its weight in its constructor, with no ``reset_parameters()``:
    no replay can repeat those draws, so the model is refused rather than built with other values."""
    with torch.device("meta"):
        model = _hf("gpt2")
    with pytest.raises(DeferredInitError, match=r"transformer\.h\.0\.attn\.c_attn \(Conv1D: weight, bias\)"):
        check_deferred(model)


class _Scale(nn.Module):
    """A module without ``reset_parameters()``: only a ``param_init_fn`` initializes it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.empty(width))


def _init_fn(module: nn.Module) -> None:
    """nanoGPT's ``_init_weights``: normal(0, 0.02) weights, zero biases; gains of one."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, _Scale):
        nn.init.ones_(module.gain)


class _Applied(nn.Module):
    def __init__(self, apply: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 12)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(12, 12), _Scale(12)) for _ in range(3))
        self.head = nn.Linear(12, 40)
        if apply:  # what an eager build of such a model does at the end of its constructor
            self.apply(_init_fn)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_param_init_fn_replays_as_model_apply_at_the_end_of_construction(stage: int) -> None:
    torch.manual_seed(0)
    eager = _Applied(apply=True)
    torch.manual_seed(0)
    rng = capture_rng(CPU)
    with torch.device("meta"):
        model = _Applied(apply=False)
    with pytest.raises(DeferredInitError, match=r"blocks\.0\.1 \(_Scale: gain\)"):
        check_deferred(model)  # without the function: nothing would initialize the gains
    check_deferred(model, _init_fn)
    init = DeferredInit(CPU, rng, _init_fn)
    if stage == 3:
        config = ZeroConfig(stage=3, min_unit_numel=0)
        ShardedAdamW(model.parameters(), config=config, module=model, deferred_init=init)
    else:
        materialize(model, init)
    state, want = model.state_dict(), eager.state_dict()
    for name in want:
        assert torch.equal(state[name], want[name]), name


class _Counts(nn.Module):
    """An unsigned buffer its reset writes (0 is an ordinary value of it), and one it never writes."""

    def __init__(self, forget: bool = False) -> None:
        super().__init__()
        self.forget = forget
        self.register_buffer("counts", torch.empty(4, dtype=torch.uint8))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if not self.forget:
            self.counts.copy_(torch.arange(4, dtype=torch.uint8))


def test_unsigned_buffers_are_checked_and_named() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), _Counts())
    materialize(model, DeferredInit(CPU, capture_rng(CPU)))
    assert model[1].counts.tolist() == [0, 1, 2, 3]
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), _Counts(forget=True))
    with pytest.raises(DeferredInitError, match=r"^deferred initialization: 1\.counts still hold"):
        materialize(model, DeferredInit(CPU, capture_rng(CPU)))


def _noop(module: nn.Module) -> None:
    pass


def test_a_reset_that_writes_its_children_s_tensors_replays_at_stage_3_with_a_model_initializer() -> None:
    """``MultiheadAttention._reset_parameters()`` writes its ``out_proj``'s bias: the pass that notes
    the generators' states gives the whole module scratch tensors, not only its own."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(8, 8), nn.MultiheadAttention(8, 2))
    torch.manual_seed(0)
    rng = capture_rng(CPU)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.MultiheadAttention(8, 2))
    init = DeferredInit(CPU, rng, _noop)
    ShardedAdamW(
        model.parameters(), config=ZeroConfig(stage=3, min_unit_numel=0), module=model, deferred_init=init
    )
    state = model.state_dict()
    for name, value in eager.state_dict().items():
        assert torch.equal(state[name], value), name


def _draw(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)


def test_a_param_init_fn_runs_on_a_shared_module_as_often_as_model_apply_does() -> None:
    """``model.apply(fn)`` visits a module shared by two parents twice (each parent's ``children()``),
    one held twice by the same parent once: the replay draws as often, the last draw kept."""

    def build() -> nn.Module:
        shared = nn.Linear(6, 6)
        return nn.Sequential(nn.Sequential(shared, nn.Tanh()), nn.Sequential(shared, shared), nn.Linear(6, 2))

    torch.manual_seed(0)
    eager = build()
    eager.apply(_draw)  # the shared layer drawn twice, the second draw kept
    torch.manual_seed(0)
    rng = capture_rng(CPU)
    with torch.device("meta"):
        model = build()
    materialize(model, DeferredInit(CPU, rng, _draw))
    for name, value in eager.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
