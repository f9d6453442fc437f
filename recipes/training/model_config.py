"""`GPTConfig`: the shape and behaviour of the recipe's GPT (`recipes.training.model`), checked when built."""

from __future__ import annotations

import math
from dataclasses import dataclass

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
"""`torch.compile` backends `GPTConfig.compile_backend` accepts."""


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape and behaviour of a `GPT`. Every field is checked in `__post_init__`."""

    vocab_size: int
    """Number of token ids the embedding and head cover (>= the tokenizer's vocabulary)."""
    max_seq_len: int
    """Longest sequence the rotary tables are built for; longer inputs raise."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Number of query heads; `d_model` must be divisible by it and the head size must be even (RoPE)."""
    d_model: int
    """Width of the residual stream."""
    n_kv_head: int | None = None
    """Key/value heads for grouped-query attention; None means `n_head` (plain multi-head attention)."""
    mlp_hidden: int | None = None
    """SwiGLU hidden width; None means 8/3 * d_model rounded up to a multiple of 64."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""
    tie_embeddings: bool = True
    """Share the token embedding matrix with the output head."""
    init_std: float = 0.02
    """Std of the normal initialisation; residual projections use init_std / sqrt(2 * n_layer)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass (less memory, ~1/3 more compute)."""
    init_from: str | None = None
    """A Hugging Face Llama directory (safetensors, as `recipes.export` writes it) whose weights a fresh
    run starts from (continued pretraining); its config must match these shapes (checked when the
    module is built). Each rank reads only its shards' bytes under a ZeRO strategy. Ignored on a
    resume, which continues from the checkpoint's weights."""
    compile_blocks: bool = False
    """`torch.compile` each block's forward (one graph per block, shared by blocks of one shape): faster
    steps after a first step that compiles. Hooks on the block (a sharding strategy's) stay outside the
    graph; parameter names and `state_dict` keys are unchanged. KV-cache decoding stays eager."""
    compile_backend: str = "inductor"
    """Backend of `compile_blocks`: "inductor" (generated kernels; on CPU it needs a C++ compiler),
    "aot_eager" (traces forward and backward, runs PyTorch's kernels: for checks), "eager" (tracing only)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "n_layer", "n_head", "d_model"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head != 0 or (self.d_model // self.n_head) % 2 != 0:
            raise ValueError(
                f"model.d_model={self.d_model} must be divisible by model.n_head={self.n_head} "
                "into an even head size (RoPE rotates pairs of dimensions)"
            )
        if self.n_kv_head is not None and (self.n_kv_head < 1 or self.n_head % self.n_kv_head != 0):
            raise ValueError(f"model.n_kv_head={self.n_kv_head} must divide model.n_head={self.n_head}")
        if self.mlp_hidden is not None and self.mlp_hidden < 1:
            raise ValueError(f"model.mlp_hidden must be >= 1 or null, got {self.mlp_hidden}")
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ValueError(
                f"model.compile_backend={self.compile_backend!r} is not one of {', '.join(COMPILE_BACKENDS)}"
            )

    def check_tensor_parallel(self, tensor: int) -> None:
        """Refuse a tensor-parallel size that does not split this model into whole heads and equal
        slices (`recipes.training.tensor_parallel`): `tensor` must divide the query heads, the key/value
        heads (each rank keeps whole heads of both), the MLP width and the vocabulary (the embedding's
        and the head's rows).

        Raises:
            ValueError: naming the first field `tensor` does not divide, with its value.
        """
        if tensor < 1:
            raise ValueError(f"parallelism.tensor={tensor} must be >= 1")
        sizes = {
            "model.n_head": self.n_head,
            "model.n_kv_head (key/value heads)": self.kv_heads,
            "model.mlp_hidden (the MLP width)": self.hidden_dim,
            "model.vocab_size": self.vocab_size,
        }
        for name, size in sizes.items():
            if size % tensor != 0:
                raise ValueError(
                    f"parallelism.tensor={tensor} does not divide {name}={size}: each tensor-parallel rank "
                    f"holds 1/{tensor} of it; choose a parallelism.tensor that divides {size}"
                )

    @property
    def residual_std(self) -> float:
        """Std of the projections that write into the residual stream (GPT-2)."""
        return self.init_std / math.sqrt(2 * self.n_layer)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def hidden_dim(self) -> int:
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return 64 * math.ceil(8 * self.d_model / 3 / 64)
