"""Model-state memory per rank of ``ddp`` and ZeRO stages 1, 2 and 3: arithmetic only.

What ``lightning-zero estimate`` prints and ``scripts/memory_chart.py`` draws. For ``Ψ`` parameters
sharded over ``n`` ranks (the world, or one shard group of node-aware sharding), bytes per rank:

  * ``ddp``: parameters, full gradients, DDP's bucket copy of them and Adam's two moments, all in the
    parameter dtype (torch keeps Adam's state in it);
  * ``zero1`` / ``zero2``: full parameters, and ``1/n`` of the gradients (in the master dtype), of the
    moments and of the fp32 master copy that 16-bit parameters get; plus the pool of bucket-sized
    accumulation buffers (:data:`POOL_SLOTS`, no more than the whole model's gradients), transient.
    Stages 1 and 2 hold the same; only what they send differs;
  * ``zero3``: as stage 2 with the parameters sharded too, plus ``1 + prefetch_units`` gathered units
    and the gradients of two units in the buckets (one filling, one in flight); of three units where a
    unit fits in one bucket (one filling, two in flight: the engine's bound of buckets in flight).

Activations (:mod:`~lightning_zero.layout.activations`), the root's parameters of stage 3 (gathered
for the whole step) and allocator slack are not counted. This module imports neither torch nor
Lightning, so that the command answers at once (its defaults are
:class:`~lightning_zero.config.ZeroConfig`'s, which imports neither).
"""

from __future__ import annotations

from lightning_zero.config import ZeroConfig

PRECISION_BYTES: dict[str, tuple[int, int, int]] = {
    # (parameter, gradient on the wire, optimizer arithmetic / master) bytes per element
    "32-true": (4, 4, 4),
    "16-mixed": (4, 4, 4),  # fp32 parameters, fp16 autocast
    "bf16-mixed": (4, 4, 4),
    "16-true": (2, 2, 4),  # 16-bit parameters: the optimizer keeps an fp32 master shard
    "bf16-true": (2, 2, 4),
    "transformer-engine": (2, 2, 4),  # bf16 weights (fp8 matmuls)
    "transformer-engine-float16": (2, 2, 4),  # fp16 weights
    "64-true": (8, 8, 8),
}
"""Every precision Lightning's Trainer and Fabric take by its full name (the strategy accepts each:
it gives the precision plugin a shard-aware mixin, whatever its class)."""

