"""The strategies' own arguments (:class:`ZeroOptions`), checked when a strategy is built; the rest
are Lightning's ``DDPStrategy``'s."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from lightning_zero.comm.groups import is_device_mesh
from lightning_zero.config import ZeroConfig


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ZeroOptions:
    """The strategies' own arguments besides :class:`~lightning_zero.ZeroConfig`'s fields (the rest are
    Lightning's ``DDPStrategy``'s)."""

    config: ZeroConfig
    """Bucketing, stage, overlap, wire dtype, unused parameters, alignment (validated there)."""
    log_comm_stats: bool = False
    """Log per step the seconds spent waiting on communication, their share of the step, and the
    elements and bytes sent: ``zero/comm_wait_s``, ``zero/comm_wait_frac``, ``zero/elements_sent``,
    ``zero/bytes_sent``, ``zero/elements_sent_vs_min`` (Trainer only: Fabric refuses ``True``)."""
    sharded_checkpoint: bool = True
    """Checkpoints are directories, one shard file per rank (:mod:`lightning_zero.checkpoint`);
    ``False``: one standard file with the optimizer state gathered on rank 0 (refused at stage 3).
    Both kinds load on any world size."""
    async_checkpoint: bool = False
    """A sharded save during ``fit`` copies what this rank writes to host memory and returns; the files
    are written and committed in the background (:mod:`lightning_zero.checkpoint.async_save`). The next
    save, a load and the end of ``fit`` wait for it and raise its failure on every rank. Saves block as
    before outside ``fit``, while handling an exception, for ``hpc_ckpt_*`` and for a path a
    ``ModelCheckpoint(save_last="link")`` links to. Needs ``sharded_checkpoint``; Trainer only."""
    broadcast_buffers: bool = True
    """Broadcast module buffers (BatchNorm statistics) from rank 0 before exactly the forward passes
    where torch DDP's default ``broadcast_buffers=True`` does it."""
    shard_group_size: int | str | None = None
    """Node-aware (hybrid) sharding at every stage: the optimizer state, gradients (and parameters at
    stage 3) are split over groups of this many consecutive ranks and replicated across the groups;
    gradients are reduced inside a group, then each rank's ``1/G`` shard is all-reduced across the
    groups; parameters are gathered inside a group. ``None``: one group of all ranks (flat);
    ``"auto"``: the ranks of one node; a number must divide the world size (checked at setup)."""
    device_mesh: Any = None
    """Instead of ``shard_group_size``: a torch ``DeviceMesh`` over all ranks, built by the user after
    ``init_process_group``: 2-D ``(replicate, shard)`` as in FSDP2's hybrid sharding, or 1-D (flat)."""
    tensor_parallel_size: int = 1
    """Tensor (and sequence) parallelism inside a node: ``T`` consecutive ranks split each layer the way
    the LightningModule's ``configure_model`` plans it (``parallelize_module(model,
    self.device_mesh["tensor_parallel"], plan)``, as under Lightning's ``ModelParallelStrategy``), and
    ZeRO shards over the ``N / T`` data-parallel ranks (``self.device_mesh["data_parallel"]``); the
    ranks of a tensor-parallel group see the same batches. ``T`` must divide the world size and a node's
    ranks (checked at setup). Fabric: parallelize the model over ``strategy.device_mesh["tensor_parallel"]``
    after ``fabric.launch()``, before ``fabric.setup``. With ``shard_group_size`` the data-parallel ranks
    of each tensor rank are sharded node-aware (``"auto"``: a node's data-parallel ranks). Checkpoints
    are sharded directories that record the tensor-parallel layout and resume on another ``T`` or
    data-parallel size (``sharded_checkpoint=False`` is refused). A model built on the meta device
    (``init_module(empty_init=True)``) is parallelized there and initialized as if built with values
    (each rank draws every parameter whole and keeps its slice)."""
    pipeline_parallel_size: int = 1
    """Pipeline parallelism (Trainer only): the model's layers (the LightningModule's
    ``pipeline_layers()``) split into ``P`` stages of consecutive layers, outermost on the layout (each
    stage ``N / P`` consecutive ranks, data- and tensor-parallel inside it); the strategy runs the
    schedule inside each training, validation, test and predict step (``docs/pipeline.md`` states the
    LightningModule's part). No rank holds another stage's parameters."""
    pipeline_schedule: str = "1f1b"
    """``"gpipe"`` (all forwards, then all backwards), ``"1f1b"`` (at most ``P`` micro-batches'
    activations held) or ``"interleaved_1f1b"`` (``pipeline_virtual_stages`` smaller stages per rank:
    a smaller bubble)."""
    pipeline_microbatches: int | None = None
    """``M``: the micro-batches each batch is cut into along its first dimension (which ``M`` must
    divide); ``None``: ``P``. The idle share of a stage is about ``(P - 1) / (M + P - 1)``."""
    pipeline_virtual_stages: int = 1
    """``V``: stages per rank, at least 2 with ``"interleaved_1f1b"``, 1 with the others."""
    param_init_fn: Callable[[torch.nn.Module], None] | None = None
    """A model built on the meta device: ``param_init_fn(module)`` runs on each of its modules, children
    first, after every module's ``reset_parameters()``, as ``model.apply(param_init_fn)`` at the end of
    its constructor would (FSDP's ``param_init_fn``), replayed unit by unit at stage 3
    (:mod:`lightning_zero.engine.deferred_init`). Ignored for a model built with values."""

    profile_steps: tuple[int, int] | None = None
    """``(first, last)``: time the optimizer steps ``first`` to ``last`` (0-based, inclusive) on every
    rank, split into data wait, forward, backward, optimizer and the rest, with the communication the
    host waited on and the memory held by kind; rank 0 writes ``step_profile.json`` to the Trainer's
    ``log_dir`` after the window and every rank logs ``zero/profile/*`` (``docs/strategy.md``). ``None``: no
    profiler at all (Trainer only: Fabric refuses it)."""
    profile_peak_tflops: float | None = None
    """With ``profile_steps``: one device's peak TFLOPS (dense, in the run's compute dtype) that the step
    profile's MFU divides by; ``None``: the profiler's table by the CUDA device's name for 16-bit
    precisions (H100 SXM and H200 989.4, A100 312, ...), else no MFU (a CPU, fp32, an unknown GPU)."""

    def __post_init__(self) -> None:
        for name in ("log_comm_stats", "sharded_checkpoint", "async_checkpoint", "broadcast_buffers"):
            _check_bool(name, getattr(self, name))
        size = self.shard_group_size
        positive = isinstance(size, int) and not isinstance(size, bool) and size >= 1
        if size is not None and size != "auto" and not positive:
            raise ValueError(
                f"shard_group_size must be None (shard over all ranks), 'auto' (the ranks of one node) or a "
                f"positive number of ranks dividing the world size, got {size!r}"
            )
        if self.device_mesh is not None:
            if not is_device_mesh(self.device_mesh):
                raise ValueError(
                    "device_mesh must be None or a torch.distributed.device_mesh.DeviceMesh (1-D: flat "
                    f"sharding over it; 2-D: replicate x shard), got {self.device_mesh!r}"
                )
            if size is not None:
                raise ValueError(
                    f"pass shard_group_size={size!r} or a device_mesh, not both (the mesh's dim 1 is the "
                    "shard group)"
                )
        tensor = self.tensor_parallel_size
        if not (isinstance(tensor, int) and not isinstance(tensor, bool) and tensor >= 1):
            raise ValueError(
                f"tensor_parallel_size must be a positive number of ranks dividing a node's, got {tensor!r}"
            )
        if tensor > 1 and self.device_mesh is not None:
            raise ValueError(
                f"tensor_parallel_size={tensor} builds its own mesh: leave device_mesh unset (node-aware "
                "sharding beside it: shard_group_size)"
            )
        self._check_pipeline()
        self._check_profile_steps()
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise ValueError(
                "param_init_fn must be None or a function of one module (run on each module of a model "
                f"built on the meta device, children first), got {self.param_init_fn!r}"
            )
        if self.config.stage == 3 and not self.sharded_checkpoint:
            raise ValueError(
                "sharded_checkpoint=False is not supported at stage 3 (one file gathered on rank 0 would "
                "need the whole model there); save directories and convert one with `lightning-zero "
                "consolidate DIR FILE`, which streams parameter by parameter"
            )
        if tensor > 1 and not self.sharded_checkpoint:
            raise ValueError(
                f"sharded_checkpoint=False is not supported with tensor_parallel_size={tensor} (one file "
                "of whole tensors would be gathered on rank 0); save directories, which record the "
                "tensor-parallel layout, and convert one with `lightning-zero consolidate DIR FILE`"
            )
        if self.async_checkpoint and not self.sharded_checkpoint:
            raise ValueError("async_checkpoint=True needs sharded_checkpoint=True (directories of shards)")

    def _check_profile_steps(self) -> None:
        peak, window = self.profile_peak_tflops, self.profile_steps
        number = isinstance(peak, (int, float)) and not isinstance(peak, bool)
        if peak is not None and (not number or not peak > 0 or window is None):
            raise ValueError(
                "profile_peak_tflops must be None (the profiler's table) or a positive number of TFLOPS, "
                f"with profile_steps set (the step profile's), got {peak!r} with profile_steps={window!r}"
            )
        if window is None:
            return
        pair = isinstance(window, Sequence) and not isinstance(window, str) and len(window) == 2
        if not (pair and all(isinstance(s, int) and not isinstance(s, bool) for s in window)):
            pair = False
        if not pair or not 0 <= window[0] <= window[1]:
            raise ValueError(
                "profile_steps must be None (no profiler) or (first, last): two optimizer steps, 0-based, "
                f"with 0 <= first <= last, got {window!r}"
            )
        object.__setattr__(self, "profile_steps", (window[0], window[1]))  # a YAML list, kept as a tuple

    def _check_pipeline(self) -> None:
        from lightning_zero.comm.pipeline import SCHEDULES

        pipeline, virtual, micro = (
            self.pipeline_parallel_size,
            self.pipeline_virtual_stages,
            self.pipeline_microbatches,
        )
        for name, value in (("pipeline_parallel_size", pipeline), ("pipeline_virtual_stages", virtual)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if micro is not None and not (isinstance(micro, int) and not isinstance(micro, bool) and micro >= 1):
            raise ValueError(
                f"pipeline_microbatches must be None (one per stage) or a positive int, got {micro!r}"
            )
        if self.pipeline_schedule not in SCHEDULES:
            raise ValueError(
                f"pipeline_schedule must be one of {sorted(SCHEDULES)}, got {self.pipeline_schedule!r}"
            )
        interleaved = self.pipeline_schedule == "interleaved_1f1b"
        if interleaved != (virtual > 1):
            raise ValueError(
                f"pipeline_virtual_stages={virtual} with pipeline_schedule={self.pipeline_schedule!r}: the "
                "interleaved schedule needs 2 or more stages per rank, the others one"
            )
        if pipeline == 1:
            return
        if self.device_mesh is not None or self.shard_group_size is not None:
            raise ValueError(
                f"pipeline_parallel_size={pipeline} shards each stage flat over its data-parallel ranks: "
                "node-aware sharding (shard_group_size, device_mesh) inside a stage is not supported yet; "
                "leave them unset"
            )

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> ZeroOptions:
        """The options among a strategy's keyword arguments (e.g. its ``locals()``); others are ignored.

        Raises:
            ValueError: a bad value, named with what would be valid.
        """
        settings = {f.name: arguments[f.name] for f in fields(ZeroConfig) if f.name in arguments}
        if settings.get("unit_modules") is not None:
            settings["unit_modules"] = resolve_classes("unit_modules", settings["unit_modules"])
        config = ZeroConfig(**settings)
        own = {f.name: arguments[f.name] for f in fields(cls) if f.name != "config" and f.name in arguments}
        return cls(config=config, **own)

    def refuse(self, names: Iterable[str], reason: str) -> None:
        """Raise if any of ``names`` is set to ``True`` (an option this integration cannot honour)."""
        for name in names:
            if getattr(self, name):
                raise ValueError(f"{name}=True is supported by {reason}; use the default False")


def resolve_classes(name: str, value: Any) -> tuple[type, ...]:
    """Module classes from a list of classes or dotted import paths (``"recipes.training.model.Block"``,
    what a YAML config can hold).

    Raises:
        ValueError: naming the argument, its value and the entry that is no importable module class.
    """
    entries = [value] if isinstance(value, str | type) else value
    if not isinstance(entries, Sequence):  # a list, a tuple, or a config's list
        raise ValueError(f"{name} must be a list of module classes or import paths, got {value!r}")
    classes = []
    for entry in entries:
        cls = entry
        if isinstance(entry, str):
            module_name, _, attr = entry.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module_name), attr) if module_name else None
            except (ImportError, AttributeError):
                cls = None
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise ValueError(
                f"{name}: {entry!r} is not an importable torch.nn.Module class (a class, or a path like "
                f"'package.module.Block'), in {value!r}"
            )
        classes.append(cls)
    return tuple(classes)
