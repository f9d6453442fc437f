"""The front end both strategies share: arguments, the sharded twin, buffers, re-plans, restores, teardown.

``ZeroStrategy`` (Trainer) and ``ZeroFabricStrategy`` (Fabric) differ only in how Lightning calls
them; everything they do with the sharded engine lives here, once, and imports nothing of Lightning:

  * :class:`ZeroOptions`: every argument that is ours (not Lightning's), validated at construction,
    from the strategy's own keyword arguments (:meth:`ZeroOptions.from_arguments`);
  * :meth:`ZeroFrontEnd.shard`: the user's Adam/AdamW becomes its sharded twin; its LR schedulers are
    re-pointed at it;
  * :meth:`ZeroFrontEnd.sync_module_states`: rank 0's parameters and buffers everywhere, as DDP does
    at construction;
  * DDP's buffer rule (:meth:`~ZeroFrontEnd.before_forward` / :meth:`~ZeroFrontEnd.after_forward`):
    buffers are broadcast from rank 0 before a forward that follows one run with gradients and sync;
  * :meth:`ZeroFrontEnd.replan_if_changed`: a changed trainable set is re-planned between steps, and
    refused inside an accumulation window;
  * checkpoints: which model tensors go into the shard files, and the restore of the sharded model
    from a directory (:meth:`ZeroFrontEnd.restore_module`);
  * :meth:`ZeroFrontEnd.teardown`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_zero.checkpoint.format import CheckpointError
from lightning_zero.checkpoint.reshard import load_sharded, preflight
from lightning_zero.comm import Comm, hybrid_mesh
from lightning_zero.comm.groups import (
    PIPELINE_MESH_DIMS,
    TENSOR_MESH_DIMS,
    CommGroups,
    pipeline_mesh,
    tensor_groups,
    tensor_mesh,
)
from lightning_zero.config import ZeroConfig
from lightning_zero.engine import ShardEngine
from lightning_zero.engine.deferred_init import (
    DeferredInit,
    DeferredInitError,
    RngState,
    capture_rng,
    check_deferred,
    is_deferred,
    materialize,
)
from lightning_zero.engine.parameters import sharded_engine
from lightning_zero.integrations.options import ZeroOptions
from lightning_zero.layout.buckets import fingerprint
from lightning_zero.layout.dims import ParallelDims
from lightning_zero.layout.local import local
from lightning_zero.layout.stages import whole_order
from lightning_zero.optim import ShardedAdamW
from lightning_zero.optim.twin import make_twin, repoint_scheduler


def sharded_of(optimizer: Any) -> ShardedAdamW:
    """The :class:`ShardedAdamW` inside a Lightning or Fabric optimizer wrapper (or ``optimizer`` itself).

    Raises:
        TypeError: if there is none.
    """
    inner = optimizer
    while not isinstance(inner, ShardedAdamW) and hasattr(inner, "_optimizer"):
        inner = inner._optimizer  # LightningOptimizer, Fabric's _FabricOptimizer
    if not isinstance(inner, ShardedAdamW):
        raise TypeError(f"expected the sharded optimizer, got {type(optimizer).__name__}")
    return inner


class ZeroAccessors:
    """What both strategies show of their front end (``self._zero``), mixed into each."""

    _zero: ZeroFrontEnd

    @property
    def zero_config(self) -> ZeroConfig:
        """The engine's settings (stage, buckets, overlap, ...)."""
        return self._zero.config

    @property
    def sharded_optimizer(self) -> ShardedAdamW | None:
        """The sharded optimizer, once the strategy has set it up (``fit``, ``fabric.setup``)."""
        return self._zero.optimizer