PRECISION_ALIASES = {"64": "64-true", "32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}
"""Lightning's short names, and the full names they stand for."""

POOL_SLOTS = 3
"""Bucket-sized accumulation buffers the engine's pool holds: one bucket filling, two in flight (the
engine's own ``POOL_SLOTS``, which ``tests/unit/test_estimate.py`` compares with this one: the engine
imports torch, and this module must not)."""

COMPONENTS = ("parameters", "gradients", "optimizer state", "gradient buckets", "gathered units")
"""What :func:`estimate_components` splits a rank's model state into."""


def full_precision(precision: str) -> str:
    """Lightning's full name of ``precision`` (``"16"`` -> ``"16-mixed"``).

    Raises:
        ValueError: for a precision Lightning does not take, naming those it does.
    """
    name = PRECISION_ALIASES.get(precision, precision)
    if name not in PRECISION_BYTES:
        raise ValueError(
            f"precision={precision!r}: one of {sorted(PRECISION_BYTES)} or {sorted(PRECISION_ALIASES)}"
        )
    return name


def units_in_buckets(unit_params: float, precision: str, bucket_cap_mb: float) -> int:
    """Stage 3: the units whose gradients the buckets hold at once at most. A unit's buckets launch
    together: a unit larger than a bucket fills while the unit before it is in flight (2); one that
    fits in a bucket fills while :data:`POOL_SLOTS` ``- 1`` are in flight, the engine's most buckets in
    flight (3)."""
    m_bytes = PRECISION_BYTES[full_precision(precision)][2]
    return 2 if unit_params * m_bytes > bucket_cap_mb * 2**20 else POOL_SLOTS


def estimate_components(
    params: float,
    n: int,
    precision: str,
    bucket_cap_mb: float,
    unit_params: float = 0.0,
    prefetch_units: int = ZeroConfig.prefetch_units,
) -> dict[str, dict[str, float]]:
    """Model-state bytes per rank (no activations) of ``ddp``, ``zero1``, ``zero2`` and ``zero3``.

    Args:
        params: parameters of the model.
        n: ranks the state is sharded over (the world, or the shard group of node-aware sharding).
        precision: a name of :data:`PRECISION_BYTES` or :data:`PRECISION_ALIASES`.
        bucket_cap_mb: the strategy's bucket size.
        unit_params: stage 3, the parameters of one unit (one block).
        prefetch_units: stage 3, the units gathered ahead of the one running.

    Returns:
        Per strategy, its bytes split into :data:`COMPONENTS`. The optimizer state of a 16-bit model
        includes its fp32 master copy.

    Raises:
        ValueError: an unknown precision (:func:`full_precision`).
    """
    p_bytes, g_bytes, m_bytes = PRECISION_BYTES[full_precision(precision)]
    separate_master = m_bytes > p_bytes
    # buckets being filled or in flight, transient: no more than every gradient (a model smaller than
    # POOL_SLOTS buckets has buckets of its own size)
    in_flight = min(POOL_SLOTS * bucket_cap_mb * 2**20, params * m_bytes)
    optimizer = 2 * m_bytes + (m_bytes if separate_master else 0)  # the moments (+ a separate master)

    unit_bytes = unit_params * m_bytes
    if units_in_buckets(unit_params, precision, bucket_cap_mb) == 2:
        unit_buckets = max(in_flight, 2 * unit_bytes)
    else:
        unit_buckets = min(POOL_SLOTS * unit_bytes, params * m_bytes)  # never more than every gradient

    def zero(sharded_params: bool) -> dict[str, float]:
        return {
            "parameters": params * p_bytes / (n if sharded_params else 1),
            "gradients": params * m_bytes / n,  # the gradient shard, in the master dtype
            "optimizer state": params * optimizer / n,
            "gradient buckets": unit_buckets if sharded_params and unit_params else in_flight,
            "gathered units": (1 + prefetch_units) * unit_params * p_bytes if sharded_params else 0.0,
        }

    return {
        # DDP: full gradients plus DDP's bucket copy; torch keeps Adam state in the parameter dtype
        "ddp": {
            "parameters": params * p_bytes,
            "gradients": params * g_bytes,
            "optimizer state": params * 2 * p_bytes,
            "gradient buckets": params * g_bytes,
            "gathered units": 0.0,
        },
        "zero1": zero(False),  # stages 1 and 2 hold the same: only what they send differs
        "zero2": zero(False),
        "zero3": zero(True),
    }


def pipeline_bubble(stages: int, microbatches: int, virtual: int = 1) -> float:
    """The idle fraction of a stage's step under a pipeline of ``stages`` and ``microbatches``:
    ``(P - 1) / (M + P - 1)`` for GPipe and 1F1B, divided by ``virtual`` stages per rank for
    interleaved 1F1B (each of its stages is ``1/V`` of the rank's layers, so the fill and drain are
    ``V`` times shorter)."""
    return (stages - 1) / (microbatches + stages - 1) / virtual


def microbatches_in_flight(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> float:
    """Micro-batches whose activations the first stage holds at its peak, in units of a whole
    stage's layers: GPipe all ``M`` (every forward before any backward); 1F1B ``min(M, P)``;
    interleaved 1F1B, torch's warm-up of ``(V - 1) P + 2 (P - 1)`` forwards of ``1/V`` of the layers
    each, plus the one in its first forward-backward pair (at most ``M V`` of them)."""
    if schedule == "gpipe":
        return float(microbatches)
    if schedule == "1f1b":
        return float(min(microbatches, stages))
    chunks = min(microbatches * virtual, (virtual - 1) * stages + 2 * (stages - 1) + 1)
    return chunks / virtual


def estimate_rows(
    params: float,
    n: int,
    precision: str,
    bucket_cap_mb: float,
    unit_params: float = 0.0,
    prefetch_units: int = ZeroConfig.prefetch_units,
) -> dict[str, float]:
    """The totals of :func:`estimate_components` per strategy (what ``lightning-zero estimate`` prints)."""
    parts = estimate_components(params, n, precision, bucket_cap_mb, unit_params, prefetch_units)
    return {name: sum(components.values()) for name, components in parts.items()}
