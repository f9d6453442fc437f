"""The strategies' constructor arguments: their one signature, and the checks of Lightning's ones
(ours are checked by ``ZeroOptions``/``ZeroConfig``).

One source: both strategies take ``**arguments`` and :func:`takes_zero_arguments` gives their
``__init__`` the signature read from the fields of :class:`~lightning_zero.ZeroConfig` and
:class:`~lightning_zero.integrations.options.ZeroOptions` (names, defaults, types) and from Lightning's
own ``DDPStrategy`` for :data:`LIGHTNING_ARGUMENTS` (its defaults). ``inspect.signature``, the Hydra
schema (``recipes/config/signatures.py``) and ``docs/reference.md`` read that signature; no default is
written a second time.

Lightning's ``DDPStrategy`` stores what it is given and fails later, if at all: a wrong ``timeout``
type when the process group is created, after the launch; a wrong ``start_method`` in the launcher.
Both zero strategies check every argument at construction, before any work, naming the bad value
and what would be valid. ``tests/unit/test_arguments.py`` enumerates the constructor signatures, so
a new argument without a check fails CI.

The base classes are Fabric's: the Trainer's accelerators, cluster environments, checkpoint IO and
precision plugins derive from them.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import typing
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, TypedDict, TypeVar

import torch

from lightning_zero.config import ZeroConfig
from lightning_zero.integrations.options import ZeroOptions

START_METHODS = ("popen", "spawn", "fork", "forkserver")
"""Lightning's launchers: ``popen`` re-runs the script, the others are multiprocessing's."""

LIGHTNING_ARGUMENTS = {
    "accelerator": "the device type (the Trainer and Fabric set it from their own arguments)",
    "parallel_devices": "this node's devices (set by the Trainer and Fabric)",
    "cluster_environment": "the launch: Lightning's own, torchrun, SLURM (set by the Trainer and Fabric)",
    "checkpoint_io": (
        "Lightning's ``TorchCheckpointIO``; any other plugin is refused with sharded checkpoints (every "
        "rank writes its files with ``torch.save``; ``sharded_checkpoint=False`` saves one file through "
        "the plugin), and so is a URL path such as ``s3://...`` (``file://`` is a local path)"
    ),
    "precision": "the precision plugin, from the Trainer's or Fabric's ``precision=``",
    "process_group_backend": "``None``: gloo on CPU, nccl on CUDA",
    "timeout": (
        "a ``datetime.timedelta``, or ``None`` for torch's default: the training process group's "
        "timeout, also that of every group the strategy creates (node-aware sharding's shard and "
        "replica groups, the background checkpoint writer's), and on NCCL the collective watchdog's "
        "deadline"
    ),
    "start_method": (
        'Lightning\'s launcher for ``devices=N``: ``"popen"`` re-runs the script; ``"spawn"``, '
        '``"fork"``, ``"forkserver"``'
    ),
}
"""The arguments of Lightning's ``DDPStrategy`` the strategies take, with what they do here; their
defaults are read from ``DDPStrategy``'s signature. The others configure ``DistributedDataParallel``,
which the strategies do not use: passing one is a ``TypeError``."""

ARGUMENT_TYPES: dict[str, Any] = {"unit_modules": Any}
"""Where a strategy takes more than the field's type: import paths of module classes too."""

_Init = TypeVar("_Init", bound=Callable[..., None])


class ZeroArguments(TypedDict, total=False):
    """The strategies' keyword arguments for type checkers and IDEs (``**arguments:
    Unpack[TrainerArguments]``); the signature itself is built from the fields (:func:`strategy_signature`),
    and ``tests/unit/test_one_source.py`` fails when these names or types differ from it."""

    stage: int
    bucket_cap_mb: float
    first_bucket_cap_mb: float
    overlap_comm: bool
    overlap_param_gather: bool
    reduce_dtype: str | None
    error_feedback: bool
    gather_dtype: str | None
    find_unused_parameters: bool
    align_numel: int
    skip_nonfinite_steps: int
    sharded_accumulation: bool | None
    reshard_after_forward: bool
    prefetch_units: int
    unit_modules: Any
    min_unit_numel: int
    log_comm_stats: bool
    sharded_checkpoint: bool
    async_checkpoint: bool
    broadcast_buffers: bool
    shard_group_size: int | str | None
    device_mesh: Any
    tensor_parallel_size: int
    pipeline_parallel_size: int
    pipeline_schedule: str
    pipeline_microbatches: int | None
    pipeline_virtual_stages: int
    param_init_fn: Callable[[torch.nn.Module], None] | None
    profile_steps: tuple[int, int] | None
    profile_peak_tflops: float | None
    accelerator: Any  # Lightning's own classes, the Trainer's or Fabric's
    parallel_devices: list[torch.device] | None
    cluster_environment: Any
    checkpoint_io: Any
    process_group_backend: str | None
    timeout: timedelta | None
    start_method: str


