"""The GPT model: shapes, initialisation, checkpointing equivalence, sampling, and that it can learn."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from recipes.training.model import GPT, GPTConfig
from tests.docs.scripts import ROOT, load_script

import_graph = load_script("import_graph")


def small_config(**overrides: object) -> GPTConfig:
    fields: dict[str, object] = dict(vocab_size=50, max_seq_len=16, n_layer=2, n_head=4, d_model=32)
    fields.update(overrides)
    return GPTConfig(**fields)  # type: ignore[arg-type]


def test_logits_shape_and_tied_head() -> None:
    torch.manual_seed(0)
    model = GPT(small_config())
    idx = torch.randint(0, 50, (3, 16))
    assert model(idx).shape == (3, 16, 50)
    assert model.head.weight is model.embed.weight
    untied = GPT(small_config(tie_embeddings=False))
    assert untied.num_params() == model.num_params() + 50 * 32


def test_grouped_query_attention_has_fewer_kv_weights() -> None:
    full, grouped = GPT(small_config()), GPT(small_config(n_kv_head=1))
    head_dim = 32 // 4
    assert full.num_params() - grouped.num_params() == 2 * 2 * 32 * head_dim * (4 - 1)
    assert grouped(torch.randint(0, 50, (2, 8))).shape == (2, 8, 50)


def test_causality_future_tokens_do_not_change_past_logits() -> None:
    torch.manual_seed(0)
    model = GPT(small_config()).eval()
    idx = torch.randint(0, 50, (1, 12))
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 50
    torch.testing.assert_close(model(idx)[:, :8], model(changed)[:, :8])


def test_residual_projections_have_scaled_init() -> None:
    torch.manual_seed(0)
    config = small_config(n_layer=8, d_model=256, n_head=4, vocab_size=300)
    model = GPT(config)
    residual_std = config.init_std / math.sqrt(2 * config.n_layer)
    assert model.blocks[0].mlp.down.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert model.blocks[0].mlp.up.weight.std().item() == pytest.approx(config.init_std, rel=0.05)
    assert torch.equal(model.blocks[0].attn_norm.weight, torch.ones(256))


@pytest.mark.parametrize("n_kv_head", [None, 2])
def test_q_k_v_are_drawn_as_the_former_fused_qkv(n_kv_head: int | None) -> None:
    """q, k, v are initialized in that order from one std: together the rows one fused draw gives
    (bitwise on CPU when each holds a multiple of 16 elements: torch draws normals in blocks of 16)."""
    attn = GPT(small_config(n_kv_head=n_kv_head)).blocks[0].attn
    torch.manual_seed(3)
    attn.reset_parameters()
    torch.manual_seed(3)
    rows = attn.q.out_features + attn.k.out_features + attn.v.out_features
    fused = torch.empty(rows, 32).normal_(mean=0.0, std=attn.init_std)
    assert torch.equal(torch.cat([attn.q.weight, attn.k.weight, attn.v.weight]), fused)


def test_a_state_dict_with_the_former_fused_qkv_loads_split() -> None:
    """An older full checkpoint (one `attn.qkv.weight` of rows q | k | v) loads into q, k, v."""
    torch.manual_seed(0)
    model = GPT(small_config(n_kv_head=2))
    old = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(("attn.k.weight", "attn.v.weight")):
            continue
        if name.endswith("attn.q.weight"):
            prefix = name.removesuffix("q.weight")
            parts = [model.state_dict()[prefix + p + ".weight"] for p in "qkv"]
            old[prefix + "qkv.weight"] = torch.cat(parts).clone()
        else:
            old[name] = tensor.clone()
    fresh = GPT(small_config(n_kv_head=2))
    fresh.load_state_dict(old)
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    old["blocks.0.attn.qkv.weight"] = old["blocks.0.attn.qkv.weight"][:-1]  # not q | k | v: reported
    unexpected = r'Unexpected key\(s\) in state_dict: "blocks\.0\.attn\.qkv\.weight"'
    with pytest.raises(RuntimeError, match=unexpected):
        fresh.load_state_dict(old)


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    torch.manual_seed(0)
    plain = GPT(small_config())
    checkpointed = GPT(small_config(activation_checkpointing=True))
    checkpointed.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 50, (2, 16))
    for model in (plain, checkpointed):
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_flops_per_token_formula() -> None:
    model = GPT(small_config(tie_embeddings=False))
    expected = 6 * (model.num_params() - 50 * 32) + 12 * 2 * 32 * 16
    assert model.flops_per_token(16) == expected


def test_sequence_longer_than_max_is_refused() -> None:
    with pytest.raises(ValueError, match="max_seq_len=16"):
        GPT(small_config())(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"d_model": 30}, "n_head"), ({"n_kv_head": 3}, "n_kv_head"), ({"n_layer": 0}, "n_layer")],
)
def test_config_checks_name_the_field(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        small_config(**overrides)


def test_generate_appends_tokens_and_greedy_is_deterministic() -> None:
    torch.manual_seed(0)
    model = GPT(small_config())
    prompt = torch.tensor([[1, 2, 3]])
    out = model.generate(prompt, max_new_tokens=20, temperature=0.0)
    assert out.shape == (1, 23) and torch.equal(out[:, :3], prompt)
    assert torch.equal(out, model.generate(prompt, max_new_tokens=20, temperature=0.0))
    sampled = model.generate(prompt, 5, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(1))
    assert sampled.shape == (1, 8) and int(sampled.max()) < 50


def test_overfits_one_batch() -> None:
    torch.manual_seed(0)
    model = GPT(small_config())
    idx = torch.randint(0, 50, (4, 17))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05, loss.item()


def test_builds_on_meta_device() -> None:
    with torch.device("meta"):
        model = GPT(small_config(n_layer=48, d_model=1024, n_head=8, vocab_size=32000))
    assert model.embed.weight.is_meta and model.num_params() > 600e6


def test_model_never_imports_torch_distributed() -> None:
    """Function-level imports included (the one import reader, ``scripts/import_graph.py``)."""
    found = import_graph.imports(ROOT / "recipes")["recipes.training.model"]
    assert {i.module for i in found} >= {"torch"}  # the reader saw the module's imports
    imported = {i.module if i.name is None else f"{i.module}.{i.name}" for i in found}
    assert not [name for name in imported if name.startswith("torch.distributed")]
