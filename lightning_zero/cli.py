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
from lightning_zero.integrations.estimate_args import add_arguments as add_estimate_arguments
from lightning_zero.integrations.estimate_args import check_arguments as check_estimate_arguments
from lightning_zero.integrations.preflight_args import add_arguments as add_preflight_arguments
from lightning_zero.layout.activations import ActivationSpec, activation_bytes, layer_bytes, outer_bytes
from lightning_zero.layout.dims import ParallelDims
from lightning_zero.layout.memory import (
    POOL_SLOTS,
    PRECISION_ALIASES,
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
    activations: ActivationSpec | None = None,
    pipeline: tuple[int, int, str, int] = (1, 1, "1f1b", 1),
) -> None:
    """Print :func:`estimate_rows` (``stage``: that one only, beside ``ddp``) for the ranks of ``dims``:
    under node-aware sharding the state is split over one shard group's ranks, not all; under tensor
    parallelism each rank holds ``1/T`` of every layer, sharded over the data-parallel ranks.
    ``activations``: what one micro-batch saves for backward per rank
    (:mod:`~lightning_zero.layout.activations`), printed too.
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
        _print_activations(
            activations, stages, microbatches_in_flight(schedule, stages, microbatches, virtual)
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


def _print_activations(spec: ActivationSpec, stages: int, held: float) -> None:
    """One line: the activations per rank of one micro-batch; with ``stages`` > 1, those of the first
    stage's layers for the ``held`` micro-batches in flight at its peak (the head and the logits are the
    last stage's)."""
    layer = layer_bytes(spec)
    if stages == 1:
        nbytes, unit = activation_bytes(spec), "per micro-batch"
        logits = f"fp32 logits of {spec.vocab_size}" if spec.vocab_size else "no logits (--vocab-size)"
        outside = f"; {outer_bytes(spec) / 2**30:.2f} GiB outside the layers: final norm, head, {logits}"
    else:
        nbytes, unit = layer * spec.layers / stages * held, "at the first stage's peak"
        outside = f"; {spec.layers / stages:g} layers per stage, {held:g} micro-batches in flight"
    kept = "checkpointed blocks: their inputs" if spec.checkpointing else "no recomputation"
    split = f", sequence parallel over {spec.tensor}" if spec.tensor > 1 else ""
    print(
        f"  activations {nbytes / 2**30:5.2f} GiB {unit} of {spec.micro_batch} x {spec.seq_len} tokens "
        f"({spec.layers} layers x {layer / spec.tokens:.0f} bytes per token: Llama-style, width "
        f"{spec.d_model}, MLP {spec.hidden}, {spec.heads} heads; {spec.precision}, {spec.attention} "
        f"attention, {kept}{split}{outside})"
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
    add_estimate_arguments(p_est)
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
    dims, pipeline, activations = check_estimate_arguments(parser, args)
    estimate(
        args.params,
        dims,
        PRECISION_ALIASES.get(args.precision, args.precision),
        args.bucket_cap_mb,
        args.stage,
        args.unit_params,
        args.prefetch_units,
        activations,
        pipeline,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
