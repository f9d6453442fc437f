"""Settings shared by :class:`~lightning_zero.ShardedAdamW` and :class:`~lightning_zero.ZeroStrategy`.

The fields are the one source of each setting's name, default, type and docstring (the strategies'
signatures, the recipes' schema and the docs' tables are read from them). This module is read without
torch (``lightning-zero estimate`` takes its defaults from here): torch is imported where a dtype is
made.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

STAGE3_ONLY = ("reshard_after_forward", "prefetch_units", "unit_modules", "min_unit_numel")
"""Fields that apply to stage 3 only: refused at their non-default values below it."""

_REDUCE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "int8": "int8"}
"""``reduce_dtype``'s names, and the ``torch`` dtypes they stand for."""


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """How gradients are bucketed, communicated and sharded. Every field has a default."""

    stage: int = 2
    """1: all-reduce each bucket and keep the owned slice; 2: reduce-scatter each bucket; 3: as 2, and
    the parameters are sharded too: each unit's are all-gathered around its forward and backward
    (:mod:`lightning_zero.engine.unit_gather`; needs the model, e.g. ``ShardedAdamW(module=...)``)."""
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
    accumulated, across micro-batches and in the owned shard, in the master dtype. ``"int8"``
    (experimental): each rank's part for each destination is sent as int8 blocks of 256 with an fp32
    scale each (1.016 bytes per element) by an all-to-all, and summed in the master dtype on arrival
    (:class:`~lightning_zero.engine.codecs.Int8Codec`); under node-aware sharding the reduction inside a
    shard group stays in the master dtype and only the all-reduce across the groups is quantized."""
    error_feedback: bool = False
    """``reduce_dtype="int8"`` only: each rank keeps the quantization error of its last send of each
    bucket and adds it to the next one, so the errors do not accumulate over steps (flat sharding:
    the sum of what was sent over any number of steps is within one step's bound of the sum of the
    gradients). Costs a residual of the bucket's size in the master dtype on every rank (4 bytes per
    trainable parameter for fp32 masters: stage 2's gradient memory saving is given back). Under
    node-aware sharding it applies to each rank's part sent across the groups (a residual of ``1/G``
    of the bucket); the re-quantization of the summed chunks has none. Dropped by a step skipped for
    non-finite gradients or by the loss scaler; not saved in checkpoints."""
    gather_dtype: str | None = None
    """Stage 3: dtype of the parameter all-gathers in training forwards and backwards. ``None``: the
    parameters' dtype (exact). ``"int8"`` (experimental): each rank's shard is sent as int8 blocks of
    256 with an fp32 scale each and every rank (the owner too) computes with the dequantized values;
    the shard itself, the optimizer's master, stays exact, so the error never accumulates into the
    weights. Gathers for evaluation (no gradients), ``state_dict()``, checkpoints and
    ``gathered(...)`` stay exact (:mod:`lightning_zero.engine.unit_gather`)."""
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
    sharded_accumulation: bool | None = None
    """Gradient accumulation (the micro-batches inside ``no_sync``, Lightning's
    ``accumulate_grad_batches``); ``None``: ``True`` at stage 3, ``False`` at stages 1 and 2 and
    under pipeline parallelism (a schedule's micro-batches accumulate: one reduction per step).
    ``False`` keeps every bucket's local sum in a full-size buffer for
    the window and sends it once, at the last micro-batch (DDP's ``no_sync``: fewer elements sent,
    ``4`` bytes per parameter held across the window); ``True`` reduce-scatters (stage 1:
    all-reduces) every micro-batch's buckets into this rank's shard, as FSDP2 does by default, so no
    full-size gradient buffer outlives a bucket's collective (for a model whose gradients do not fit;
    the step sends each bucket once more per extra micro-batch). Under node-aware sharding the
    all-reduce across replica groups still runs once per optimizer step, on the accumulated shard."""

    reshard_after_forward: bool = True
    """Stage 3: free each unit's full parameters after its forward and gather them again for its
    backward (the root's stay, and those of the unit that ran last in the previous forward, whose
    backward comes first). ``False`` keeps them from forward to backward: one all-gather per step
    fewer, ZeRO-2's parameter memory at the peak."""
    prefetch_units: int = 1
    """Stage 3: how many units ahead (forward order, then backward order) to start gathering while a
    unit computes; with ``reshard_after_forward`` at most ``1 + prefetch_units`` units and the root
    hold full parameters at once."""
    unit_modules: tuple[type, ...] | None = None
    """Stage 3: the module classes that are units of gathering (e.g. ``(Block,)``); ``None``: each
    module held in an ``nn.ModuleList``/``nn.Sequential`` with at least ``min_unit_numel`` trainable
    elements and no such module around it (a block's own ``nn.Sequential`` stays in the block's unit),
    and each other layer holding that many itself (an embedding, an output layer;
    :mod:`lightning_zero.layout.units`). The rest is the root unit."""
    min_unit_numel: int = 100_000
    """Stage 3 without ``unit_modules``: smaller blocks and layers join the root unit (a gather per unit
    costs a collective's latency)."""

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {self.stage!r}")
        for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a number > 0 (MiB), got {value!r}")
        if self.reduce_dtype is not None and self.reduce_dtype not in _REDUCE_DTYPES:
            raise ValueError(
                f"reduce_dtype must be None or one of {sorted(_REDUCE_DTYPES)}, got {self.reduce_dtype!r}"
            )
        self._check_quantized_fields()
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
        flags = (
            "overlap_comm",
            "overlap_param_gather",
            "find_unused_parameters",
            "reshard_after_forward",
        )
        for name in flags:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.sharded_accumulation is not None and not isinstance(self.sharded_accumulation, bool):
            raise ValueError(
                f"sharded_accumulation must be None (stage 3: True, else False), True or False, "
                f"got {self.sharded_accumulation!r}"
            )
        self._check_stage3_fields()

    @property
    def accumulates_sharded(self) -> bool:
        """Whether micro-batches inside ``no_sync`` are reduced into the shard as they come
        (``sharded_accumulation``, resolved for the stage)."""
        return self.stage == 3 if self.sharded_accumulation is None else self.sharded_accumulation

    def _check_quantized_fields(self) -> None:
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"error_feedback must be True or False, got {self.error_feedback!r}")
        if self.error_feedback and self.reduce_dtype != "int8":
            raise ValueError(
                f"error_feedback=True applies to reduce_dtype='int8' only (the quantization error it carries "
                f"over), got reduce_dtype={self.reduce_dtype!r}"
            )
        if self.gather_dtype not in (None, "int8"):
            raise ValueError(
                f"gather_dtype must be None (exact parameter gathers) or 'int8', got {self.gather_dtype!r}"
            )
        if self.gather_dtype is not None and self.stage != 3:
            raise ValueError(
                f"gather_dtype={self.gather_dtype!r} applies to stage 3 only (below it the gathered "
                f"parameters are the weights themselves, and quantizing them would accumulate the "
                f"error), got stage={self.stage}"
            )

    def _check_stage3_fields(self) -> None:
        prefetch, numel, classes = self.prefetch_units, self.min_unit_numel, self.unit_modules
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch_units must be an integer >= 0, got {prefetch!r}")
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"min_unit_numel must be an integer >= 0, got {numel!r}")
        if classes is not None and (
            not isinstance(classes, tuple) or not all(isinstance(c, type) for c in classes)
        ):
            raise ValueError(f"unit_modules must be None or a tuple of module classes, got {classes!r}")
        defaults = {f.name: f.default for f in fields(self) if f.name in STAGE3_ONLY}
        changed = [name for name, value in defaults.items() if getattr(self, name) != value]
        if self.stage != 3 and changed:
            raise ValueError(
                f"{', '.join(changed)} only apply to stage 3 (sharded parameters), got stage={self.stage}; "
                "leave them at their defaults or set stage=3"
            )
        if self.stage == 3 and self.overlap_param_gather:
            raise ValueError(
                "overlap_param_gather applies to stages 1 and 2; stage 3 always gathers parameters in "
                "the forward (prefetch_units sets how far ahead)"
            )

    def wire_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype a gradient of ``param_dtype`` travels in."""
        if self.reduce_dtype is None:
            return master_dtype(param_dtype)
        import torch  # here, not at the top: see the module docstring

        dtype: torch.dtype = getattr(torch, _REDUCE_DTYPES[self.reduce_dtype])
        return dtype


def master_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """Optimizer arithmetic dtype: fp32 for 16-bit parameters, the parameter dtype otherwise."""
    import torch  # here, not at the top: see the module docstring

    return torch.float32 if param_dtype.itemsize < 4 else param_dtype
