"""A trained GPT as a Hugging Face `transformers` Llama directory (`python -m recipes.export CKPT OUT_DIR`).

Our `recipes.training.model.GPT` is a Llama: pre-norm RMSNorm blocks, RoPE over (first half, second half) of
each head (HF's `rotate_half` layout, so q/k rows need no permutation), SwiGLU, grouped-query attention,
no biases, optional tied head. Every `GPTConfig` field is either mapped onto a `LlamaConfig` field
(`LLAMA_FIELDS`) or only matters for training (`TRAINING_ONLY_FIELDS`); a config with any other field
(a feature Llama lacks) is refused, naming the field, rather than exported into a model that computes
something else. All of `conf/model/` (tiny, gpt2_124m, llama_1b, llama_7b) maps.

Weight layout: our `attn.q`, `attn.k`, `attn.v` are `q_proj`, `k_proj`, `v_proj` as they are (a
checkpoint of the former fused `attn.qkv` is split when the model loads it); a tied head is written
once (as `embed_tokens`, with `tie_word_embeddings: true`).

OUT_DIR receives `config.json`, `generation_config.json`, `model.safetensors` (or
`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json` above `--max-shard-size`) and the
tokenizer (`tokenizer.json`, `tokenizer_config.json`): a trained BPE as it is, the byte tokenizer as an
equivalent byte-level BPE with no merges whose id i is byte i. Everything is written into a temporary
sibling directory that replaces OUT_DIR only when complete; a non-empty OUT_DIR is kept unless `--force`.

Limits: the whole model is loaded in memory (fp32 checkpoint: 4 bytes per parameter, plus the copy
being written); `recipes.evaluate`-style checks of the exported model are the test's, not the CLI's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from recipes.checkpoints.load import check_vocabulary, find_tokenizer, load_module, require_checkpoint
from recipes.data import END_OF_TEXT, BPETokenizer, ByteTokenizer, Tokenizer
from recipes.training import GPTConfig
from recipes.training.llama import LLAMA_FIELDS, llama_sources

__all__ = ["LLAMA_FIELDS", "ExportError", "export", "llama_config", "llama_sources", "llama_state_dict"]

TRAINING_ONLY_FIELDS = {
    "init_std",
    "activation_checkpointing",
    "compile_blocks",
    "compile_backend",
    "init_from",
}
"""`GPTConfig` fields that do not change what a trained model computes."""

SAFETENSORS_INDEX = "model.safetensors.index.json"


class ExportError(RuntimeError):
    """A model or destination that cannot be exported; the message names the field or path."""


def llama_config(config: GPTConfig, bos_id: int | None, eos_id: int | None, dtype: torch.dtype) -> Any:
    """The `transformers.LlamaConfig` equivalent to `config`.

    Raises:
        ExportError: if `config` has a field that neither maps to Llama nor is training-only.
    """
    from transformers import LlamaConfig

    for item in dataclasses.fields(config):
        if item.name not in LLAMA_FIELDS and item.name not in TRAINING_ONLY_FIELDS:
            raise ExportError(
                f"model.{item.name} has no Llama equivalent: recipes.export maps only "
                f"{', '.join(sorted(LLAMA_FIELDS))} (and ignores {', '.join(sorted(TRAINING_ONLY_FIELDS))})"
            )
    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.hidden_dim,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_seq_len,
        initializer_range=config.init_std,
        rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=config.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=None,
        architectures=["LlamaForCausalLM"],
        dtype=dtype,
    )


def llama_state_dict(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Our `GPT.state_dict()` under `LlamaForCausalLM`'s names (a tied head once, as the embedding)."""
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"]}
    if not config.tie_embeddings:
        out["lm_head.weight"] = state["head.weight"]
    for i in range(config.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        out |= {
            theirs + "input_layernorm.weight": state[ours + "attn_norm.weight"],
            theirs + "self_attn.q_proj.weight": state[ours + "attn.q.weight"],
            theirs + "self_attn.k_proj.weight": state[ours + "attn.k.weight"],
            theirs + "self_attn.v_proj.weight": state[ours + "attn.v.weight"],
            theirs + "self_attn.o_proj.weight": state[ours + "attn.proj.weight"],
            theirs + "post_attention_layernorm.weight": state[ours + "mlp_norm.weight"],
            theirs + "mlp.gate_proj.weight": state[ours + "mlp.gate.weight"],
            theirs + "mlp.up_proj.weight": state[ours + "mlp.up.weight"],
            theirs + "mlp.down_proj.weight": state[ours + "mlp.down.weight"],
        }
    return {name: tensor.contiguous() for name, tensor in out.items()}


def shard_plan(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Consecutive groups of tensor names, each under `max_shard_bytes` (a larger tensor goes alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_weights(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int) -> list[str]:
    """Write `model.safetensors`, or numbered shards and their index; return the file names."""
    from safetensors.torch import save_file

    plan = shard_plan(tensors, max_shard_bytes)
    if len(plan) == 1:
        save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    weight_map: dict[str, str] = {}
    for file_name, keys in zip(names, plan, strict=True):
        save_file({k: tensors[k] for k in keys}, out_dir / file_name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(keys, file_name)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, SAFETENSORS_INDEX]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (what `tokenizers`' ByteLevel uses)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def hf_tokenizer(tokenizer: Tokenizer, max_seq_len: int | None = None) -> Any:
    """A `transformers.PreTrainedTokenizerFast` that encodes and decodes like `tokenizer`."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    limits = {} if max_seq_len is None else {"model_max_length": max_seq_len}
    if isinstance(tokenizer, ByteTokenizer):
        vocab = {char: byte for byte, char in bytes_to_unicode().items()}  # token id == byte value
        raw = RawTokenizer(models.BPE(vocab=vocab, merges=[]))
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        raw.decoder = decoders.ByteLevel()
        return PreTrainedTokenizerFast(tokenizer_object=raw, clean_up_tokenization_spaces=False, **limits)
    if isinstance(tokenizer, BPETokenizer):
        raw = RawTokenizer.from_file(str(tokenizer.path))
        eos = END_OF_TEXT if raw.token_to_id(END_OF_TEXT) is not None else None
        return PreTrainedTokenizerFast(
            tokenizer_object=raw, eos_token=eos, clean_up_tokenization_spaces=False
        )
    raise ExportError(f"no Hugging Face equivalent known for the tokenizer {type(tokenizer).__name__}")


def end_of_text_id(tokenizer: Tokenizer) -> int | None:
    """The id of `<|endoftext|>` (a BPE's document separator); None for bytes (a blank line ends one)."""
    if isinstance(tokenizer, BPETokenizer):
        ids = tokenizer.encode(END_OF_TEXT)
        return ids[0] if len(ids) == 1 else None
    return None


def check_destination(out_dir: Path, force: bool) -> None:
    """Raise `ExportError` if `out_dir` exists, is not an empty directory, and `force` is off."""
    if out_dir.exists() and not force and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir} exists and is not empty: choose another OUT_DIR or pass --force")


def prepare_destination(out_dir: Path) -> Path:
    """A fresh temporary sibling of `out_dir` to write into."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def commit_destination(tmp: Path, out_dir: Path) -> None:
    """Put the complete `tmp` at `out_dir`, replacing what was there (only reached with --force)."""
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        os.replace(tmp, out_dir)


def export(
    checkpoint: str | Path,
    out_dir: str | Path,
    tokenizer_spec: str = "auto",
    max_shard_bytes: int = 5 * 10**9,
    dtype: torch.dtype | None = None,
    force: bool = False,
) -> list[str]:
    """Write the Hugging Face Llama directory `out_dir` from `checkpoint`; return the files written.

    Args:
        checkpoint: a Lightning checkpoint file or a lightning-zero sharded checkpoint directory.
        out_dir: the directory to create (must not exist or be empty, unless `force`).
        tokenizer_spec: "auto", "byte" or a tokenizer.json path (see `load.find_tokenizer`).
        max_shard_bytes: largest safetensors file; above it the weights are split into several.
        dtype: cast the weights to it; None keeps float32 (as `PretrainModule` holds them).
        force: replace a non-empty `out_dir`.

    Raises:
        LoadError: a missing or unreadable checkpoint or tokenizer.
        ExportError: a model config without a Llama equivalent, or a non-empty `out_dir`.
    """
    out_dir = Path(out_dir)
    check_destination(out_dir, force)  # before the (long) load
    require_checkpoint(checkpoint)
    tokenizer = find_tokenizer(checkpoint, tokenizer_spec)
    if not isinstance(tokenizer, ByteTokenizer | BPETokenizer):  # SentencePiece, tiktoken
        raise ExportError(
            f"no Hugging Face equivalent known for the tokenizer {type(tokenizer).__name__} "
            f"({getattr(tokenizer, 'path', '')}): export supports the byte tokenizer and tokenizer.json; "
            "recipes.generate and recipes.evaluate take any"
        )
    module = load_module(checkpoint)
    check_vocabulary(module, tokenizer)
    config = module.model_config
    state = llama_state_dict(module.model.state_dict(), config)
    if dtype is not None:
        state = {name: tensor.to(dtype) for name, tensor in state.items()}
    eos_id = end_of_text_id(tokenizer)
    hf_config = llama_config(config, bos_id=None, eos_id=eos_id, dtype=state["model.norm.weight"].dtype)
    tmp = prepare_destination(out_dir)
    try:
        from transformers import GenerationConfig

        hf_config.save_pretrained(tmp)
        GenerationConfig(bos_token_id=None, eos_token_id=eos_id).save_pretrained(tmp)
        hf_tokenizer(tokenizer, config.max_seq_len).save_pretrained(tmp)
        write_weights(state, tmp, max_shard_bytes)
        commit_destination(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(p.name for p in out_dir.iterdir())
