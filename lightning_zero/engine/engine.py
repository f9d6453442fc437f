"""``ShardEngine``: the buffers, hooks, collectives and shard state behind one sharded optimizer.

One engine per set of trainable parameters. Its parts:
  * ``plan`` (:mod:`lightning_zero.layout.buckets`): which parameter lives where, identical on every
    rank (checked at construction, :mod:`lightning_zero.engine.plan_check`);
  * ``flat`` (:mod:`lightning_zero.layout.flat`): the flat buffers the parameters are views of;
  * ``reducer`` (:mod:`lightning_zero.engine.reducer`): the gradient hooks and the per-bucket
    reduce-scatter (stage 2) or all-reduce (stage 1) into the gradient shards, through a wire codec
    (:mod:`lightning_zero.engine.codecs`);
  * ``state`` (:mod:`lightning_zero.engine.shard_state`): one record per bucket shard (master,
    gradient, moments by name) and the optimizer's update rule applied to them;
  * ``gather`` (:mod:`lightning_zero.engine.param_gather`): the per-bucket parameter all-gather,
    optionally left in flight into the next forward;
  * ``units`` (stage 3, :mod:`lightning_zero.engine.unit_gather`): the parameters sharded too, each
    unit's gathered around its forward and backward; the step then gathers nothing;
  * ``comm`` (:mod:`lightning_zero.comm`, the only caller of ``torch.distributed``).

Who talks to it how: the optimizer (:class:`~lightning_zero.ShardedAdamW`) and the integrations
(strategies, precision plugins, callbacks, the monitor) use the named methods below, never its parts;
readers and writers of the sharded state one layer up (checkpoints, resharding, full-state
conversion) read ``plan``, ``flat``, ``state`` and ``comm``. It reads the param-group dicts it is
given (the optimizer's own list, shared, so a group added with ``add_param_group`` or an LR a
scheduler writes is seen at the next step) and never holds a reference to the optimizer.

Communication per step (:meth:`ShardEngine.step`): what the reducer launched during backward is
collected, each bucket's owned shard is updated and its all-gather launched at once (the next
bucket's update overlaps it). Clipping and loss-scale checks add one small all-reduce each; so does
``skip_nonfinite_steps`` unless it rides on ``find_unused_parameters``' mask
(:mod:`lightning_zero.engine.nonfinite`): a step with inf/NaN gradients on any rank is skipped on
every rank, before any update or gather.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

import lightning_zero.engine.grad_math as grad_math
from lightning_zero.comm.communicator import Comm, CommStats
from lightning_zero.config import ZeroConfig
from lightning_zero.engine.nonfinite import NonFiniteGuard
from lightning_zero.engine.param_gather import ParamGather
from lightning_zero.engine.plan_check import check_same_plan
from lightning_zero.engine.reducer import GradReducer
from lightning_zero.engine.replan import Parked, carry_state
from lightning_zero.engine.shard_state import ShardState, UpdateRule
from lightning_zero.engine.unit_gather import UnitGather
from lightning_zero.layout.buckets import ParamSpec, plan_buckets
from lightning_zero.layout.flat import FlatParams
from lightning_zero.layout.partition import shard_range
from lightning_zero.layout.units import find_units


@dataclass(frozen=True)
class EngineMemory:
    """What the engine holds on this rank, for benchmarks and tests."""

    state_bytes: int
    """Optimizer moments and separate master copies."""
    grad_shard_bytes: int
    """The averaged gradient shards."""
    pool_bytes: int
    """Accumulation buffers of the wire pool allocated so far."""
    adopted: int
    """Gradients that became their bucket's accumulation buffer so far (no copy, no pool slot)."""
    allocations_outside_pool: int
    """Accumulation buffers allocated because every pool slot was busy (e.g. ``no_sync``)."""


