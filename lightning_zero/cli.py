"""``lightning-zero``: command-line tools for checkpoints, memory planning and step reports.

    lightning-zero consolidate SRC DST [--weights-only]
                                     a checkpoint directory -> one standard Lightning checkpoint file
    lightning-zero verify SRC        completeness, sizes, sha256 and metadata of a checkpoint directory
    lightning-zero estimate ...      model-state memory per rank for ddp / zero1 / zero2 / zero3
    lightning-zero preflight ...     launched like training (srun, torchrun, --devices N): what makes
                                     a multi-node job hang or fail late, and the bus bandwidth
    lightning-zero report RUN_DIR    a run's step profile as a Markdown page, PNG charts and a
                                     three-line summary (what to look at first)

Exit status: 0 on success, 1 when ``verify``, ``consolidate``, ``preflight`` or ``report`` finds a
problem, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from lightning_zero.config import ZeroConfig
from lightning_zero.integrations.preflight_args import add_arguments as add_preflight_arguments
from lightning_zero.layout.dims import ParallelDims
from lightning_zero.layout.memory import (
    POOL_SLOTS,
    PRECISION_ALIASES,
    PRECISION_BYTES,
    activation_bytes,
    estimate_rows,
    microbatches_in_flight,
    pipeline_bubble,
    units_in_buckets,
)


def verify(src: Path) -> int:
    """Print a report of ``src``; 0 if complete and intact, 1 otherwise."""
    from lightning_zero.checkpoint import META, CheckpointError, read_meta, verify_files
    from lightning_zero.checkpoint.format import all_shard_names
    from lightning_zero.checkpoint.pipeline_layout import saved_size as pipeline_size
    from lightning_zero.checkpoint.pipeline_layout import stage_view
    from lightning_zero.checkpoint.tensor_layout import saved_size

    try:
        meta = read_meta(src)
    except CheckpointError as err:
        print(f"FAIL {err}")
        return 1
    world_size = meta["world_size"]
    expected = set(all_shard_names(meta))
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
        + (f" x tensor parallel {tensor}" if (tensor := saved_size(stage_view(meta, 0))) > 1 else "")
        + (f" x pipeline {pipeline_size(meta)}" if pipeline_size(meta) > 1 else "")
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
    from lightning_zero.checkpoint import CheckpointError
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


def _report(run_dir: Path, out: Path | None) -> int:
    """Write the step report of ``run_dir`` and print its summary; 1 (printed) when it cannot."""
    from lightning_zero.report import ReportError, write_report

    try:
        report = write_report(run_dir, out)
    except (ReportError, ModuleNotFoundError) as err:
        print(f"FAIL {err}")
        return 1
    print("\n".join(report.summary))
    print(f"wrote {report.page} and {len(report.charts)} charts beside it (from {report.profile.path})")
    return 0


def estimate(
    params: float,
    dims: ParallelDims,
    precision: str,
    bucket_cap_mb: float,
    stage: int | None = None,
    unit_params: float = 0.0,
    prefetch_units: int = ZeroConfig.prefetch_units,
    activations: tuple[int, int, int, int] | None = None,
    pipeline: tuple[int, int, str, int] = (1, 1, "1f1b", 1),
) -> None:
    """Print :func:`estimate_rows` (``stage``: that one only, beside ``ddp``) for the ranks of ``dims``:
    under node-aware sharding the state is split over one shard group's ranks, not all; under tensor
    parallelism each rank holds ``1/T`` of every layer, sharded over the data-parallel ranks.
    ``activations``: ``(seq_len, micro_batch, d_model, layers)``, printed per rank too.
    ``pipeline``: ``(P, M, schedule, V)``: ``P`` stages of equal shares of the parameters and layers
    (``dims`` the ranks of one stage), ``M`` micro-batches per step; the bubble and the micro-batches
    whose activations the first stage holds."""
    tensor = dims.tensor
    stages, microbatches, schedule, virtual = pipeline
    share = tensor * stages
    rows = estimate_rows(
        params / share, dims.shard, precision, bucket_cap_mb, unit_params / tensor, prefetch_units
    )
    if stage is not None:
        rows = {name: value for name, value in rows.items() if name in ("ddp", f"zero{stage}")}
    layout = f" sharded in groups of {dims.shard} (replicated {dims.replicate}x)" if dims.hybrid else ""
    if tensor > 1 or stages > 1:
        parts = [f"pipeline {stages}"] * (stages > 1) + [f"tensor {tensor}"] * (tensor > 1)
        layout = (
            f" ({' x '.join(parts)} x data {dims.world_size}; ddp: data parallel over the {dims.world_size})"
        )
    print(
        f"{params / 1e9:.3g}B parameters, {dims.world_size * share} ranks{layout}, {precision}: model state "
        "per rank (parameters, gradients, optimizer; no activations)"
    )
    for name, nbytes in rows.items():
        print(f"  {name:<6} {nbytes / 2**30:10.2f} GiB")
    print(f"  (zero rows include up to {POOL_SLOTS} x {bucket_cap_mb:g} MiB of gradient buckets in flight)")
    if "zero1" in rows:
        print("  (stage 1 sends 1.5x stage 2's bytes for the same memory)")
    if stages > 1:
        bubble = pipeline_bubble(stages, microbatches, virtual)
        per = f", {virtual} stages per rank" if schedule == "interleaved_1f1b" else ""
        print(
            f"  pipeline {schedule}{per}: bubble (P-1)/(M+P-1){' / V' if virtual > 1 else ''} = "
            f"{bubble:.1%} of a step ({stages} stages, {microbatches} micro-batches; equal shares of the "
            "layers, embedding and output layer on top of the first and last stage)"
        )
    if activations is not None:
        seq, batch, width, layers = activations
        held = microbatches_in_flight(schedule, stages, microbatches, virtual) if stages > 1 else 1.0
        nbytes = activation_bytes(seq, batch, width, layers, tensor) / stages * held
        split = f", sequence parallel over {tensor}" if tensor > 1 else ""
        staged = (
            f"; {layers / stages:g} layers per stage, {held:g} micro-batches in flight" if stages > 1 else ""
        )
        unit = "at the first stage's peak" if stages > 1 else "per micro-batch"
        print(
            f"  activations {nbytes / 2**30:5.2f} GiB {unit} of {batch} x {seq} tokens "
            f"({layers} layers x 34 bytes per token and width {width}{split}{staged}; 16-bit, flash "
            "attention, no recomputation; embedding and logits on top)"
        )
    if "zero3" in rows:
        units = (
            f"{1 + prefetch_units} gathered units of {unit_params / 1e6:.4g}M parameters and the gradient "
            f"buckets of {units_in_buckets(unit_params / dims.tensor, precision, bucket_cap_mb)} units"
            if unit_params
            else "no gathered unit (--unit-params: the parameters of one block)"
        )
        print(
            f"  (zero3 includes {units}; the root's parameters, gathered for the whole step, come on top; "
            "it sends up to 1.5x stage 2's elements: the root is gathered once per step, the last unit "
            "once per micro-batch, every other unit twice)"
        )


def _parser() -> argparse.ArgumentParser:
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
    p_est.add_argument(
        "--precision",
        choices=[*PRECISION_BYTES, *PRECISION_ALIASES],
        default="bf16-true",
        metavar="PRECISION",
        help=f"as the Trainer's: one of {', '.join(PRECISION_BYTES)} (or {', '.join(PRECISION_ALIASES)})",
    )
    p_est.add_argument("--bucket-cap-mb", type=float, default=ZeroConfig.bucket_cap_mb)
    p_est.add_argument("--stage", type=int, choices=(1, 2, 3), help="only this stage's row (besides ddp)")
    p_est.add_argument("--unit-params", type=float, default=0.0, help="stage 3: parameters of one block")
    p_est.add_argument(
        "--prefetch-units", type=int, default=ZeroConfig.prefetch_units, help="stage 3: units gathered ahead"
    )
    p_est.add_argument(
        "--shard-group-size",
        help="node-aware sharding, as the strategy's shard_group_size: ranks per shard group, or auto "
        "(the ranks of one node: --devices)",
    )
    p_est.add_argument("--devices", type=int, help="ranks per node, as the Trainer's devices")
    p_est.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="T",
        help="as the strategy's tensor_parallel_size: ranks per tensor-parallel group (inside a node)",
    )
    p_est.add_argument(
        "--pipeline-parallel",
        type=int,
        default=1,
        metavar="P",
        help="pipeline stages (outermost: --world-size / P ranks per stage); with --microbatches",
    )
    p_est.add_argument("--microbatches", type=int, metavar="M", help="micro-batches per pipeline step")
    p_est.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved_1f1b"), default="1f1b")
    p_est.add_argument(
        "--virtual-stages", type=int, default=1, metavar="V", help="interleaved_1f1b: stages per rank"
    )
    for flag, what in (
        ("--seq-len", "tokens per sequence"),
        ("--micro-batch", "sequences per micro-batch and data-parallel rank"),
        ("--d-model", "the model's width"),
        ("--layers", "transformer layers"),
    ):
        p_est.add_argument(flag, type=int, help=f"activations (all four or none): {what}")
    p_pre = sub.add_parser(
        "preflight", help="check a multi-node launch before training (run it like training)"
    )
    add_preflight_arguments(p_pre)
    p_rep = sub.add_parser("report", help="a step profile as a Markdown page, charts and a summary")
    p_rep.add_argument(
        "run_dir",
        type=Path,
        metavar="RUN_DIR",
        help="where step_profile.json is: the file, its directory, or a run directory holding it in a "
        "logger's */version_N (the newest)",
    )
    p_rep.add_argument("--out", type=Path, help="write the report here (default: beside step_profile.json)")
    return parser


def _layout(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ParallelDims:
    """The ranks' layout from ``--world-size`` and ``--shard-group-size`` (``auto``: ``--devices``)."""
    size, devices = args.shard_group_size, args.devices
    if devices is not None and (devices < 1 or args.world_size % devices):
        parser.error(f"--devices {devices} must be a positive divisor of --world-size {args.world_size}")
    if size == "auto" and devices is None:
        parser.error(
            "--shard-group-size auto shards within one node: give the ranks of one node "
            "with --devices (the Trainer's devices, e.g. 8)"
        )
    group = int(size) if size is not None and size.isdigit() else size
    if args.tensor_parallel != 1:
        if size is not None:
            parser.error(
                "--tensor-parallel works with flat sharding over the data-parallel ranks: "
                "drop --shard-group-size"
            )
        try:
            return ParallelDims.with_tensor(args.world_size, args.tensor_parallel, devices)
        except ValueError as err:
            parser.error(f"--tensor-parallel: {err}")
    try:
        return ParallelDims.of(args.world_size, group, devices)
    except ValueError as err:
        parser.error(f"--shard-group-size: {err}")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "preflight":
        from lightning_zero.integrations import preflight

        return preflight.run(args)
    if args.command == "report":
        return _report(args.run_dir, args.out)
    if args.command == "consolidate":
        return _consolidate(args.src, args.dst, args.weights_only, args.force)
    if args.command == "verify":
        if not args.src.is_dir():
            print(f"FAIL {args.src} is not a directory (a lightning-zero checkpoint is one)")
            return 1
        return verify(args.src)
    if args.world_size < 1 or args.params <= 0:
        parser.error(f"--world-size must be >= 1 and --params > 0, got {args.world_size} and {args.params}")
    pipeline = _pipeline(parser, args)
    args.world_size //= pipeline[0]  # the ranks of one stage
    dims = _layout(parser, args)
    if args.unit_params < 0 or args.prefetch_units < 0:
        parser.error(
            "--unit-params and --prefetch-units must be >= 0, "
            f"got {args.unit_params} and {args.prefetch_units}"
        )
    shape = (args.seq_len, args.micro_batch, args.d_model, args.layers)
    given = [v is not None for v in shape]
    if any(given) and not all(given):
        parser.error("activations need all four of --seq-len, --micro-batch, --d-model and --layers")
    if all(given) and min(shape) < 1:
        parser.error(f"--seq-len, --micro-batch, --d-model and --layers must be >= 1, got {shape}")
    estimate(
        args.params,
        dims,
        PRECISION_ALIASES.get(args.precision, args.precision),
        args.bucket_cap_mb,
        args.stage,
        args.unit_params,
        args.prefetch_units,
        shape if all(given) else None,  # type: ignore[arg-type]
        pipeline,
    )
    return 0


def _pipeline(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[int, int, str, int]:
    """``(P, M, schedule, V)`` from the pipeline arguments, checked against ``--world-size``."""
    stages, microbatches, schedule, virtual = (
        args.pipeline_parallel,
        args.microbatches,
        args.schedule,
        args.virtual_stages,
    )
    if stages < 1 or args.world_size % stages:
        divisors = [p for p in range(1, args.world_size + 1) if args.world_size % p == 0]
        parser.error(
            f"--pipeline-parallel {stages} must divide --world-size {args.world_size}: one of {divisors}"
        )
    if stages == 1:
        if microbatches is not None or virtual != 1:
            parser.error("--microbatches and --virtual-stages need --pipeline-parallel P > 1")
        return 1, 1, schedule, 1
    if microbatches is None or microbatches < 1:
        parser.error(f"--pipeline-parallel {stages} needs --microbatches M >= 1 (micro-batches per step)")
    if (virtual > 1) != (schedule == "interleaved_1f1b") or virtual < 1:
        parser.error(
            f"--virtual-stages {virtual}: interleaved_1f1b takes V >= 2 stages per rank, "
            "the other schedules 1"
        )
    return stages, microbatches, schedule, virtual


if __name__ == "__main__":
    sys.exit(main())
