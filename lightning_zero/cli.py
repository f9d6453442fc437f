"""``lightning-zero``: command-line tools for checkpoints and memory planning.

    lightning-zero consolidate SRC DST [--weights-only]
                                     a checkpoint directory -> one standard Lightning checkpoint file
    lightning-zero verify SRC        completeness, sizes, sha256 and metadata of a checkpoint directory
    lightning-zero estimate ...      model-state memory per rank for ddp / zero1 / zero2 / zero3
    lightning-zero preflight ...     launched like training (srun, torchrun, --devices N): what makes
                                     a multi-node job hang or fail late, and the bus bandwidth

Exit status: 0 on success, 1 when ``verify``, ``consolidate`` or ``preflight`` finds a problem, 2 on bad
arguments.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from lightning_zero.checkpoint import META, CheckpointError, read_meta, shard_name, verify_files
from lightning_zero.comm.groups import check_shard_group_size
from lightning_zero.engine.in_flight import POOL_SLOTS
from lightning_zero.integrations import preflight

_PRECISION_BYTES = {  # (parameter, gradient on the wire, optimizer arithmetic / master) bytes per element
    "32-true": (4, 4, 4),
    "bf16-mixed": (4, 4, 4),
    "bf16-true": (2, 2, 4),
    "64-true": (8, 8, 8),
}


def verify(src: Path) -> int:
    """Print a report of ``src``; 0 if complete and intact, 1 otherwise."""
    try:
        meta = read_meta(src)
    except CheckpointError as err:
        print(f"FAIL {err}")
        return 1
    world_size = meta["world_size"]
    expected = {shard_name(r, world_size) for r in range(world_size)}
    problems = [
        f"{src / name}: shard file not recorded in {META}" for name in sorted(expected - set(meta["files"]))
    ]
    problems += verify_files(src, meta)
    on_disk = {p.name for p in src.iterdir() if p.is_file()} - {META}
    problems += [
        f"{src / name}: not part of this checkpoint" for name in sorted(on_disk - set(meta["files"]))
    ]
    params = meta["plan"]["params"]
    numel = sum(math.prod(p["shape"]) for p in params)
    lightning = meta.get("lightning", {})
    print(f"checkpoint   {src}")
    print(
        f"format       lightning-zero v{meta['format_version']}, stage {meta['stage']}, "
        f"world size {world_size}"
    )
    print(
        f"parameters   {len(params)} trainable tensors, {numel:,} elements, "
        f"{len(meta['plan']['buckets'])} buckets"
    )
    print(
        f"training     global step {lightning.get('global_step', '?')}, epoch {lightning.get('epoch', '?')}"
    )
    total = sum(f["size"] for f in meta["files"].values())
    print(f"files        {len(meta['files'])} + {META}, {total / 2**20:.1f} MiB")
    for problem in problems:
        print(f"FAIL {problem}")
    print("OK" if not problems else f"{len(problems)} problem(s)")
    return 0 if not problems else 1


def _consolidate(src: Path, dst: Path, weights_only: bool, force: bool) -> int:
    from lightning_zero.checkpoint.consolidate import consolidate

    if dst.exists() and not force:
        print(f"FAIL {dst} exists; pass --force to replace it")
        return 1
    if not dst.parent.is_dir():
        print(f"FAIL {dst.parent} is not a directory")
        return 1
    start = time.perf_counter()
    try:
        consolidate(src, dst, weights_only=weights_only)
    except CheckpointError as err:
        print(f"FAIL {err}")
        return 1
    size = dst.stat().st_size
    print(
        f"wrote {dst} ({size / 2**20:.1f} MiB, {'weights only' if weights_only else 'full state'}) "
        f"in {time.perf_counter() - start:.1f} s"
    )
    return 0


COMPONENTS = ("parameters", "gradients", "optimizer state", "gradient buckets", "gathered units")
"""What :func:`estimate_components` splits a rank's model state into."""


