"""Activation bytes per rank that one micro-batch's forward saves for backward: arithmetic only.

What ``lightning-zero estimate`` prints beside the model state, and what the recipe's LightningModule
states for the step profile's ``estimate.activation_bytes`` (beside the bytes it measures with
``saved_tensors_hooks``). The model is the recipe's Llama-style decoder (``recipes/training/model.py``;
Hugging Face's Llama computes its blocks the same way): per block ``x + attn(rmsnorm(x))`` then
``x + swiglu(rmsnorm(x))``, the RMSNorm computed in fp32, RoPE on q and k computed in fp32, k and v
repeated to every query head before ``scaled_dot_product_attention(is_causal=True)``, then a final
RMSNorm, a linear head and a cross-entropy over fp32 logits. Counted from what autograd keeps, each
storage once (:mod:`~lightning_zero.integrations.trainer.saved_activations`), checked equal to it
byte for byte by ``tests/recipes/test_activation_estimate.py``.

With ``h`` the width, ``f`` the MLP's hidden width, ``a`` the query heads, ``s`` the sequence, ``r``
the bytes of an element of the residual stream (the parameters' dtype) and ``m`` of a matmul's output
(16-bit under autocast, else ``r``), one layer saves per token:

  * each of its two RMSNorms: its input in fp32 (the input itself in fp32, else its fp32 copy) ``4h``,
    the fp32 reciprocal root ``4``, the normalized rows ``r h``;
  * the projections' inputs: the norm's output ``r h``, shared by q, k and v, and another shared by
    gate and up; under autocast each projection's own 16-bit copy instead, ``3 m h`` and ``2 m h``;
  * attention with a fused kernel (flash, memory-efficient or cuDNN on CUDA, flash on a CPU: what
    SDPA picks for the recipe's causal training forward): q and k after RoPE, v (k and v repeated to
    ``a`` heads: ``h`` wide whatever the key/value heads) and the output, ``4 m h``, and the
    log-sum-exp of each head, ``w a`` with ``w = max(m, 4)`` (fp32, or fp64 at 64 bits);
  * or with the math kernel (``attention="math"``; torch computes it in fp32 at least): the scaled q
    and k and v ``3 w h`` and the softmax ``w a s``; its output is not kept;
  * the output projection's input (the heads laid out again as rows) ``m h``;
  * the MLP: gate's and up's outputs, ``silu(gate)`` and the product, ``4 m f``.

That is ``44 h + 16 f + 4 a + 8`` bytes in fp32 and ``26 h + 8 f + 4 a + 8`` in 16-bit with a fused
kernel, ``47.3 h`` for the default ``f = 8h/3``: more than Korthikanti et al.'s ``34 h + 5 a s``
("Reducing Activation Recomputation in Large Transformer Models", 2022, eq. 2, 16-bit) for GPT's
LayerNorm and 4h GELU MLP with dropout, which keeps no fp32 copy of a norm's input and three, not
four, tensors of the MLP's width. Under autocast each layer also keeps the 16-bit copies of its
weights, ``m (2h² + 2 h k + 3 h f)`` per micro-batch (``k`` the key/value heads' width).

Activation checkpointing (non-reentrant, each block): a layer keeps its input only, ``r h`` per token,
when the forward ends (the figure here); its backward recomputes one block at a time on top.

On top, per token: the final norm ``4h + 4 + r h``, the head's input ``r h`` (``m h`` under autocast),
the log-softmax of the fp32 logits ``4 V`` and the token ids (int64 inputs and targets, ``16``); per
micro-batch, the head's 16-bit weight copy under autocast ``m V h`` and the loss's fp32 weight ``4``.
The model's buffers (the rotary tables, of which every block keeps a slice) are the caller's to add.

Tensor parallelism with sequence parallelism (``T`` ranks, the recipe's plan): a rank holds ``1/T`` of
each figure but the inputs of the column-parallel projections and of the head, gathered over the
sequence and kept whole, the logits (gathered whole for the ordinary cross-entropy) and the token ids.

Measured on a CPU: equal in every case of the test, and on 2 CPU ranks of tensor parallelism (by hand,
fp32, bf16, bf16 autocast, with and without checkpointing). Not yet on CUDA, whose fused kernels keep
the same tensors give or take a few bytes per head and position (the memory-efficient kernel pads its
log-sum-exp to a multiple of 32 positions and keeps a random seed and offset). Not modelled: compiled
blocks (the compiler's partitioner chooses what they keep), dropout (the recipe has none), pipeline
schedules (the caller multiplies a stage's layers by the micro-batches in flight), transformer-engine's
fp8 layers (counted as their 16-bit weights' precision).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_zero.layout.memory import full_precision

ACTIVATION_DTYPES: dict[str, tuple[int, int, bool]] = {
    # (residual stream, matmul output) bytes per element, autocast
    "64-true": (8, 8, False),
    "32-true": (4, 4, False),
    "16-mixed": (4, 2, True),  # fp32 parameters and residual stream, 16-bit matmuls
    "bf16-mixed": (4, 2, True),
    "16-true": (2, 2, False),
    "bf16-true": (2, 2, False),
    "transformer-engine": (2, 2, False),  # its fp8 layers' own saved copies are not modelled
    "transformer-engine-float16": (2, 2, False),
}
"""Per precision of :data:`~lightning_zero.layout.memory.PRECISION_BYTES` (every one), the element
sizes of the activations and whether matmuls run under autocast (their inputs and weights cast)."""

ATTENTION_KERNELS = ("flash", "math")
"""``flash``: a fused kernel (keeps a log-sum-exp per head); ``math``: the softmax of every pair."""


def swiglu_hidden(d_model: int) -> int:
    """The recipe's default SwiGLU width: ``8/3`` of ``d_model`` rounded up to a multiple of 64."""
    return 64 * math.ceil(8 * d_model / 3 / 64)