class TrainerArguments(ZeroArguments, total=False):
    """:class:`ZeroArguments` with the Trainer's name of the precision plugin."""

    precision_plugin: Any


class FabricArguments(ZeroArguments, total=False):
    """:class:`ZeroArguments` with Fabric's name of the precision plugin."""

    precision: Any


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
    from lightning.fabric.accelerators import Accelerator  # here: see the module's docstring
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.fabric.plugins.precision import Precision

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
    from lightning.fabric.plugins import TorchCheckpointIO

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


def zero_fields() -> list[dataclasses.Field[Any]]:
    """The fields of ``ZeroConfig`` then ``ZeroOptions``: the strategies' own arguments, in order."""
    options = [f for f in dataclasses.fields(ZeroOptions) if f.name != "config"]
    return [*dataclasses.fields(ZeroConfig), *options]


def lightning_name(name: str, peer: Any) -> str:
    """``precision`` is ``precision_plugin`` in the Trainer's ``DDPStrategy``."""
    if name == "precision" and "precision_plugin" in inspect.signature(peer.__init__).parameters:
        return "precision_plugin"
    return name


def strategy_signature(peer: Any) -> inspect.Signature:
    """``__init__(self, *, <ZeroConfig's fields>, <ZeroOptions'>, <LIGHTNING_ARGUMENTS>)``: names,
    defaults and types read from the dataclasses and from ``peer`` (Lightning's ``DDPStrategy``)."""
    hints = {**typing.get_type_hints(ZeroConfig), **typing.get_type_hints(ZeroOptions), **ARGUMENT_TYPES}
    keyword = inspect.Parameter.KEYWORD_ONLY
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for field in zero_fields():
        if field.default is dataclasses.MISSING:  # a default_factory or none: no value to show or pass
            raise TypeError(f"{field.name}: a strategy argument needs a plain default in its dataclass")
        parameters.append(
            inspect.Parameter(field.name, keyword, default=field.default, annotation=hints[field.name])
        )
    theirs = inspect.signature(peer.__init__).parameters
    peer_hints = typing.get_type_hints(peer.__init__)
    for name in LIGHTNING_ARGUMENTS:
        name = lightning_name(name, peer)
        default, annotation = theirs[name].default, peer_hints.get(name, Any)
        parameters.append(inspect.Parameter(name, keyword, default=default, annotation=annotation))
    return inspect.Signature(parameters, return_annotation=None)


def takes_zero_arguments(peer: Any) -> Callable[[_Init], _Init]:
    """Decorate a strategy's ``__init__(self, **arguments)`` with :func:`strategy_signature`."""

    def decorate(init: _Init) -> _Init:
        signature = strategy_signature(peer)
        init.__signature__ = signature  # type: ignore[attr-defined]
        init.__annotations__ = {n: p.annotation for n, p in list(signature.parameters.items())[1:]}
        init.__annotations__["return"] = None
        return init

    return decorate


def split_arguments(
    init: Callable[..., None], arguments: Mapping[str, Any]
) -> tuple[ZeroOptions, dict[str, Any]]:
    """Check a strategy's keyword ``arguments`` against its ``init``'s signature, every value
    included, before any work: our options and Lightning's arguments (defaults filled in).

    Raises:
        TypeError: an argument the strategy does not take (named, with the closest valid ones), or a
            Lightning argument of a wrong type.
        ValueError: a bad value, named with what would be valid.
    """
    signature: inspect.Signature = init.__signature__  # type: ignore[attr-defined]
    owner = init.__qualname__.split(".")[0]
    valid = [n for n in signature.parameters if n != "self"]
    for name in arguments:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=3)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise TypeError(
                f"{owner} got an unexpected keyword argument {name!r}{hint} (it takes: {', '.join(valid)})"
            )
    values = {n: arguments.get(n, p.default) for n, p in signature.parameters.items() if n != "self"}
    ours = {f.name for f in zero_fields()}
    lightning = {n: v for n, v in values.items() if n not in ours}
    precision_name = "precision_plugin" if "precision_plugin" in lightning else "precision"
    checked = {("precision" if n == precision_name else n): v for n, v in lightning.items()}
    check_lightning_arguments(**checked, precision_name=precision_name)
    return ZeroOptions.from_arguments(values), lightning
