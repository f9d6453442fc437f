"""A decoder-only transformer (Llama-style GPT) for the pretraining recipes.

Architecture: token embedding -> N x [RMSNorm -> causal self-attention with rotary position embeddings
(RoPE) -> residual, RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> linear head (optionally tied to the
embedding). Attention goes through `F.scaled_dot_product_attention(is_causal=True)`, so PyTorch picks the
flash / memory-efficient kernel where one exists. Grouped-query attention is available through
`n_kv_head`.

Initialisation follows GPT-2 / Llama: every weight ~ N(0, init_std), except the two projections that
write into the residual stream (attention output, MLP down), whose std is divided by sqrt(2 * n_layer)
so the residual variance does not grow with depth. Each module initializes the tensors it owns (or
its own layers') in its `reset_parameters()`, called at the end of its `__init__`; the model holds no
init pass over the whole: built on the meta device (`Trainer.init_module(empty_init=True)`) the
strategy replays those calls module by module, children first, and gets the very values eager
construction gives (`lightning_zero.engine.deferred_init`), one block at a time under `"zero3"`.

The model never imports `torch.distributed`: data parallelism (DDP, ZeRO) is applied by the Lightning
strategy. It can be built on the meta device (`with torch.device("meta"): GPT(config)`) to count the
parameters of a large size without allocating them.

Compilation (`compile_blocks`): each block's body (`Block.layers`) runs through `torch.compile`
(`fullgraph=True`), called from the eager `Block.forward`, so hooks on a block (a sharding strategy's
gather and free) stay outside the graph and parameter names are unchanged. Activation checkpointing wraps
the compiled block as it wraps an eager one: its recomputation runs the compiled forward again, through
the block's hooks. One graph serves every block (parameters are graph inputs). Decoding with a KV cache
stays eager (the cache position would specialise the graph).

Inference: `forward(idx, cache=KVCache(...))` feeds tokens after those already in the cache. Each
layer writes the new keys/values (after RoPE, at their absolute positions) into preallocated
(batch, n_kv_head, capacity, head_dim) buffers and attends over everything cached so far; the
training path (`cache=None`) is untouched. `generate` decodes with a cache while the sequence fits in
`max_seq_len` and, past it, recomputes a sliding window of the last `max_seq_len` tokens per step
(RoPE positions are absolute, so a full cache cannot slide). Batch decoding assumes prompts of equal
length (no padding); it is meant for samples and checks, not for serving.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from recipes.training.model_config import COMPILE_BACKENDS, GPTConfig

__all__ = ["COMPILE_BACKENDS", "GPT", "GPTConfig", "KVCache"]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (no mean subtraction, no bias), computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin tables for rotary embeddings, each (max_seq_len, head_dim // 2)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate dimension pairs (i, i + head_dim / 2) of `x` (B, H, T, head_dim) by position angles."""
    x1, x2 = x.float().chunk(2, dim=-1)  # each (B, H, T, head_dim // 2)
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.type_as(x)