@dataclass(frozen=True, kw_only=True)
class ActivationSpec:
    """The model, the micro-batch and the run that :func:`activation_bytes` counts for."""

    seq_len: int
    """Tokens per sequence."""
    micro_batch: int
    """Sequences per micro-batch (on one data-parallel rank)."""
    d_model: int
    """The model's width ``h``."""
    layers: int
    """Transformer blocks (of this rank's pipeline stage, where there is one)."""
    heads: int
    """Query heads ``a`` (the fused kernels' log-sum-exp, the math kernel's softmax)."""
    kv_heads: int | None = None
    """Key/value heads; None: ``heads``. Only autocast's weight copies depend on it (the recipe repeats
    k and v to every query head before attention)."""
    mlp_hidden: int | None = None
    """The SwiGLU's hidden width ``f``; None: :func:`swiglu_hidden`."""
    vocab_size: int = 0
    """Logits per token ``V``; 0: the logits are not counted."""
    precision: str = "bf16-true"
    """As the Trainer's (a name of :data:`ACTIVATION_DTYPES`, or a short one)."""
    attention: str = "flash"
    """One of :data:`ATTENTION_KERNELS`: which kernel SDPA runs."""
    checkpointing: bool = False
    """Activation checkpointing of every block: a block keeps its input only."""
    tensor: int = 1
    """Ranks of a tensor-parallel group, with sequence parallelism (the recipe's plan)."""

    def __post_init__(self) -> None:
        sizes = ("seq_len", "micro_batch", "d_model", "layers", "heads", "tensor")
        for name in sizes:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.d_model % self.heads:
            raise ValueError(f"heads={self.heads} must divide d_model={self.d_model}")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ValueError(f"kv_heads={self.kv_heads} must divide heads={self.heads}")
        if self.mlp_hidden is not None and self.mlp_hidden < 1:
            raise ValueError(f"mlp_hidden={self.mlp_hidden} must be >= 1 or None")
        if self.vocab_size < 0:
            raise ValueError(f"vocab_size={self.vocab_size} must be >= 0 (0: logits not counted)")
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention={self.attention!r}: one of {', '.join(ATTENTION_KERNELS)}")
        full_precision(self.precision)  # raises, naming the precisions there are

    @property
    def hidden(self) -> int:
        """The MLP's hidden width ``f``."""
        return self.mlp_hidden if self.mlp_hidden is not None else swiglu_hidden(self.d_model)

    @property
    def tokens(self) -> int:
        return self.seq_len * self.micro_batch

    @property
    def dtypes(self) -> tuple[int, int, bool]:
        """``(r, m, autocast)``: :data:`ACTIVATION_DTYPES` of the precision."""
        return ACTIVATION_DTYPES[full_precision(self.precision)]


def layer_bytes(spec: ActivationSpec) -> float:
    """What one block keeps for the micro-batch on one rank, weight copies included (the module
    docstring's per-layer figure)."""
    r, m, autocast = spec.dtypes
    h, f, a, t = spec.d_model, spec.hidden, spec.heads, spec.tensor
    if spec.checkpointing:
        return spec.tokens * r * h / t
    norm = 4 * h + 4 + r * h  # fp32 input, fp32 reciprocal root, normalized rows
    gathered = (5 * m if autocast else 2 * r) * h  # the projections' inputs, whole on every tensor rank
    wide = max(m, 4)  # fp32 at least
    if spec.attention == "flash":
        attention = 4 * m * h + wide * a  # q, k, v, output; a log-sum-exp per head
    else:
        attention = 3 * wide * h + wide * a * spec.seq_len  # scaled q, k, v; the softmax
    split = 2 * norm + attention + m * h + 4 * m * f  # ... the output projection's input; the MLP's four
    kv_width = (spec.kv_heads or a) * (h // a)
    weights = m * (2 * h * h + 2 * h * kv_width + 3 * h * f) if autocast else 0
    return spec.tokens * (split / t + gathered) + weights / t


def outer_bytes(spec: ActivationSpec) -> float:
    """What the micro-batch keeps outside the blocks on one rank: the final norm, the head's input and
    weight copy, the logits' log-softmax, the token ids and the loss's weight."""
    r, m, autocast = spec.dtypes
    h, v, t = spec.d_model, spec.vocab_size, spec.tensor
    norm = 4 * h + 4 + r * h
    whole = (m if autocast else r) * h + 4 * v + 16  # the head's gathered input, the logits, the ids
    weights = m * v * h if autocast else 0
    return spec.tokens * (norm / t + whole) + weights / t + 4


def activation_bytes(spec: ActivationSpec) -> float:
    """Bytes per rank that one micro-batch's forward saves for backward (the module docstring): its
    layers' and what lies outside them.

    Args:
        spec: the model, the micro-batch and the run.

    Returns:
        ``spec.layers`` times :func:`layer_bytes` plus :func:`outer_bytes` (the model's buffers not
        included).
    """
    return spec.layers * layer_bytes(spec) + outer_bytes(spec)
