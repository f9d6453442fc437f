"""The arguments of ``lightning-zero estimate`` and their checks, without torch.

Apart from :mod:`lightning_zero.cli`, which prints the estimate: the options (model state, layout,
pipeline, activations) and what they give once checked, the ranks' layout
(:class:`~lightning_zero.layout.dims.ParallelDims`), the pipeline's ``(P, M, schedule, V)`` and the
activations' :class:`~lightning_zero.layout.activations.ActivationSpec`. A bad value ends the command
with status 2 and a message that names its flags (``argparse``'s ``parser.error``).
"""

from __future__ import annotations

import argparse
import re

from lightning_zero.config import ZeroConfig
from lightning_zero.layout.activations import ATTENTION_KERNELS, ActivationSpec
from lightning_zero.layout.dims import ParallelDims
from lightning_zero.layout.memory import PRECISION_ALIASES, PRECISION_BYTES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``estimate``'s options on ``parser``."""
    parser.add_argument("--params", type=float, required=True, help="number of parameters, e.g. 1.3e9")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument(
        "--precision",
        choices=[*PRECISION_BYTES, *PRECISION_ALIASES],
        default="bf16-true",
        metavar="PRECISION",
        help=f"as the Trainer's: one of {', '.join(PRECISION_BYTES)} (or {', '.join(PRECISION_ALIASES)})",
    )
    parser.add_argument("--bucket-cap-mb", type=float, default=ZeroConfig.bucket_cap_mb)
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), help="only this stage's row (besides ddp)")
    parser.add_argument("--unit-params", type=float, default=0.0, help="stage 3: parameters of one block")
    parser.add_argument(
        "--prefetch-units", type=int, default=ZeroConfig.prefetch_units, help="stage 3: units gathered ahead"
    )
    parser.add_argument(
        "--shard-group-size",
        help="node-aware sharding, as the strategy's shard_group_size: ranks per shard group, or auto "
        "(the ranks of one node: --devices)",
    )
    parser.add_argument("--devices", type=int, help="ranks per node, as the Trainer's devices")
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="T",
        help="as the strategy's tensor_parallel_size: ranks per tensor-parallel group (inside a node)",
    )
    parser.add_argument(
        "--pipeline-parallel",
        type=int,
        default=1,
        metavar="P",
        help="pipeline stages (outermost: --world-size / P ranks per stage); with --microbatches",
    )
    parser.add_argument("--microbatches", type=int, metavar="M", help="micro-batches per pipeline step")
    parser.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved_1f1b"), default="1f1b")
    parser.add_argument(
        "--virtual-stages", type=int, default=1, metavar="V", help="interleaved_1f1b: stages per rank"
    )
    for flag, what in (
        ("--seq-len", "tokens per sequence"),
        ("--micro-batch", "sequences per micro-batch and data-parallel rank"),
        ("--d-model", "the model's width"),
        ("--layers", "transformer layers"),
        ("--heads", "query heads"),
    ):
        parser.add_argument(flag, type=int, help=f"activations (all five or none): {what}")
    for flag, what in (
        ("--kv-heads", "key/value heads (default: --heads; only the mixed precisions' weight copies change)"),
        ("--mlp-hidden", "the SwiGLU MLP's width (default: 8/3 of --d-model, rounded up to 64)"),
        ("--vocab-size", "the logits' width (default: the logits not counted)"),
    ):
        parser.add_argument(flag, type=int, help=f"activations: {what}")
    parser.add_argument(
        "--attention",
        choices=ATTENTION_KERNELS,
        default="flash",
        help="activations: SDPA's kernel, flash (any fused one: a log-sum-exp per head) or math (the "
        "softmax of every pair of tokens)",
    )
    parser.add_argument(
        "--activation-checkpointing", action="store_true", help="activations: each block keeps its input only"
    )


def check_arguments(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[ParallelDims, tuple[int, int, str, int], ActivationSpec | None]:
    """The layout of one pipeline stage's ranks, the pipeline and the activations (None: not asked)
    from ``args``; ``args.world_size`` becomes the ranks of one stage."""
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
    return dims, pipeline, _activations(parser, args, dims.tensor)


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


def _activations(
    parser: argparse.ArgumentParser, args: argparse.Namespace, tensor: int
) -> ActivationSpec | None:
    """The activations' arguments, all five sizes or none (nor any other of their options), checked by
    :class:`ActivationSpec` (its field names told as the flags)."""
    shape = (args.seq_len, args.micro_batch, args.d_model, args.layers, args.heads)
    extra = [args.kv_heads, args.mlp_hidden, args.vocab_size]
    if None in shape:
        if (
            any(v is not None for v in [*shape, *extra])
            or args.attention != "flash"
            or args.activation_checkpointing
        ):
            parser.error(
                "activations need all five of --seq-len, --micro-batch, --d-model, --layers and --heads"
            )
        return None
    try:
        return ActivationSpec(
            seq_len=args.seq_len,
            micro_batch=args.micro_batch,
            d_model=args.d_model,
            layers=args.layers,
            heads=args.heads,
            kv_heads=args.kv_heads,
            mlp_hidden=args.mlp_hidden,
            vocab_size=args.vocab_size or 0,
            precision=PRECISION_ALIASES.get(args.precision, args.precision),
            attention=args.attention,
            checkpointing=args.activation_checkpointing,
            tensor=tensor,
        )
    except ValueError as err:  # "d_model=64" -> "--d-model 64"
        parser.error(re.sub(r"\b([a-z_]+)=", lambda m: f"--{m.group(1).replace('_', '-')} ", str(err)))


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