class ShardEngine:
    """Flat buffers, gradient reduction, shard state and parameter gathers for ``param_groups``.

    Args:
        param_groups: the optimizer's list of param-group dicts (shared, not copied).
        config: bucketing and sharding settings.
        comm: the data-parallel group's communicator.
        rule: the optimizer's update over shard pieces (its moments are allocated by name).
        param_order: the parameters in registration order (buckets follow its reverse); ``None``:
            the order of the groups.
        param_names: names for plans, errors and checkpoints.
        module: the model the parameters belong to: its units are gathered and freed at stage 3
            (required there; unused below).

    Raises:
        ValueError: no trainable parameter; stage 3 without ``module``.
        PlanMismatchError: the ranks do not build the same bucket plan (checked at construction).
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        config: ZeroConfig,
        comm: Comm,
        rule: UpdateRule,
        param_order: Iterable[torch.nn.Parameter] | None = None,
        param_names: dict[torch.nn.Parameter, str] | None = None,
        module: torch.nn.Module | None = None,
    ) -> None:
        if config.stage == 3 and module is None:
            raise ValueError(
                "stage 3 shards the parameters and gathers them around each unit's forward: pass the "
                "model (ShardedAdamW(..., module=model))"
            )
        self.param_groups = param_groups
        self.module = module
        self.config = config
        self.comm = comm
        self.rule = rule
        self._param_order = None if param_order is None else list(param_order)
        self._names = param_names or {}
        self._parked = Parked()
        self.guard = NonFiniteGuard(comm, config.skip_nonfinite_steps)
        self.optimizer_steps = 0
        """Optimizer steps so far: :meth:`step` calls with gradients, skipped ones included (the step an
        error names). The Trainer strategy sets it to ``trainer.global_step`` before each training step."""
        self._build()

    def _build(self) -> None:
        in_groups = {p: gi for gi, g in enumerate(self.param_groups) for p in g["params"] if p.requires_grad}
        candidates = self._param_order or [p for g in self.param_groups for p in g["params"]]
        order = [p for p in candidates if p in in_groups]
        order = list(dict.fromkeys(order))  # tied weights appear once
        order += [p for p in in_groups if p not in set(order)]
        if not order:
            raise ValueError("the optimizer has no parameter with requires_grad=True")
        specs = [
            ParamSpec(self._names.get(p, f"param{i}"), tuple(p.shape), p.dtype) for i, p in enumerate(order)
        ]
        config = self.config
        layout = None
        if config.stage == 3:
            assert self.module is not None  # checked in __init__
            layout = find_units(self.module, order, config.unit_modules, config.min_unit_numel)
        self.plan = plan_buckets(
            specs,
            self.comm.world_size,
            config.bucket_cap_mb,
            config.first_bucket_cap_mb,
            config.align_numel,
            units=None if layout is None else layout.of_param,
        )
        check_same_plan(self.plan, self.comm)
        self.params_in_order = order
        self.flat = FlatParams(order, self.plan, self.comm.rank, sharded=layout is not None)
        self.gather = ParamGather(self.plan, self.flat, self.comm, config.overlap_param_gather)
        self.units = None
        if layout is not None:
            self.units = UnitGather(
                self.plan, self.flat, self.comm, layout, config.reshard_after_forward, config.prefetch_units
            )
        self.reducer = GradReducer(order, self.plan, self.flat, self.comm, config, self.guard)
        self.state = ShardState(
            self.plan,
            self.flat,
            self.reducer.grad_shards,
            [in_groups[p] for p in order],
            self.rule,
            self.param_groups,
        )
        self._trainable = self._trainable_signature()

    # ---- the trainable set ------------------------------------------------------------------

    def _trainable_signature(self) -> tuple[tuple[bool, ...], ...]:
        return tuple(tuple(p.requires_grad for p in g["params"]) for g in self.param_groups)

    def trainable_changed(self) -> bool:
        """Whether a param group was added or a ``requires_grad`` flag flipped since the plan was built."""
        return self._trainable_signature() != self._trainable

    def trainable_names(self) -> set[str]:
        """Names of the planned (trainable) parameters: what the shard files hold."""
        return {p.name for p in self.plan.params}

    def replan(
        self,
        param_order: Iterable[torch.nn.Parameter] | None = None,
        param_names: dict[torch.nn.Parameter, str] | None = None,
    ) -> None:
        """New buckets, flat buffers and shards for the parameters trainable now, each parameter's
        optimizer state carried over (a frozen one's parked). Call on all ranks between optimizer steps.

        Raises:
            RuntimeError: inside a gradient accumulation window (gradients are held for the old plan).
        """
        if self.accumulating:
            raise RuntimeError(
                "the trainable parameters changed in the middle of a gradient accumulation window; "
                "change requires_grad or add param groups at an optimizer-step boundary"
            )
        if self.units is not None:
            raise RuntimeError(
                "the trainable parameters changed, and stage 3 cannot re-plan yet; keep requires_grad "
                "and the param groups fixed during training, or use stage 1 or 2"
            )
        if param_order is not None:
            self._param_order = list(param_order)
        if param_names is not None:
            self._names = param_names
        self.reducer.reset()
        self.reducer.remove_hooks()
        module = self.gather.module
        self.gather.remove_hooks()  # waits: the new flat buffers copy complete parameters
        old = (self.plan, self.params_in_order, self.state)
        self._build()
        carry_state(self.comm, old, (self.plan, self.params_in_order, self.state), self._parked)
        if module is not None:
            self.gather.install_forward_waits(module, self.params_in_order)
        kept = set(self.params_in_order)
        for param in old[1]:
            if param not in kept:  # its own storage: the old flat buffer is freed with the old plan
                param.data = param.data.clone()

    # ---- parameters -------------------------------------------------------------------------

    def install_forward_waits(self, module: torch.nn.Module) -> None:
        """``module``'s submodules wait in their forward for the buckets holding their parameters."""
        self.gather.install_forward_waits(module, self.params_in_order)

    def gather_all_units(self) -> None:
        """Stage 3: gather every unit (each is freed again by its next forward or backward, or at the
        next step); a no-op below stage 3. All ranks."""
        if self.units is not None:
            self.units.gather_all()

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
        if self.units is None:
            self.wait_for_params()
            yield
            return
        self.units.gather_all()
        try:
            yield
            if writeback:
                with torch.no_grad():
                    for bucket in self.plan.buckets:
                        start, end = shard_range(bucket.padded_numel, self.comm.world_size, self.comm.rank)
                        self.flat.shard(bucket).copy_(self.flat.bucket(bucket)[start:end])
                self.state.refresh_master()
        finally:
            self.units.free_all()

    def publish_shards(self) -> None:
        """After this rank's parameter shards were written (a checkpoint load): the full parameters
        follow them (below stage 3 every bucket is all-gathered; at stage 3 every unit is freed, the
        next forward gathers it). All ranks."""
        if self.units is not None:
            self.units.free_all()
            return
        handles = [self.comm.all_gather(self.flat.bucket(b), self.flat.shard(b)) for b in self.plan.buckets]
        for handle in handles:
            self.comm.wait(handle)

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
        self.gather = ParamGather(self.plan, self.flat, self.comm, self.config.overlap_param_gather)

    @torch.no_grad()
    def unshard(self) -> None:
        """Stage 3, after training: the unit hooks removed and every parameter full again, a view of
        flat buffers laid out as at stage 2, all-gathered bucket by bucket from the shards straight into
        them (the full model's memory on every rank, once: no unit is gathered on the way). The engine
        keeps its shards for saving. All ranks; a no-op below stage 3."""
        if self.units is None:
            return
        self.units.free_all()
        self.units.remove_hooks()
        self.units = None
        shards = self.flat
        flat = FlatParams(self.params_in_order, self.plan, self.comm.rank)  # placeholders' NaN, overwritten
        handles = [self.comm.all_gather(flat.bucket(b), shards.shard(b)) for b in self.plan.buckets]
        for handle in handles:
            self.comm.wait(handle)
        self._rebind(flat)

    def refresh_master(self) -> None:
        """Re-read separate (fp32) master shards from the parameters, after parameters were loaded."""
        self.wait_for_params()
        self.state.refresh_master()

    def broadcast(self, tensors: list[Tensor], src: int = 0) -> None:
        """Overwrite ``tensors`` (e.g. module buffers) with rank ``src``'s values. All ranks."""
        self.comm.broadcast_tensors(tensors, src=src)

    def remove_hooks(self) -> None:
        """Complete the gathers in flight and remove every hook the engine installed (forward waits,
        gradient hooks). The state stays: saving after it still works."""
        self.gather.remove_hooks()
        self.reducer.remove_hooks()
        if self.units is not None:
            self.units.remove_hooks()

    # ---- gradients --------------------------------------------------------------------------

    def no_sync(self) -> AbstractContextManager[None]:
        """Backward passes inside accumulate locally and send nothing."""
        return self.reducer.no_sync()

    @property
    def syncing(self) -> bool:
        """False inside :meth:`no_sync`."""
        return self.reducer.syncing

    @property
    def accumulating(self) -> bool:
        """Gradients were accumulated or sent since the last optimizer step (an accumulation window
        or a step in progress)."""
        return not self.reducer.idle

    def finish_grad_sync(self) -> list[bool] | None:
        """Complete this step's gradient communication (idempotent; all ranks). Returns which
        parameters some rank used when unused parameters are tracked, else ``None``."""
        return self.reducer.finalize()

    def zero_grad(self) -> None:
        """Drop this step's gradients (all ranks: it may wait for collectives in flight)."""
        self.reducer.reset()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip by the global gradient norm over all shards; returns the norm before clipping. All ranks."""
        self.finish_grad_sync()
        return grad_math.clip_by_norm(self.comm, self.reducer.grad_shards, max_norm, norm_type)

    def unscale_(self, scale: float | Tensor) -> bool:
        """Divide the shard gradients by a loss scale; True on every rank if any rank has inf/NaN."""
        self.finish_grad_sync()
        found_inf = grad_math.unscale(self.comm, self.reducer.grad_shards, scale)
        if not found_inf:
            self.guard.known_finite()  # every shard was checked: the non-finite guard need not ask
        return found_inf

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every gradient element to ``[-clip_value, clip_value]`` (local: no communication)."""
        self.finish_grad_sync()
        for g in self.reducer.grad_shards:
            g.clamp_(-clip_value, clip_value)

    def grad_norms(self, norm_type: float) -> tuple[list[torch.nn.Parameter], Tensor, list[bool] | None]:
        """Per-parameter gradient norms: the parameters in plan order, ``(num_params,)`` float64 norms,
        and the used mask of :meth:`finish_grad_sync`. All ranks (one all-reduce), after backward."""
        used = self.finish_grad_sync()
        norms = grad_math.param_norms(self.comm, self.plan, self.reducer.grad_shards, norm_type)
        return self.params_in_order, norms, used

    # ---- the step ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        """Collect the gradient rounds, update the owned shards, launch each bucket's all-gather.

        A step with no backward since the last one changes nothing (as torch's AdamW with every
        ``.grad`` ``None``). With ``skip_nonfinite_steps``, a step in which any rank's gradients hold
        inf/NaN changes nothing either, on every rank, and drops the gradients. Must be called on all
        ranks.

        Raises:
            NonFiniteGradientError: the ``skip_nonfinite_steps``-th skipped step in a row (every rank).
        """
        if self.reducer.idle:
            self.reducer.reset()
            return
        step = self.optimizer_steps
        self.optimizer_steps += 1
        self.gather.wait()  # gathers left in flight read the shards this step writes
        used_mask = self.reducer.finalize()
        if self.guard.enabled:
            bad_ranks = self.guard.agree()
            if bad_ranks:
                self.reducer.reset()  # gradients dropped; nothing updated, nothing to gather
                self.guard.skipped(step, bad_ranks)  # raises at the limit, on every rank alike
                return
            self.guard.updated()
        self.state.adopt_external_writes()
        self.state.count_steps(used_mask)
        if self.units is not None:  # stage 3: the next forward gathers each unit from the shards
            self.units.free_all()
            for b in range(len(self.plan.buckets)):
                self.state.update_bucket(b, self.param_groups, used_mask)
            self.reducer.reset()
            return
        for b in self.gather.order():  # each bucket's gather overlaps the next one's update
            self.state.update_bucket(b, self.param_groups, used_mask)
            self.gather.launch(b)
        self.gather.launched()
        self.reducer.reset()

    def group_hyperparameters(self) -> list[dict[str, Any]]:
        """The param groups without their parameters, and with the parameters' plan indices."""
        position = {p: i for i, p in enumerate(self.params_in_order)}
        return [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "param_indices": [position.get(p, -1) for p in g["params"]],
            }
            for g in self.param_groups
        ]

    # ---- figures ----------------------------------------------------------------------------

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for inf/NaN gradients (``skip_nonfinite_steps``) since the engine was
        built; the same on every rank. Steps skipped by fp16 loss scaling are not counted."""
        return self.guard.skipped_steps

    @property
    def comm_stats(self) -> CommStats:
        """Elements and bytes sent and time waited since the counters were last reset."""
        return self.comm.stats

    def time_device_waits(self) -> None:
        """Measure communication waits with CUDA events (NCCL, where a host timer reads ~0); they are
        added to :attr:`comm_stats` by :meth:`flush_timings`."""
        self.comm.time_device_waits = True

    def flush_timings(self) -> None:
        """Add the device-measured waits so far to :attr:`comm_stats` (synchronises the device)."""
        self.comm.flush_timings()

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        """Every rank's ``values`` (e.g. its step time), in rank order. All ranks; one small collective."""
        return self.comm.all_gather_floats(values)

    def min_elements_per_step(self) -> int:
        """The elements a rank must send per step at stage 2 or 3: ``2·Ψ·(N−1)/N`` (padded Ψ), plus at
        stage 3 with ``reshard_after_forward`` the backward's second gather of every unit but the root."""
        numel = 2 * sum(b.padded_numel for b in self.plan.buckets)
        if self.units is not None and self.config.reshard_after_forward:
            numel += sum(b.padded_numel for b in self.plan.buckets if b.unit != 0)
        return numel * (self.comm.world_size - 1) // self.comm.world_size

    def memory(self) -> EngineMemory:
        """What this rank holds (see :class:`EngineMemory`)."""
        grads = self.reducer.grad_shards
        return EngineMemory(
            state_bytes=self.state.nbytes(),
            grad_shard_bytes=sum(g.numel() * g.element_size() for g in grads),
            pool_bytes=self.reducer.pool.nbytes(),
            adopted=self.reducer.adopted,
            allocations_outside_pool=self.reducer.allocations_outside_pool,
        )
