"""The recipe's side of lightning-zero's step profile: its FLOPs per token are torchtitan's formula for
the recipe's Llama, the module states its tokens and FLOPs for the profiler, and
`strategy.profile_steps=[2,4]` reaches `ZeroStrategy`."""

from __future__ import annotations

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from recipes.training.model import GPT, GPTConfig
from recipes.training.module import OptimConfig, PretrainModule
from tests.conf.compose import compose_pretrain


def torchtitan_flops_per_token(model: nn.Module, config: GPTConfig, seq_len: int) -> int:
    """torchtitan's `get_dense_model_nparams_and_flops` as it states it: every parameter but those of
    the model's `nn.Embedding` children, 6 FLOPs each, plus `12 l h q t` for attention (`q` the head
    size)."""
    nparams = sum(p.numel() for p in model.parameters())
    embedding = sum(
        p.numel() for m in model.children() if isinstance(m, nn.Embedding) for p in m.parameters()
    )
    layers, heads, head_size = config.n_layer, config.n_head, config.d_model // config.n_head
    return 6 * (nparams - embedding) + 12 * layers * heads * head_size * seq_len


def llama_1b() -> GPTConfig:
    cfg = compose_pretrain(["model=llama_1b"])
    return GPTConfig(**{k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "_target_"})


def test_flops_per_token_is_torchtitans_for_the_recipes_llama() -> None:
    config = llama_1b()
    assert not config.tie_embeddings
    with torch.device("meta"):
        model = GPT(config)
    for seq in (2048, 512):
        assert model.flops_per_token(seq) == torchtitan_flops_per_token(model, config, seq)


def test_the_module_states_tokens_and_flops_for_the_profiler() -> None:
    config = GPTConfig(vocab_size=64, max_seq_len=32, n_layer=2, n_head=2, d_model=32)
    module = PretrainModule(config, OptimConfig())
    batch = (torch.zeros(3, 16, dtype=torch.long), torch.zeros(3, 16, dtype=torch.long))
    assert module.tokens_in_batch(batch) == 48
    assert module.flops_per_token(batch) == module.model.flops_per_token(16)
    assert module.flops_per_token(batch) != module.model.flops_per_token(32)  # the batch's context


def test_profile_steps_reach_the_strategy() -> None:
    cfg = compose_pretrain(
        ["strategy=zero2", "strategy.profile_steps=[2,4]", "strategy.profile_peak_tflops=500"]
    )
    strategy = instantiate(cfg.strategy)
    assert strategy._zero.options.profile_steps == (2, 4)
    assert strategy._zero.options.profile_peak_tflops == 500
