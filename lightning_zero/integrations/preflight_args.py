"""The arguments of ``lightning-zero preflight`` and the launch shape they give, without torch.

Apart from :mod:`lightning_zero.integrations.preflight` (which imports torch and, when it runs,
Lightning) so that the command line builds its parser, and runs ``estimate``, ``verify`` or ``--help``,
without either.
"""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``preflight``'s options on ``parser``."""
    parser.add_argument(
        "--devices",
        type=int,
        help="ranks per node, as the Trainer's devices (default: from torchrun or SLURM, else 1)",
    )
    parser.add_argument(
        "--num-nodes",
        type=int,
        help="nodes, as the Trainer's num_nodes (default: from torchrun or SLURM, else 1)",
    )
    parser.add_argument("--accelerator", default="auto", help="cpu, cuda or auto (as the Trainer's)")
    parser.add_argument("--checkpoint-dir", help="the directory training will save checkpoints into")
    parser.add_argument(
        "--shard-group-size", default=None, help="as the strategy's shard_group_size: a number, or auto"
    )
    parser.add_argument(
        "--sizes-mb", help="message sizes in MiB, comma-separated (default: 1,8 on CPU, 1,16,128 on CUDA)"
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a rank waits for its peers")


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name, "")
        digits = value.split("(")[0]  # SLURM_TASKS_PER_NODE="2(x3)"
        if digits.isdigit():
            return int(digits)
    return None


def launch_shape(args: argparse.Namespace) -> tuple[int, int]:
    """``(devices, num_nodes)``: the arguments', else the launcher's (torchrun, SLURM), else one."""
    devices = (
        args.devices or _env_int("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE") or 1
    )
    nodes = args.num_nodes or _env_int("SLURM_NNODES")
    if nodes is None:
        world = _env_int("WORLD_SIZE")
        nodes = max(1, world // devices) if world else 1
    return devices, nodes
