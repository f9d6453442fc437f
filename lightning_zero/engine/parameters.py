"""Where an engine's parameters are full: waits for gathers in flight, stage 3's gathers on request,
the end of stage 3, and the flat buffers following parameters that were given new storage.

:class:`ParameterAccess` is a part of :class:`~lightning_zero.engine.engine.ShardEngine` (its base):
everything that reads or rebinds the parameters outside the training path. All of it takes the
engine's own ``flat``, ``gather`` and ``units`` (stage 3) and communicates through ``comm``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from lightning_zero.comm.communicator import Comm
from lightning_zero.config import ZeroConfig
from lightning_zero.engine.param_gather import ParamGather
from lightning_zero.engine.reducer import GradReducer
from lightning_zero.engine.shard_state import ShardState
from lightning_zero.engine.unit_gather import UnitGather
from lightning_zero.layout.buckets import BucketPlan
from lightning_zero.layout.flat import FlatParams

_SHARDED: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[ParameterAccess]] = (
    weakref.WeakKeyDictionary()
)
"""Stage-3 models and their engines (the model's hooks keep the engine alive, not this table)."""


def register_sharded(module: torch.nn.Module, engine: ParameterAccess) -> None:
    """``module``'s parameters are sharded by ``engine`` (stage 3) until its :meth:`unshard`."""
    _SHARDED[module] = weakref.ref(engine)


def sharded_engine(module: torch.nn.Module | None) -> ParameterAccess | None:
    """The engine whose stage 3 holds ``module``'s parameters sharded, or None (a plain module)."""
    ref = _SHARDED.get(module) if module is not None else None
    engine = ref() if ref is not None else None
    return engine if engine is not None and engine.units is not None else None


def unshard(module: torch.nn.Module) -> torch.nn.Module:
    """Make a model left sharded by stage 3 (after ``fit`` under ``"zero3"``, or with a stage-3
    ``ShardedAdamW``) a plain module again: every parameter full on every rank (the whole model's
    memory on each), and no hook of ours left on it or its parameters (gathers, gradient hooks,
    state-dict hooks, a strategy's forward hooks), so that any optimizer, e.g. a new
    ``torch.optim.AdamW``, trains it as a model never sharded. The sharded optimizer no longer
    steps it (its ``step()`` raises); it can still save. A no-op for any other module. All ranks.

    Returns:
        ``module`` itself.
    """
    engine = sharded_engine(module)
    if engine is not None:
        engine.unshard()
    return module


@contextmanager
def gathered(module: torch.nn.Module, writeback: bool = False) -> Iterator[torch.nn.Module]:
    """Inside, ``module``'s parameters hold their full values, though a stage-3 model keeps them sharded
    (after ``fit`` under ``"zero3"``, during it in a callback or hook, or with a stage-3
    ``ShardedAdamW``): the units holding ``module``'s parameters are gathered (``module`` is the model
    or any submodule of it: a block gathers its own unit only), then freed at the exit (a unit
    gathered already at the entry, such as the root during a step, is gathered again from the shards
    as it was held). Writes inside are lost at the exit unless ``writeback``: then each rank keeps its
    slice of what the parameters hold at the exit (write the same values on every rank, e.g. a
    broadcast) and the optimizer's fp32 masters follow. Below stage 3 the parameter gathers in flight
    complete; for a module no engine shards, nothing happens. A collective: call it on every rank,
    with the same ``module``.

    Yields:
        ``module`` itself.
    """
    params = {id(p) for p in module.parameters()}
    engine = next(
        (e for e in _engines() if any(id(p) in params for p in e.params_in_order)),
        None,
    )
    if engine is None:
        yield module
        return
    with engine.gathered_parameters(params, writeback):
        yield module


def _engines() -> list[ParameterAccess]:
    """The engines whose stage 3 holds a model sharded now."""
    found = []
    for ref in list(_SHARDED.values()):
        engine = ref()
        if engine is not None and engine.units is not None:
            found.append(engine)
    return found


class ParameterAccess:
    """Reads, waits and rebinds of the parameters (the attributes :class:`ShardEngine` sets)."""

    comm: Comm
    world: Comm
    config: ZeroConfig
    flat: FlatParams
    gather: ParamGather
    params_in_order: list[torch.nn.Parameter]
    plan: BucketPlan
    reducer: GradReducer
    state: ShardState
    units: UnitGather | None
    module: torch.nn.Module | None
    unsharded: bool
    """:meth:`unshard` ended stage 3: the model is plain, this engine no longer steps it."""
    module_hooks: list[RemovableHandle]
    """Hooks an integration put on the model, removed by :meth:`unshard`."""
    average_device: torch.device | None

    def remove_at_unshard(self, handles: list[RemovableHandle]) -> None:
        """Hooks an integration put on the model (stage 3), removed by :meth:`unshard` with the engine's
        own, so that it leaves a plain module."""
        self.module_hooks.extend(handles)

    def install_forward_waits(self, module: torch.nn.Module) -> None:
        """``module``'s submodules wait in their forward for the buckets holding their parameters."""
        self.gather.install_forward_waits(module, self.params_in_order)

    def gather_root(self) -> None:
        """Stage 3: gather the root unit before a step function that uses it without calling the
        model's forward (a no-op below stage 3)."""
        if self.units is not None:
            self.units.gather_root()

    @contextmanager
    def full_parameters(self, writeback: bool = False) -> Iterator[None]:
        """Inside, every planned parameter holds its full value (stage 3 gathers every unit, then frees
        them; below stage 3, the gathers in flight complete). At stage 3 writes to the parameters
        inside are lost at the exit, unless ``writeback``: then each rank keeps its slice of what the
        parameters hold at the exit (identical writes on every rank, e.g. a broadcast, stay
        consistent) and the fp32 masters are re-read. All ranks."""
        with self.gathered_parameters({id(p) for p in self.params_in_order}, writeback):
            yield

    @contextmanager
    def gathered_parameters(self, params: set[int], writeback: bool = False) -> Iterator[None]:
        """:meth:`full_parameters` for the units holding the planned parameters whose ids are in
        ``params`` (stage 3; below it every gather in flight completes). All ranks, the same ``params``.
        At the exit a unit is freed, but one gathered already at the entry (the root during a step, a
        unit between its forward and its backward), which is gathered again from the shards as it was
        held (int8 rows where its forward ran on them): the backward that follows needs it, and writes
        inside reach it only through ``writeback``. On an exception every unit is freed (no collective
        on a path one rank may take alone)."""
        if self.units is None:
            self.wait_for_params()
            yield
            return
        layout = self.units.layout
        units = sorted({layout.of_param[i] for i, p in enumerate(self.params_in_order) if id(p) in params})
        held = {u: self.units.units[u].quantized for u in units if self.units.gathered(u)}  # every rank alike
        self.units.gather_units(units)
        try:
            yield
            if writeback:
                self.flat.keep_own_slices([b for u in units for b in self.units.units[u].buckets])
                self.state.refresh_master()
        except BaseException:
            for unit in units:
                self.units.free(unit)
            raise
        for unit in units:
            if unit in held:
                self.units.refill(unit, quantized=held[unit])
            else:
                self.units.free(unit)

    def publish_shards(self) -> None:
        """After this rank's parameter shards were written (a checkpoint load): the full parameters
        follow them (below stage 3 every bucket is all-gathered; at stage 3 every unit is freed, the
        next forward gathers it). All ranks."""
        if self.units is not None:
            self.units.free_all()
            return
        for b in range(len(self.plan.buckets)):
            self.gather.launch(b)
        self.gather.wait()

    def wait_for_params(self, root_only: bool = False) -> None:
        """Complete the parameter all-gathers still in flight (a no-op without overlap); with
        ``root_only``, only the buckets holding parameters that the module given to
        :meth:`install_forward_waits` owns itself, not through a submodule."""
        if root_only:
            self.gather.wait_root()
        else:
            self.gather.wait()

    def is_bound(self) -> bool:
        """Whether every planned parameter still is a view of the flat buffers."""
        return self.flat.is_bound(self.params_in_order)

    @torch.no_grad()
    def follow_parameters(self) -> None:
        """After the parameters were given new storage, perhaps on another device (Lightning's teardown
        moves the module to the CPU): new flat buffers on their device holding their values, bound to
        them again, and every record's state moved there, so a later save writes the same sharded
        format and reads no stale buffer. Local: no communication. For saving and reading after
        training; the gradient hooks stay removed (call after :meth:`remove_hooks`)."""
        if self.is_bound():
            return
        if self.units is not None:
            raise RuntimeError(
                "stage 3: the parameters were given new storage (module.to(...) or a dtype change after "
                "the optimizer was built); move the model before building the optimizer"
            )
        self._rebind()

    def _rebind(self, flat: FlatParams | None = None) -> None:
        """Flat buffers of stages 1 and 2 (``flat``, or built from the parameters' current values), and
        every record pointed at them (on the parameters' device)."""
        self.flat = flat if flat is not None else FlatParams(self.params_in_order, self.plan, self.comm.rank)
        device = self.flat.device
        for record in self.state.records:
            separate = record.separate_master
            record.param = self.flat.shard(record.bucket)
            record.master = record.master.to(device) if separate else record.param
            record.grad = record.grad.to(device)
            record.moments = {name: t.to(device) for name, t in record.moments.items()}
            if record.average is not None and self.average_device is None:  # kept beside the master
                record.average = record.average.to(device)
                self.state.average_on = device
        self.gather = ParamGather(self.plan, self.flat, self.comm, self.config.overlap_param_gather)

    @torch.no_grad()
    def unshard(self) -> None:
        """Stage 3, after training: every hook removed (the units', the gradient hooks, the forward
        waits, those given to :meth:`remove_at_unshard`) and every parameter full again, a view of flat
        buffers laid out as at stage 2, all-gathered bucket by bucket from the shards straight into them
        (the full model's memory on every rank, once: no unit is gathered on the way). The engine keeps
        its shards for saving; :meth:`step` refuses from now on. All ranks; a no-op below stage 3."""
        if self.units is None:
            return
        self.gather.remove_hooks()
        self.reducer.remove_hooks()
        for handle in self.module_hooks:
            handle.remove()
        self.module_hooks.clear()
        flat = self.units.unshard()
        self.units = None
        self._rebind(flat)
        self.unsharded = True
        if self.module is not None:
            _SHARDED.pop(self.module, None)

    def refresh_master(self) -> None:
        """Re-read separate (fp32) master shards from the parameters, after parameters were loaded."""
        self.wait_for_params()
        self.state.refresh_master()

    def broadcast(self, tensors: list[Tensor], src: int = 0) -> None:
        """Overwrite ``tensors`` (e.g. module buffers) with rank ``src``'s values. All ranks."""
        self.world.broadcast_tensors(tensors, src=src)

    def sharded_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters stage 3 holds as shards (placeholders outside their unit's use); none below
        stage 3."""
        return list(self.params_in_order) if self.units is not None else []

    def finish_training(self) -> None:
        """The end of training: the gathers in flight completed, the forward waits and gradient hooks
        removed. At stage 3 every unit is freed and the model stays sharded: its forward, its
        ``state_dict()`` and its ``load_state_dict()`` gather units on request (all ranks), and
        :func:`unshard` makes it a plain module. The state stays: saving after it still works."""
        self.gather.remove_hooks()
        self.reducer.remove_hooks()
        if self.units is not None:
            self.units.free_all()

    def remove_hooks(self) -> None:
        """Complete the gathers in flight and remove every hook the engine installed (forward waits,
        gradient hooks). The state stays: saving after it still works."""
        self.gather.remove_hooks()
        self.reducer.remove_hooks()
        if self.units is not None:
            self.units.remove_hooks()