class ZeroFrontEnd:
    """What a strategy does with the sharded engine (one per strategy instance)."""

    def __init__(self, options: ZeroOptions) -> None:
        self.options = options
        self.config = options.config
        self.optimizer: ShardedAdamW | None = None
        """The sharded twin, once :meth:`shard` has run."""
        self._mesh: Any = options.device_mesh
        self._mesh_built = options.device_mesh is not None or options.shard_group_size is None
        self.model_mesh: Any = None
        """Tensor parallelism: the ``(data_parallel, tensor_parallel)`` mesh of :meth:`build_model_mesh`."""
        self._tensor_groups: CommGroups | None = None
        """Tensor parallelism with ``shard_group_size``: the engine's groups for this tensor rank."""
        self._buffers_need_sync = True  # a fresh DDP wrapper's state
        self._construction_rng: RngState | None = None

    @property
    def engine(self) -> ShardEngine | None:
        return None if self.optimizer is None else self.optimizer.engine

    def build_model_mesh(self, ranks_per_node: int, device_type: str, timeout: timedelta | None) -> Any:
        """With ``tensor_parallel_size > 1``: the ``(data_parallel, tensor_parallel)`` mesh (dims
        :data:`~lightning_zero.comm.groups.TENSOR_MESH_DIMS`, Lightning ``ModelParallelStrategy``'s),
        with ``pipeline_parallel_size > 1`` the ``(pipeline_parallel, data_parallel, tensor_parallel)``
        one (:func:`~lightning_zero.comm.groups.pipeline_mesh`), built at the first call and kept;
        ``None`` otherwise. Call on all ranks, after the process
        group exists.

        With ``shard_group_size`` too, the engine's shard groups and replicas of this rank's tensor index
        are built with it (:func:`~lightning_zero.comm.groups.tensor_groups`).

        Raises:
            ValueError: ``tensor_parallel_size`` does not divide the world or a node's ranks, or
                ``shard_group_size`` the data-parallel ranks (named).
        """
        tensor, size = self.options.tensor_parallel_size, self.options.shard_group_size
        pipeline = self.options.pipeline_parallel_size
        if pipeline > 1 and self.model_mesh is None:  # options refuse shard_group_size beside it
            self.model_mesh = pipeline_mesh(pipeline, tensor, device_type, timeout)
        elif tensor > 1 and self.model_mesh is None and size is None:
            self.model_mesh = tensor_mesh(tensor, device_type, timeout, ranks_per_node)
        elif tensor > 1 and self.model_mesh is None:
            dims = ParallelDims.with_tensor(Comm().world_size, tensor, ranks_per_node, size)
            self._tensor_groups, self.model_mesh = tensor_groups(dims, device_type, timeout)
        return self.model_mesh

    def data_parallel(self) -> tuple[int, int] | None:
        """``(ranks, this rank)`` of the data-parallel dimension under tensor parallelism (what the
        sampler splits the data by), else ``None``."""
        if self.model_mesh is None:
            return None
        data = self.model_mesh[TENSOR_MESH_DIMS[0]]
        return data.size(), data.get_local_rank()

    def pipeline_group(self) -> Any:
        """The 1-D mesh of this rank's pipeline stages (one rank per stage), or ``None``."""
        mesh = self.model_mesh
        if mesh is None or PIPELINE_MESH_DIMS[0] not in (mesh.mesh_dim_names or ()):
            return None
        return mesh[PIPELINE_MESH_DIMS[0]]

    def data_comm(self) -> Comm:
        """The communicator of the data-parallel ranks (the world without tensor parallelism)."""
        if self._tensor_groups is not None:
            return self._tensor_groups.world
        return Comm() if self.model_mesh is None else Comm(self.model_mesh[TENSOR_MESH_DIMS[0]].get_group())

    def device_mesh(self, ranks_per_node: int, device_type: str, timeout: timedelta | None) -> Any:
        """The mesh the engine shards over (``None``: flat over the default group), built at the first
        call from ``shard_group_size`` (``"auto"``: ``ranks_per_node``) and kept: the strategy's later
        fits reuse its process groups, created with ``timeout`` (the strategy's). Call on all ranks.

        Raises:
            ValueError: a group size that does not divide the world size (named, with the valid ones).
        """
        if self._tensor_groups is not None:  # tensor parallelism beside node-aware sharding
            return self._tensor_groups
        if self.model_mesh is not None:  # tensor parallelism: flat over the data-parallel dimension
            return self.model_mesh[TENSOR_MESH_DIMS[0]]
        if not self._mesh_built:
            size = self.options.shard_group_size
            assert size is not None  # else the mesh counts as built (flat)
            self._mesh = hybrid_mesh(size, device_type, timeout, ranks_per_node)
            self._mesh_built = True
        return self._mesh

    def shard(
        self,
        optimizer: torch.optim.Optimizer,
        module: torch.nn.Module,
        schedulers: Iterable[Any] = (),
        device_mesh: Any = None,
        deferred_init: DeferredInit | None = None,
    ) -> ShardedAdamW:
        """The sharded twin of ``optimizer`` over ``module``'s parameters; every scheduler (and its
        children) now drives it. Call on all ranks: the bucket plans are compared first.
        ``device_mesh``: hybrid sharding (:meth:`device_mesh`); ``deferred_init``: a stage-3 model on
        the meta device, initialized unit by unit (:meth:`deferred_init`).

        Raises:
            TypeError: ``optimizer`` is not a ``torch.optim.Adam``/``AdamW``.
            PlanMismatchError: the ranks do not build the same plan.
        """
        stage3 = self.config.stage == 3
        sharded = make_twin(
            optimizer,
            self.config,
            module.named_parameters(),
            module if stage3 else None,
            device_mesh,
            deferred_init if stage3 else None,
            self.pipeline_group(),
        )
        if self.pipeline_group() is not None:  # checkpoints number the optimizer state as the unsplit model
            sharded.engine.model_order = tuple(whole_order(module))
        for scheduler in schedulers:
            repoint_scheduler(scheduler, sharded)
        self.optimizer = sharded
        self._buffers_need_sync = True
        return sharded

    # ---- deferred initialization ------------------------------------------------------------

    @contextmanager
    def on_meta_device(self, device: torch.device) -> Iterator[None]:
        """Build a model inside on the meta device (``init_module(empty_init=True)``, stage 3's
        ``configure_model()``); the generators' state at the entry is what its deferred
        initialization starts from (:mod:`lightning_zero.engine.deferred_init`)."""
        self._construction_rng = capture_rng(device)
        with torch.device("meta"):
            yield

    def deferred_init(self, module: torch.nn.Module, device: torch.device) -> DeferredInit | None:
        """``None`` for a model with values; for one on the meta device, where and from which
        generator state to initialize it: the state at the entry of :meth:`on_meta_device` (or now,
        for a model built on the meta device elsewhere), rank 0's on every rank. All ranks.

        Raises:
            DeferredInitError: a model the rule cannot initialize (named modules), or ranks that built
                it differently; before any work, on every rank.
        """
        comm = Comm()
        mine = int(is_deferred(module))
        same = comm.same_everywhere([mine])  # one all-reduce; every rank's flag only if they differ
        if same and not mine:
            if self.options.param_init_fn is not None:
                rank_zero_warn(
                    "param_init_fn was given, but the model was built with values (not under "
                    "init_module(empty_init=True) or in configure_model()): it was not run"
                )
            return None
        if not same:
            flags = [f for (f,) in comm.all_gather_ints([mine])]
            raise DeferredInitError(
                f"ranks {[r for r, f in enumerate(flags) if f]} built the model on the meta device and ranks "
                f"{[r for r, f in enumerate(flags) if not f]} did not: every rank must build it the same way"
            )
        init_fn = self.options.param_init_fn
        check_deferred(module, init_fn)
        rng = self._construction_rng if self._construction_rng is not None else capture_rng(device)
        self._construction_rng = None  # a later model starts from its own construction
        return DeferredInit(device, comm.broadcast_object(rng, src=0), init_fn)

    @staticmethod
    def initialize_whole(module: torch.nn.Module, init: DeferredInit) -> None:
        """Every tensor of a meta ``module`` given its values on ``init.device`` (stages 1 and 2, or a
        model evaluated without ``fit``): the whole model on every rank, as eager construction."""
        materialize(module, init)

    @staticmethod
    def sync_module_states(
        module: torch.nn.Module, check_same: bool = False, broadcast: bool = True, comm: Comm | None = None
    ) -> None:
        """Rank 0's parameters and buffers on every rank (in place), as DDP does at construction;
        names in ``module._ddp_params_and_buffers_to_ignore`` are left alone. Call on all ranks.

        Args:
            check_same: first agree that every rank holds the same tensors (names, shapes, dtypes),
                so that different models are an error on every rank, not a broadcast that hangs.

            broadcast: ``False``: only the check (a model still on the meta device).
            comm: the ranks to agree over (default the world; under tensor parallelism the data-parallel
                ranks, :meth:`data_comm`: a ``DTensor``'s local slice is the same across them only).

        Raises:
            ValueError: with ``check_same``, on every rank, naming a tensor that differs.
        """
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        engine = sharded_engine(module)  # stage 3 after fit: the shards agree, placeholders cannot be written
        sharded = set() if engine is None else {id(p) for p in engine.sharded_parameters()}
        tensors = itertools.chain(module.named_parameters(), module.named_buffers())
        named: list[tuple[str, torch.Tensor]] = [
            (n, local(t)) for n, t in tensors if n not in ignored and id(t) not in sharded
        ]
        comm = comm if comm is not None else Comm()
        mine = [(n, tuple(t.shape), str(t.dtype)) for n, t in named]
        if check_same and not comm.same_everywhere([fingerprint(map(repr, mine))]):  # O(1) unless they differ
            layouts = comm.all_gather_object(mine)
            for rank, layout in enumerate(layouts):
                if layout != layouts[0]:
                    differ = next((a, b) for a, b in itertools.zip_longest(layout, layouts[0]) if a != b)
                    raise ValueError(
                        f"rank {rank} holds another model than rank 0: {differ[0]} where rank 0 has "
                        f"{differ[1]} (name, shape, dtype); every rank must build the same model"
                    )
        if broadcast:
            comm.broadcast_tensors([t.detach() for _, t in named], src=0)

    # ---- forwards ---------------------------------------------------------------------------

    def before_forward(self, module: torch.nn.Module) -> None:
        """DDP's buffer rule, first half: broadcast rank 0's buffers if the last forward asked for it."""
        engine = self.engine
        if self._buffers_need_sync and self.options.broadcast_buffers and engine is not None:
            buffers = list(module.buffers())
            if buffers:
                engine.broadcast(buffers, src=0)

    def after_forward(self, sync_applies: bool = True) -> None:
        """DDP's buffer rule, second half: the next forward broadcasts after one run with gradients and
        sync (not after a ``no_sync`` micro-batch, a forward under ``no_grad``, or, with
        ``sync_applies=False``, where DDP's sync is off around the forward)."""
        engine = self.engine
        self._buffers_need_sync = (
            torch.is_grad_enabled() and engine is not None and engine.syncing and sync_applies
        )

    def replan_if_changed(self, module: torch.nn.Module, where: str) -> None:
        """Re-plan buckets and shards if the trainable set changed since the last plan. All ranks.

        Raises:
            RuntimeError: inside an accumulation window (``where`` says when: e.g. the global step).
        """
        engine = self.engine
        if engine is None or not engine.trainable_changed():
            return
        if engine.accumulating:
            raise RuntimeError(
                "the trainable parameters changed in the middle of a gradient accumulation window "
                f"({where}); change requires_grad or add param groups at an optimizer-step boundary"
            )
        assert self.optimizer is not None
        self.optimizer.replan(module.parameters(), {p: n for n, p in module.named_parameters()})

    def count_steps_from(self, optimizer_steps: int) -> None:
        """The optimizer steps taken so far (e.g. ``trainer.global_step``, restored on resume): the
        step a non-finite-gradient error names."""
        if self.engine is not None:
            self.engine.optimizer_steps = optimizer_steps

    def wait_for_params(self) -> None:
        """Complete the parameter all-gathers left in flight by ``overlap_param_gather``."""
        if self.engine is not None:
            self.engine.wait_for_params()

    def teardown(self) -> None:
        """Remove the engine's training hooks (waiting for gathers in flight); its state stays for
        saving. At stage 3 the model stays sharded (every unit freed; its forward and state dict
        gather on request). All ranks."""
        if self.engine is not None:
            self.engine.finish_training()

    def follow_module(self) -> None:
        """After the framework moved the module (a GPU teardown gives parameters new CPU storage), the
        sharded state follows it, so a save after ``fit`` still writes the sharded directory."""
        if self.engine is not None:
            self.engine.follow_parameters()

    # ---- checkpoints ------------------------------------------------------------------------

    def bound(self) -> bool:
        """Whether the sharded optimizer exists and the model's parameters still are its views
        (Lightning's teardown on a GPU gives parameters new storage)."""
        return self.engine is not None and self.engine.is_bound()

    def writes_shards(self) -> bool:
        """Whether a save writes the sharded directory format."""
        return self.options.sharded_checkpoint and self.bound()

    def state_for_shards(self, module: torch.nn.Module) -> dict[str, Any]:
        """``module.state_dict()`` for a save whose shard files hold the trainable parameters: at
        stage 3 no unit is gathered for it (those entries are placeholders, dropped by
        :meth:`module_state`)."""
        engine = self.engine
        if engine is not None and engine.units is not None and sharded_engine(module) is engine:
            with engine.units.requests.off():
                return module.state_dict()
        return module.state_dict()

    def tied_aliases(self, module: torch.nn.Module) -> dict[str, str]:
        """The other names of ``module``'s planned parameters (a weight tied under two names, e.g. an
        output layer sharing the embedding's): alias -> the name the plan and the shard files use."""
        if self.engine is None:
            return {}
        trainable = self.engine.trainable_names()
        first = {id(p): n for n, p in module.named_parameters() if n in trainable}
        return {
            n: first[id(p)]
            for n, p in module.named_parameters(remove_duplicate=False)
            if id(p) in first and n != first[id(p)]
        }

    def module_state(
        self, state: dict[str, Any], trainable_in_shards: bool, aliases: Iterable[str] = ()
    ) -> dict[str, Any]:
        """A module's state for saving: every tensor a copy that owns its data (parameters are views
        of flat buffers), without the trainable parameters (and their ``aliases``, see
        :meth:`tied_aliases`) when the shard files hold them."""
        self.wait_for_params()
        if trainable_in_shards and self.engine is not None:
            trainable = self.engine.trainable_names() | set(aliases)
            state = {k: v for k, v in state.items() if k not in trainable}
        return {k: v.detach().clone() for k, v in state.items()}

    def restore_module(
        self,
        path: Path,
        meta: dict[str, Any],
        module: torch.nn.Module,
        extras: dict[str, Any],
        strict: bool,
        with_optimizer: bool = False,
        average_apart: bool | None = None,
    ) -> None:
        """Fill the sharded model from a checkpoint directory on any world size: its trainable
        parameters (and, with ``with_optimizer``, the optimizer state) from the shard files, the rest
        (buffers, frozen parameters) from ``extras``. All ranks; checks every rank's files first.
        ``average_apart``: as :func:`~lightning_zero.checkpoint.reshard.load_sharded`.

        Raises:
            CheckpointError: the checkpoint does not fit (every rank), or, with ``strict``, keys
                outside the shards are missing or unexpected.
        """
        engine = self.engine
        assert engine is not None
        preflight(engine, path, meta)
        load_sharded(engine, path, meta, with_optimizer=with_optimizer, average_apart=average_apart)
        missing, unexpected = module.load_state_dict(extras, strict=False)
        trainable = engine.trainable_names() | set(meta.get("aliases", {}))
        missing = [k for k in missing if k not in trainable]
        if strict and (missing or unexpected):
            raise CheckpointError(
                f"{path}: model state does not match: missing keys {sorted(missing)}, "
                f"unexpected keys {sorted(unexpected)}"
            )
