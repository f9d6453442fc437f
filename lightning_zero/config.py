"""Settings shared by :class:`~lightning_zero.ShardedAdamW` and :class:`~lightning_zero.ZeroStrategy`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """How gradients are bucketed, communicated and sharded. Every field has a default."""

    stage: int = 2
    """1: all-reduce each bucket and keep the owned slice; 2: reduce-scatter each bucket."""
    bucket_cap_mb: float = 25.0
    """Size cap of a gradient bucket in MiB of parameter data (torch DDP's default)."""
    first_bucket_cap_mb: float = 1.0
    """Cap of the first bucket (the last layers), small so communication starts early in backward."""
    overlap_comm: bool = True
    """Launch each bucket's collective from the gradient hooks while backward goes on. ``False``
    launches all of them after backward (useful to measure what overlap buys)."""
    overlap_param_gather: bool = False
    """Leave the parameter all-gathers of ``step()`` in flight: each module's forward waits for the
    buckets holding its parameters (:mod:`lightning_zero.engine.param_gather`). Everything else that reads
    parameters must wait first; ``ZeroStrategy`` does it for Lightning's phases and callbacks. A
    standalone :class:`~lightning_zero.ShardedAdamW` needs ``install_forward_waits(model)``; until
    then ``step()`` waits for its gathers as without this option."""
    reduce_dtype: str | None = None
    """Dtype of gradients on the wire: ``None`` (the master dtype: fp32 for 16-bit parameters, the
    parameters' dtype otherwise), ``"fp32"``, ``"bf16"`` (half the bytes of fp32, like DDP's bf16
    compression hook; what DDP sends for a ``bf16-true`` model) or ``"fp16"``. Gradients are always
    accumulated, across micro-batches and in the owned shard, in the master dtype."""
    find_unused_parameters: bool = False
    """Agree across ranks, every step, which parameters got a gradient (one small all-reduce), so a
    parameter that no rank used is skipped by the optimizer exactly as ``torch.optim.AdamW`` skips a
    parameter whose ``.grad`` is ``None``. When ``False``, a missing gradient counts as zero (weight
    decay and momentum still move the parameter) and a warning says so once — on one rank as on N."""
    align_numel: int = 1
    """Buckets are padded to a multiple of ``world_size * align_numel`` elements."""
    skip_nonfinite_steps: int = 0
    """``0`` (off): a non-finite gradient reaches the parameters, as under DDP. ``K > 0``: every
    bucket is checked for inf/NaN on each rank before it is sent, the ranks agree once per step, and
    a step in which any rank saw one is skipped on every rank (gradients dropped; parameters, masters,
    moments and step counts unchanged; LR schedulers keep stepping, as with torch's ``GradScaler``);
    the ``K``-th skipped step in a row raises :class:`~lightning_zero.NonFiniteGradientError` on
    every rank, naming the step and the ranks (``K=1``: raise at the first, nothing updated). Costs
    one min/max pass over each bucket and, unless ``find_unused_parameters`` already makes one, one
    small all-reduce and one host synchronisation per step (:mod:`lightning_zero.engine.nonfinite`)."""

    def __post_init__(self) -> None:
        if self.stage not in (1, 2):
            raise ValueError(
                f"stage must be 1 or 2, got {self.stage!r} (stage 3, sharded parameters, is not supported)"
            )
        for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a number > 0 (MiB), got {value!r}")
        if self.reduce_dtype is not None and self.reduce_dtype not in _REDUCE_DTYPES:
            raise ValueError(
                f"reduce_dtype must be None or one of {sorted(_REDUCE_DTYPES)}, got {self.reduce_dtype!r}"
            )
        if (
            isinstance(self.align_numel, bool)
            or not isinstance(self.align_numel, int)
            or self.align_numel < 1
        ):
            raise ValueError(f"align_numel must be an integer >= 1, got {self.align_numel!r}")
        skips = self.skip_nonfinite_steps
        if isinstance(skips, bool) or not isinstance(skips, int) or skips < 0:
            raise ValueError(
                f"skip_nonfinite_steps must be an integer >= 0 (0: off; K > 0: skip steps with inf/NaN "
                f"gradients, raise at the K-th in a row), got {skips!r}"
            )
        for name in ("overlap_comm", "overlap_param_gather", "find_unused_parameters"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def wire_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype a gradient of ``param_dtype`` travels in."""
        return master_dtype(param_dtype) if self.reduce_dtype is None else _REDUCE_DTYPES[self.reduce_dtype]


def master_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """Optimizer arithmetic dtype: fp32 for 16-bit parameters, the parameter dtype otherwise."""
    return torch.float32 if param_dtype.itemsize < 4 else param_dtype
