"""The recipe's GPT as a Llama, the names only: which `LlamaConfig` field each `GPTConfig` field is, which
`LlamaForCausalLM` tensors each of our parameters is, and the check that a Llama directory has our
shape. Used to start from a Hugging Face Llama (`model.init_from=DIR`) and by `recipes.export`;
no import of `transformers`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from recipes.training.model import GPTConfig

LLAMA_FIELDS = {
    "vocab_size": "vocab_size",
    "max_seq_len": "max_position_embeddings",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "d_model": "hidden_size",
    "n_kv_head": "num_key_value_heads",
    "mlp_hidden": "intermediate_size",
    "rope_theta": "rope_parameters.rope_theta",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
}
"""`GPTConfig` field -> the `LlamaConfig` field it becomes."""


class InitFromError(ValueError):
    """A `model.init_from` directory that the model cannot start from (the message names why)."""


def llama_values(config: GPTConfig) -> dict[str, Any]:
    """The `LlamaConfig` value of each `LLAMA_FIELDS` entry for `config` (defaults resolved)."""
    return {
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_seq_len,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "hidden_size": config.d_model,
        "num_key_value_heads": config.kv_heads,
        "intermediate_size": config.hidden_dim,
        "rope_parameters.rope_theta": config.rope_theta,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
    }


def llama_sources(config: GPTConfig, prefix: str = "") -> dict[str, list[str]]:
    """Our parameter names (under `prefix`, e.g. "model." in `PretrainModule`) -> the
    `LlamaForCausalLM` tensors each is (one each; a tied head is the embedding): what
    `lightning_zero.checkpoint.SafetensorsReader` reads an import from, the inverse of
    `recipes.checkpoints.hf.llama_state_dict`."""
    sources = {
        f"{prefix}embed.weight": ["model.embed_tokens.weight"],
        f"{prefix}norm.weight": ["model.norm.weight"],
        f"{prefix}head.weight": ["model.embed_tokens.weight" if config.tie_embeddings else "lm_head.weight"],
    }
    for i in range(config.n_layer):
        ours, theirs = f"{prefix}blocks.{i}.", f"model.layers.{i}."
        sources |= {
            ours + "attn_norm.weight": [theirs + "input_layernorm.weight"],
            ours + "attn.q.weight": [theirs + "self_attn.q_proj.weight"],
            ours + "attn.k.weight": [theirs + "self_attn.k_proj.weight"],
            ours + "attn.v.weight": [theirs + "self_attn.v_proj.weight"],
            ours + "attn.proj.weight": [theirs + "self_attn.o_proj.weight"],
            ours + "mlp_norm.weight": [theirs + "post_attention_layernorm.weight"],
            ours + "mlp.gate.weight": [theirs + "mlp.gate_proj.weight"],
            ours + "mlp.up.weight": [theirs + "mlp.up_proj.weight"],
            ours + "mlp.down.weight": [theirs + "mlp.down_proj.weight"],
        }
    return sources


def check_llama_directory(config: GPTConfig, directory: str | Path) -> None:
    """Refuse, before any work, a Llama directory whose shapes are not `config`'s.

    Raises:
        InitFromError: no `config.json` there, or fields that differ (each named, with both values).
    """
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise InitFromError(
            f"model.init_from={directory!s}: no config.json there (a Hugging Face model directory)"
        )
    theirs = json.loads(path.read_text())
    field_of = {name: field for field, name in LLAMA_FIELDS.items()}
    differ = []
    for name, want in llama_values(config).items():
        got: Any = theirs
        for part in name.split("."):
            got = got.get(part) if isinstance(got, dict) else None
        if name == "rope_parameters.rope_theta" and got is None:
            got = theirs.get("rope_theta")  # configs of older transformers
        if want != got:
            differ.append(f"model.{field_of[name]}: {want} here, {name}={got} in {path}")
    if differ:
        raise InitFromError(
            "model.init_from: the model's shape differs from the directory's: " + "; ".join(differ)
        )