def estimate_components(
    params: float,
    n: int,
    precision: str,
    bucket_cap_mb: float,
    unit_params: float = 0.0,
    prefetch_units: int = 1,
) -> dict[str, dict[str, float]]:
    """Model-state bytes per rank (no activations) of ``ddp``, ``zero1``, ``zero2`` and ``zero3``, each
    split into :data:`COMPONENTS`, with the state sharded over ``n`` ranks (the world, or the shard
    group of node-aware sharding). Stage 3 holds ``1 + prefetch_units`` gathered units of
    ``unit_params`` (one block) at once, besides the root's parameters, which this estimate does not
    know of, and the gradients of two units in its buckets (one filling, one in flight) where that is
    more than the buckets of stages 1 and 2. The optimizer state of a 16-bit model includes its fp32
    master copy."""
    p_bytes, g_bytes, m_bytes = _PRECISION_BYTES[precision]
    separate_master = m_bytes > p_bytes
    in_flight = POOL_SLOTS * bucket_cap_mb * 2**20  # buckets being filled or in flight, transient
    optimizer = 2 * m_bytes + (m_bytes if separate_master else 0)  # the moments (+ a separate master)

    def zero(sharded_params: bool) -> dict[str, float]:
        return {
            "parameters": params * p_bytes / (n if sharded_params else 1),
            "gradients": params * m_bytes / n,  # the gradient shard, in the master dtype
            "optimizer state": params * optimizer / n,
            # stage 3: one unit's gradients fill while the unit before it is in flight
            "gradient buckets": max(in_flight, 2 * unit_params * m_bytes) if sharded_params else in_flight,
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


def estimate_rows(
    params: float,
    n: int,
    precision: str,
    bucket_cap_mb: float,
    unit_params: float = 0.0,
    prefetch_units: int = 1,
) -> dict[str, float]:
    """The totals of :func:`estimate_components` per strategy (what ``lightning-zero estimate`` prints)."""
    parts = estimate_components(params, n, precision, bucket_cap_mb, unit_params, prefetch_units)
    return {name: sum(components.values()) for name, components in parts.items()}


def estimate(
    params: float,
    world_size: int,
    precision: str,
    bucket_cap_mb: float,
    stage: int | None = None,
    unit_params: float = 0.0,
    prefetch_units: int = 1,
    shard_group_size: int | None = None,
) -> None:
    """Print :func:`estimate_rows` (``stage``: that one only, beside ``ddp``). ``shard_group_size``:
    node-aware sharding, the state split over that many ranks, not all."""
    n = shard_group_size or world_size
    rows = estimate_rows(params, n, precision, bucket_cap_mb, unit_params, prefetch_units)
    if stage is not None:
        rows = {name: value for name, value in rows.items() if name in ("ddp", f"zero{stage}")}
    layout = f" sharded in groups of {n} (replicated {world_size // n}x)" if n != world_size else ""
    print(
        f"{params / 1e9:.3g}B parameters, {world_size} ranks{layout}, {precision}: model state per rank "
        "(parameters, gradients, optimizer; no activations)"
    )
    for name, nbytes in rows.items():
        print(f"  {name:<6} {nbytes / 2**30:10.2f} GiB")
    print(f"  (zero rows include up to {POOL_SLOTS} x {bucket_cap_mb:g} MiB of gradient buckets in flight)")
    if "zero1" in rows:
        print("  (stage 1 sends 1.5x stage 2's bytes for the same memory)")
    if "zero3" in rows:
        units = (
            f"{1 + prefetch_units} gathered units of {unit_params / 1e6:.4g}M parameters and the gradient "
            "buckets of 2 units"
            if unit_params
            else "no gathered unit (--unit-params: the parameters of one block)"
        )
        print(
            f"  (zero3 includes {units}; the root's parameters, gathered for the whole step, come on top; "
            "it sends up to 1.5x stage 2's elements: the root is gathered once per step, the last unit "
            "once per micro-batch, every other unit twice)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-zero", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_cons = sub.add_parser("consolidate", help="write one standard Lightning checkpoint file")
    p_cons.add_argument("src", type=Path)
    p_cons.add_argument("dst", type=Path)
    p_cons.add_argument(
        "--weights-only", action="store_true", help="model weights only, no optimizer/loop state"
    )
    p_cons.add_argument("--force", action="store_true", help="replace DST if it exists")
    p_verify = sub.add_parser("verify", help="check a checkpoint directory")
    p_verify.add_argument("src", type=Path)
    p_est = sub.add_parser("estimate", help="memory per rank of model states")
    p_est.add_argument("--params", type=float, required=True, help="number of parameters, e.g. 1.3e9")
    p_est.add_argument("--world-size", type=int, required=True)
    p_est.add_argument("--precision", choices=sorted(_PRECISION_BYTES), default="bf16-true")
    p_est.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p_est.add_argument("--stage", type=int, choices=(1, 2, 3), help="only this stage's row (besides ddp)")
    p_est.add_argument("--unit-params", type=float, default=0.0, help="stage 3: parameters of one block")
    p_est.add_argument("--prefetch-units", type=int, default=1, help="stage 3: units gathered ahead")
    p_est.add_argument(
        "--shard-group-size", type=int, help="node-aware sharding: ranks per shard group (e.g. GPUs per node)"
    )
    p_pre = sub.add_parser(
        "preflight", help="check a multi-node launch before training (run it like training)"
    )
    preflight.add_arguments(p_pre)
    args = parser.parse_args(argv)
    if args.command == "preflight":
        return preflight.run(args)
    if args.command == "consolidate":
        return _consolidate(args.src, args.dst, args.weights_only, args.force)
    if args.command == "verify":
        if not args.src.is_dir():
            print(f"FAIL {args.src} is not a directory (a lightning-zero checkpoint is one)")
            return 1
        return verify(args.src)
    if args.world_size < 1 or args.params <= 0:
        parser.error(f"--world-size must be >= 1 and --params > 0, got {args.world_size} and {args.params}")
    group = args.shard_group_size
    if group is not None:
        try:
            check_shard_group_size(group, args.world_size)
        except ValueError as err:
            parser.error(f"--shard-group-size: {err}")
    if args.unit_params < 0 or args.prefetch_units < 0:
        parser.error(
            "--unit-params and --prefetch-units must be >= 0, "
            f"got {args.unit_params} and {args.prefetch_units}"
        )
    estimate(
        args.params,
        args.world_size,
        args.precision,
        args.bucket_cap_mb,
        args.stage,
        args.unit_params,
        args.prefetch_units,
        group,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