@dataclass
class KVCache:
    """Keys and values of the tokens a `GPT` has seen, per layer, for incremental decoding.

    `keys[i]` and `values[i]` are (batch, n_kv_head, capacity, head_dim); positions `[0, length)` are
    filled. `GPT.forward(idx, cache)` appends `idx.shape[1]` positions and advances `length`.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0
    capacity: int = field(init=False)

    def __post_init__(self) -> None:
        self.capacity = self.keys[0].shape[2]

    @classmethod
    def empty(
        cls,
        config: GPTConfig,
        batch: int,
        capacity: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """A cache for `batch` sequences of up to `capacity` (default `max_seq_len`) tokens."""
        capacity = config.max_seq_len if capacity is None else min(capacity, config.max_seq_len)
        shape = (batch, config.kv_heads, capacity, config.head_dim)
        make = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(2 * config.n_layer)]
        return cls(keys=make[: config.n_layer], values=make[config.n_layer :])


def split_fused_qkv(
    module: Attention,
    state_dict: dict[str, torch.Tensor],
    prefix: str,
    *args: object,
) -> None:
    """Load-state-dict pre-hook of `Attention`: a full state dict of the former layout, one fused
    `attn.qkv.weight` of rows [q (n_head * head_dim), k (kv_heads * head_dim), v (kv_heads * head_dim)],
    is split into `attn.q.weight`, `attn.k.weight`, `attn.v.weight` in place (older checkpoints load)."""
    fused = state_dict.pop(prefix + "qkv.weight", None)
    if fused is None:
        return
    rows = [module.q.out_features, module.k.out_features, module.v.out_features]
    if fused.shape[0] != sum(rows):
        state_dict[prefix + "qkv.weight"] = fused  # left for load_state_dict to report as unexpected
        return
    for name, part in zip("qkv", fused.split(rows, dim=0), strict=True):
        state_dict[f"{prefix}{name}.weight"] = part


class Attention(nn.Module):
    """Causal self-attention with RoPE and optional grouped key/value heads.

    Separate `q`, `k`, `v` projections (Llama's q_proj / k_proj / v_proj), so that a column-parallel
    split of each gives a rank whole heads of each; a state dict with the former fused `qkv` loads
    (`split_fused_qkv`)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.q = nn.Linear(config.d_model, config.n_head * config.head_dim, bias=False)
        self.k = nn.Linear(config.d_model, config.kv_heads * config.head_dim, bias=False)
        self.v = nn.Linear(config.d_model, config.kv_heads * config.head_dim, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.init_std, self.residual_std = config.init_std, config.residual_std
        self.register_load_state_dict_pre_hook(split_fused_qkv)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for layer in (self.q, self.k, self.v):  # in this order: the rows of the former fused `qkv`
            nn.init.normal_(layer.weight, mean=0.0, std=self.init_std)
        nn.init.normal_(self.proj.weight, mean=0.0, std=self.residual_std)  # writes into the residual

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    ) -> torch.Tensor:
        """`cache`: this layer's (keys, values, start) - the new positions are written at `start`."""
        batch, seq, _ = x.shape
        # Head counts from the projections' widths: under tensor parallelism (column-parallel q, k, v)
        # this rank holds H / T query and KV / T key/value heads, each of head_dim.
        q = self.q(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        v = self.v(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        mask: torch.Tensor | None = None
        if cache is not None:
            cached_k, cached_v, start = cache  # each (B, KV, capacity, D)
            cached_k[:, :, start : start + seq] = k
            cached_v[:, :, start : start + seq] = v
            k, v = (
                cached_k[:, :, : start + seq],
                cached_v[:, :, : start + seq],
            )  # (B, KV, S, D), S = start + T
            if start > 0 and seq > 1:  # query i sits at start + i: it sees keys 0 .. start + i
                mask = torch.ones(seq, start + seq, dtype=torch.bool, device=x.device).tril(start)
        if k.shape[1] != q.shape[1]:
            repeat = q.shape[1] // k.shape[1]
            k, v = (
                k.repeat_interleave(repeat, dim=1),
                v.repeat_interleave(repeat, dim=1),
            )  # (B, H, start + T, D)
        if cache is None or (cache[2] == 0 and seq > 1):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        else:  # one new token sees the whole cache; several after a prefix need the shifted mask
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, D)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    """Gated MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.d_model, config.hidden_dim, bias=False)
        self.up = nn.Linear(config.d_model, config.hidden_dim, bias=False)
        self.down = nn.Linear(config.hidden_dim, config.d_model, bias=False)
        self.init_std, self.residual_std = config.init_std, config.residual_std
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate.weight, mean=0.0, std=self.init_std)
        nn.init.normal_(self.up.weight, mean=0.0, std=self.init_std)
        nn.init.normal_(self.down.weight, mean=0.0, std=self.residual_std)  # writes into the residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class TokenEmbedding(nn.Embedding):
    """The token embedding, initialized ~ N(0, init_std) (GPT-2) in `reset_parameters()`."""

    def __init__(self, vocab_size: int, d_model: int, init_std: float) -> None:
        self.init_std = init_std  # read by reset_parameters(), which nn.Embedding.__init__ calls
        super().__init__(vocab_size, d_model)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)


class OutputHead(nn.Linear):
    """The output layer (no bias), initialized ~ N(0, init_std) (GPT-2) in `reset_parameters()`."""

    def __init__(self, d_model: int, vocab_size: int, init_std: float) -> None:
        self.init_std = init_std  # read by reset_parameters(), which nn.Linear.__init__ calls
        super().__init__(d_model, vocab_size, bias=False)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config)
        self.compile_backend = config.compile_backend if config.compile_blocks else None
        """Backend `forward` compiles `layers` with (None: eager); the compiled callable is shared by all
        blocks (`compiled_layers`), not held by the block."""

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    ) -> torch.Tensor:
        if cache is None and self.compile_backend is not None:
            return compiled_layers(self.compile_backend)(self, x, cos, sin)
        return self.layers(x, cos, sin, cache)

    def layers(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    ) -> torch.Tensor:
        """The block's computation, without the choice between compiled and eager."""
        x = x + self.attn(self.attn_norm(x), cos, sin, cache)
        return x + self.mlp(self.mlp_norm(x))


@functools.cache
def compiled_layers(backend: str) -> Callable[..., torch.Tensor]:
    """`Block.layers` compiled with `backend`: one wrapper per backend, whose graphs every block shares
    (dynamo caches per code object; parameters are graph inputs, guarded by shape, not identity)."""
    return torch.compile(Block.layers, backend=backend, fullgraph=True)


class GPT(nn.Module):
    """Decoder-only language model; `forward(idx)` returns logits (batch, seq, vocab_size)."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = TokenEmbedding(config.vocab_size, config.d_model, config.init_std)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.head = OutputHead(config.d_model, config.vocab_size, config.init_std)
        if config.tie_embeddings:  # the head's own weight (drawn above) is dropped, as before
            self.head.weight = self.embed.weight
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)  # (max_seq_len, head_dim // 2)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)  # (max_seq_len, head_dim // 2)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The RoPE tables (the model's own tensors; its layers initialize theirs)."""
        config = self.config
        like = {"device": self.rope_cos.device, "dtype": self.rope_cos.dtype}  # e.g. bf16 under "bf16-true"
        cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        self.rope_cos, self.rope_sin = cos.to(**like), sin.to(**like)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Logits (B, T, vocab_size) of `idx` (B, T); with `cache`, `idx` follows the cached tokens.

        Raises:
            ValueError: if the sequence (cached tokens included) is longer than `max_seq_len` or the cache.
        """
        seq = idx.shape[1]
        start = 0 if cache is None else cache.length
        if start + seq > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {start + seq} exceeds model.max_seq_len={self.config.max_seq_len}"
            )
        if cache is not None and start + seq > cache.capacity:
            raise ValueError(f"sequence length {start + seq} exceeds the KV cache's {cache.capacity}")
        positions = slice(start, start + seq)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # (T, head_dim // 2)
        x = self.embed(idx)  # (B, T, d_model)
        for i, block in enumerate(self.blocks):
            if cache is not None:
                x = block(x, cos, sin, (cache.keys[i], cache.values[i], start))
            else:
                x = self.block_forward(i, x, cos, sin)
        if cache is not None:
            cache.length = start + seq
        return self.head(self.norm(x))  # (B, T, vocab_size)

    def block_forward(
        self, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """Block `index` on `x` without a cache, under activation checkpointing when it is on and the
        model trains with gradients."""
        block = self.blocks[index]
        if self.config.activation_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(block, x, cos, sin, use_reentrant=False)  # type: ignore[no-any-return]
        return block(x, cos, sin)  # type: ignore[no-any-return]

    def layers(self) -> list[nn.Module]:
        """The model's layers in the order `forward` runs them: the embedding, each block, the final
        norm, the head (the pipeline stages are cut from this list: `PretrainModule.pipeline_layers`)."""
        return [self.embed, *self.blocks, self.norm, self.head]

    def layer_forward(self, index: int, x: torch.Tensor, seq_len: int) -> torch.Tensor:
        """`layers()[index]` on the previous layer's output `x` (token ids for the embedding) in training
        or evaluation (no cache), as `forward` runs it; the blocks take the rotary tables of the first
        `seq_len` positions (the whole sequence's, which a sequence-parallel `x` holds a part of)."""
        if index == 0:
            return self.embed(x)  # type: ignore[no-any-return]
        if index <= len(self.blocks):
            cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]  # (T, head_dim // 2)
            return self.block_forward(index - 1, x, cos, sin)
        return self.norm(x) if index == len(self.blocks) + 1 else self.head(x)  # type: ignore[no-any-return]

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameter count (shared tensors once); optionally without the input embedding table."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embedding and not self.config.tie_embeddings:
            total -= self.embed.weight.numel()
        return total

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward), PaLM appendix B: 6 N + 12 L d T.

        N counts every matmul weight, the head included even when tied, the embedding lookup excluded;
        the second term is the attention score and value products over a context of `seq_len` tokens.
        """
        seq = seq_len if seq_len is not None else self.config.max_seq_len
        matmul_params = self.num_params(exclude_embedding=True)  # a tied table counts once, as the head
        attention = 12 * self.config.n_layer * self.config.d_model * seq
        return float(6 * matmul_params + attention)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
    ) -> torch.Tensor:
        """Sample `max_new_tokens` tokens after the prompt `idx` (batch, prompt_len).

        Args:
            idx: prompt token ids, (batch, prompt_len), at least one token.
            max_new_tokens: how many tokens to append.
            temperature: softmax temperature; 0 means greedy decoding.
            top_k: keep only the k most likely tokens before sampling; None keeps all.
            generator: random generator for reproducible samples.
            use_cache: decode with a `KVCache` (same tokens as recomputing the context at every step).

        Returns:
            (batch, prompt_len + max_new_tokens) token ids.
        """
        was_training = self.training
        self.eval()
        cache: KVCache | None = None
        if use_cache and idx.shape[1] < self.config.max_seq_len:
            capacity = idx.shape[1] + max_new_tokens
            dtype = self.embed.weight.dtype
            cache = KVCache.empty(self.config, idx.shape[0], capacity, device=idx.device, dtype=dtype)
        for _ in range(max_new_tokens):
            if cache is not None and idx.shape[1] > cache.capacity:
                cache = None  # full: from here on recompute the sliding window
            if cache is not None:
                logits = self(idx[:, cache.length :], cache)[:, -1, :].float()  # (B, vocab_size)
            else:
                context = idx[:, -self.config.max_seq_len :]  # (B, <= max_seq_len)
                logits = self(context)[:, -1, :].float()  # (B, vocab_size)
            if temperature <= 0:
                next_id = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.shape[-1]:
                    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                next_id = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
            idx = torch.cat((idx, next_id), dim=1)
        self.train(was_training)
        return idx
