"""Checks of the strategies' Lightning arguments (ours are checked by ``ZeroOptions``/``ZeroConfig``).

Lightning's ``DDPStrategy`` stores what it is given and fails later, if at all: a wrong ``timeout``
type when the process group is created, after the launch; a wrong ``start_method`` in the launcher.
Both zero strategies check every argument at construction, before any work, naming the bad value
and what would be valid. ``tests/unit/test_arguments.py`` enumerates the constructor signatures, so
a new argument without a check fails CI.

The base classes are Fabric's: the Trainer's accelerators, cluster environments, checkpoint IO and
precision plugins derive from them.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.plugins.precision import Precision

START_METHODS = ("popen", "spawn", "fork", "forkserver")
"""Lightning's launchers: ``popen`` re-runs the script, the others are multiprocessing's."""


def _instance_or_none(name: str, value: Any, cls: type) -> None:
    if value is not None and not isinstance(value, cls):
        raise TypeError(f"{name} must be None or a {cls.__module__}.{cls.__name__}, got {value!r}")


def check_lightning_arguments(
    *,
    accelerator: Any,
    parallel_devices: Any,
    cluster_environment: Any,
    checkpoint_io: Any,
    precision: Any,
    process_group_backend: Any,
    timeout: Any,
    start_method: Any,
    precision_name: str = "precision",
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the first bad argument (all of ``DDPStrategy``'s)."""
    _instance_or_none("accelerator", accelerator, Accelerator)
    if parallel_devices is not None and (
        not isinstance(parallel_devices, list | tuple)
        or not all(isinstance(d, torch.device) for d in parallel_devices)
    ):
        raise TypeError(f"parallel_devices must be None or a list of torch.device, got {parallel_devices!r}")
    _instance_or_none("cluster_environment", cluster_environment, ClusterEnvironment)
    _instance_or_none("checkpoint_io", checkpoint_io, CheckpointIO)
    _instance_or_none(precision_name, precision, Precision)
    if process_group_backend is not None and (
        not isinstance(process_group_backend, str) or not process_group_backend
    ):
        raise ValueError(
            "process_group_backend must be None (gloo on CPU, nccl on CUDA) or a backend name such as "
            f"'gloo' or 'nccl', got {process_group_backend!r}"
        )
    if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
        raise ValueError(
            "timeout must be None or a positive datetime.timedelta (e.g. timedelta(minutes=10)), "
            f"got {timeout!r}"
        )
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {list(START_METHODS)}, got {start_method!r}")


def check_sharded_io(checkpoint_io: Any, sharded_checkpoint: bool, owner: str) -> None:
    """Refuse a checkpoint IO plugin that sharded checkpoints would not use (never accept and ignore).

    Sharded directories are written by every rank with ``torch.save`` to a local or shared file system
    path, not through Lightning's ``CheckpointIO``; a plugin other than the default
    ``TorchCheckpointIO`` (a custom one, ``AsyncCheckpointIO``) works with ``sharded_checkpoint=False``.
    """
    if sharded_checkpoint and checkpoint_io is not None and type(checkpoint_io) is not TorchCheckpointIO:
        raise ValueError(
            f"{owner}: checkpoint_io={type(checkpoint_io).__name__} is not used by sharded checkpoints "
            "(every rank writes its own shard with torch.save to a local or shared file system path); "
            "pass sharded_checkpoint=False to save one file through it, or drop the plugin "
            "(async_checkpoint=True saves sharded checkpoints in the background)"
        )


def check_sharded_path(path: Any) -> None:
    """Refuse a URL as a sharded checkpoint's path (``s3://bucket/run`` would become ``s3:/bucket/run``).

    ``file://`` URLs are local paths and accepted by the caller after :func:`local_path`.
    """
    text = str(path)
    if "://" in text and not text.startswith("file://"):
        raise ValueError(
            f"sharded checkpoints are written to a local or shared file system path, got the URL {text!r}; "
            "use a mounted path, or sharded_checkpoint=False to save one file through a CheckpointIO "
            "that supports the URL"
        )


def local_path(path: Any) -> Any:
    """``file:///a/b`` -> ``/a/b``; any other path unchanged (after :func:`check_sharded_path`)."""
    text = str(path)
    return text.removeprefix("file://") if text.startswith("file://") else path
