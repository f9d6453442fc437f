"""The activation estimate (`lightning_zero.layout.activations`, stated by `PretrainModule.activation_bytes`)
against what autograd saves in the recipe's GPT, counted as the step profiler counts it
(`SavedActivations`): equal to the byte, in fp64, fp32, bf16 and bf16 autocast, with and without activation
checkpointing, with the fused attention kernel SDPA picks on a CPU and with the math kernel forced, for
multi-head and grouped-query attention. One forward and loss of a 2-layer model per case, in one process."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_zero.integrations.trainer.saved_activations import SavedActivations
from lightning_zero.layout.activations import ActivationSpec, activation_bytes, layer_bytes, swiglu_hidden
from recipes.training.model import GPTConfig
from recipes.training.module import OptimConfig, PretrainModule, attention_kernel

PRECISIONS = {
    "64-true": torch.float64,
    "32-true": torch.float32,
    "bf16-true": torch.bfloat16,
    "bf16-mixed": None,
}
CASES = list(itertools.product(PRECISIONS, (False, True), ("flash", "math")))


def measured(module: PretrainModule, batch: tuple[torch.Tensor, torch.Tensor], precision: str) -> int:
    """The bytes `training_step`'s forward and loss save for backward under `precision` (the module
    already in its dtype), as the step profiler counts them."""
    saved = SavedActivations()
    saved.start()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        module._loss(module(batch[0]), batch[1])
    saved.stop()
    assert saved.bytes is not None
    return saved.bytes


@pytest.mark.parametrize("kv_heads", [None, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize(("precision", "checkpointing", "kernel"), CASES)
def test_the_estimate_is_what_autograd_saves(
    precision: str, checkpointing: bool, kernel: str, kv_heads: int | None
) -> None:
    config = GPTConfig(
        vocab_size=96,
        max_seq_len=64,
        n_layer=2,
        n_head=4,
        d_model=64,
        n_kv_head=kv_heads,
        activation_checkpointing=checkpointing,
    )
    torch.manual_seed(0)
    module = PretrainModule(config, OptimConfig())
    if PRECISIONS[precision] is not None:  # as Lightning's precision plugin: the whole module
        module = module.to(PRECISIONS[precision])
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 96, (3, 40), generator=g), torch.randint(0, 96, (3, 40), generator=g))
    forced = sdpa_kernel(SDPBackend.MATH) if kernel == "math" else contextlib.nullcontext()
    with forced:  # the estimate's kernel is torch's choice under the same settings
        assert attention_kernel(module.device, precision, 4, 40, 16) == kernel
        saved = measured(module, batch, precision)
        estimate = module.activation_bytes(batch, precision=precision)
    assert estimate == saved, (estimate, saved, estimate - saved)


def test_a_layer_is_the_formulas_layer() -> None:
    """One more block adds exactly `layer_bytes` (fp32, the CPU's flash kernel): the per-layer term on
    its own, not only the total."""
    batch = (torch.zeros(2, 32, dtype=torch.long), torch.zeros(2, 32, dtype=torch.long))
    saved = []
    for layers in (1, 2):
        config = GPTConfig(vocab_size=64, max_seq_len=32, n_layer=layers, n_head=2, d_model=32)
        saved.append(measured(PretrainModule(config, OptimConfig()), batch, "32-true"))
    spec = ActivationSpec(seq_len=32, micro_batch=2, d_model=32, layers=1, heads=2, precision="32-true")
    assert saved[1] - saved[0] == layer_bytes(spec) == 2 * 32 * (44 * 32 + 16 * swiglu_hidden(32) + 4 * 2 + 8)
    assert activation_bytes(spec) > layer_bytes(spec)  # the final norm, the logits, the ids on top


def test_the_default_mlp_width_is_the_models() -> None:
    for width in (32, 192, 768, 2048, 4096):
        config = GPTConfig(vocab_size=8, max_seq_len=8, n_layer=1, n_head=2, d_model=width)
        assert swiglu_hidden(width) == config.hidden_dim, width


def test_no_estimate_for_compiled_blocks() -> None:
    config = GPTConfig(vocab_size=64, max_seq_len=32, n_layer=1, n_head=2, d_model=32, compile_blocks=True)
    batch = (torch.zeros(2, 32, dtype=torch.long), torch.zeros(2, 32, dtype=torch.long))
    assert PretrainModule(config, OptimConfig()).activation_bytes(batch, precision="32-true") is None
