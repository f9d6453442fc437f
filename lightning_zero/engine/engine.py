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

from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

import lightning_zero.comm.signatures as signatures
import lightning_zero.engine.grad_math as grad_math
from lightning_zero.comm.communicator import Comm
from lightning_zero.comm.groups import CommGroups
from lightning_zero.comm.host_clock import timed
from lightning_zero.comm.trace import span
from lightning_zero.config import ZeroConfig
from lightning_zero.engine.averaging import ShardAveraging
from lightning_zero.engine.deferred_init import DeferredInit, materialize, stand_ins
from lightning_zero.engine.figures import EngineFigures
from lightning_zero.engine.nonfinite import NonFiniteGuard
from lightning_zero.engine.param_gather import ParamGather
from lightning_zero.engine.parameters import ParameterAccess, register_sharded
from lightning_zero.engine.plan_check import check_same_plan
from lightning_zero.engine.reducer import GradReducer
from lightning_zero.engine.replan import Parked, carry_state
from lightning_zero.engine.shard_state import ShardState, UpdateRule
from lightning_zero.engine.tensor_parallel import TensorParallel
from lightning_zero.engine.unit_gather import UnitGather
from lightning_zero.layout.buckets import BucketPlan, ParamSpec, plan_buckets
from lightning_zero.layout.flat import FlatParams
from lightning_zero.layout.local import local
from lightning_zero.layout.units import find_units


class ShardEngine(ParameterAccess, EngineFigures, ShardAveraging):
    """Flat buffers, gradient reduction, shard state and parameter gathers for ``param_groups``.

    Args:
        param_groups: the optimizer's list of param-group dicts (shared, not copied).
        config: bucketing and sharding settings.
        comm: the data-parallel group's communicator (flat sharding), or its :class:`CommGroups`
            (hybrid: sharded within groups, replicated across them).
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
        comm: Comm | CommGroups,
        rule: UpdateRule,
        param_order: Iterable[torch.nn.Parameter] | None = None,
        param_names: dict[torch.nn.Parameter, str] | None = None,
        module: torch.nn.Module | None = None,
        deferred_init: DeferredInit | None = None,
        pipeline: Comm | None = None,
    ) -> None:
        if config.stage == 3 and module is None:
            raise ValueError(
                "stage 3 shards the parameters and gathers them around each unit's forward: pass the "
                "model (ShardedAdamW(..., module=model))"
            )
        self.param_groups = param_groups
        self.module = module
        if pipeline is not None and config.sharded_accumulation is None:  # one reduction per step: the
            config = replace(config, sharded_accumulation=False)  # schedule's micro-batches accumulate
        self.config = config
        self.groups = CommGroups.of(comm)
        self.comm = self.groups.shard
        """The shard group's communicator: the buckets are split over its ranks."""
        self.world = self.groups.world
        """All data-parallel ranks (``comm`` itself under flat sharding)."""
        self.pipeline = pipeline
        """Pipeline parallelism: this rank's peers holding the other stages of the model (one rank per
        stage). The gradient norm for clipping, a loss-scale overflow and the non-finite guard's flags
        are agreed across them: every stage clips by the whole model's norm and skips together."""
        self.model_order: tuple[str, ...] | None = None
        """Pipeline parallelism: the whole model's parameter names in its ``named_parameters()`` order
        (this rank holds some of them; :func:`~lightning_zero.layout.stages.whole_order`, set by the
        integration). A checkpoint numbers the joined model's optimizer state in it, as a torch optimizer
        over the unsplit model does."""
        self.rule = rule
        self._param_order = None if param_order is None else list(param_order)
        self._names = param_names or {}
        self._parked = Parked()
        self._owned: tuple[BucketPlan, torch.Tensor] | None = None  # grad_math.owned_params of a plan
        self.guard = NonFiniteGuard(self.world, config.skip_nonfinite_steps)
        self.unsharded = False
        self.module_hooks = []
        self._deferred_init = deferred_init
        self.init_peak_elements = 0
        """Stage 3, deferred initialization: the most full-bucket elements held at once while the units
        were initialized one at a time (:mod:`lightning_zero.engine.deferred_init`)."""
        self.n_averaged = 0
        self.average_device: torch.device | None = None
        self.average_loaded = False
        if signatures.wanted():  # debugging a hang: every collective compared across ranks first
            self.groups.check_signatures()
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
        deferred, self._deferred_init = self._deferred_init, None  # the first build only
        self._check_not_meta(order, deferred)
        names = [self._names.get(p, f"param{i}") for i, p in enumerate(order)]
        self.tensor = TensorParallel.of(order, names, self.world.backend.global_ranks())
        """Tensor parallelism's group when parameters are ``DTensor``s (:mod:`.tensor_parallel`)."""
        specs = [
            ParamSpec(name, tuple(local(p).shape), p.dtype) for name, p in zip(names, order, strict=True)
        ]
        config = self.config
        self.guard.also = None if self.tensor is None else self.tensor.comm
        self.guard.pipeline = self.pipeline
        layout = None
        if config.stage == 3:
            assert self.module is not None  # checked in __init__
            layout = find_units(self.module, order, config.unit_modules, config.min_unit_numel)
        self.plan = plan_buckets(
            specs,
            self.comm.world_size,
            bucket_cap_mb=config.bucket_cap_mb,
            first_bucket_cap_mb=config.first_bucket_cap_mb,
            align_numel=config.align_numel,
            units=None if layout is None else layout.of_param,
        )
        check_same_plan(self.plan, self.world)
        self.params_in_order = order
        if deferred is not None:
            stand_ins(order, deferred.device)
        self.flat = FlatParams(order, self.plan, self.comm.rank, sharded=layout is not None)
        self.gather = ParamGather(self.plan, self.flat, self.comm, config.overlap_param_gather)
        self.units = None
        if layout is not None:
            self.units = UnitGather(
                self.plan,
                self.flat,
                self.comm,
                layout,
                config.reshard_after_forward,
                config.prefetch_units,
                after_write=lambda: self.state.refresh_master(),  # a load through the model's state dict
                quantized=config.gather_dtype == "int8",
            )
            self.units.hold_for_step = self.pipeline is not None  # one gather per unit and step
            assert self.module is not None
            if deferred is not None:
                self.init_peak_elements = materialize(self.module, deferred, self.flat, layout)
            register_sharded(self.module, self)
        self.reducer = GradReducer(order, self.plan, self.flat, self.groups, config, self.guard, self.tensor)
        if self.units is not None:  # a unit's buckets launch once its backward is done
            self.units.reduce_with(self.reducer)
        self.state = ShardState(
            self.plan,
            self.flat,
            self.reducer.grad_shards,
            [in_groups[p] for p in order],
            self.rule,
            self.param_groups,
            getattr(getattr(self, "state", None), "average_on", None),  # a re-plan keeps the average
        )
        self._trainable = self._trainable_signature()

    def _check_not_meta(self, order: list[torch.nn.Parameter], deferred: DeferredInit | None) -> None:
        meta = [self._names.get(p, f"param{i}") for i, p in enumerate(order) if p.is_meta]
        if meta and (deferred is None or self.config.stage != 3):
            raise ValueError(
                f"parameters on the meta device ({', '.join(meta[:3])}{', ...' if len(meta) > 3 else ''}) "
                "have no values to shard: at stage 3 pass deferred_init (the strategies do, for a model "
                "built under init_module(empty_init=True) or in configure_model()); at stages 1 and 2 "
                "initialize the model first (lightning_zero.engine.deferred_init.materialize)"
            )

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

    # ---- gradients --------------------------------------------------------------------------

    def no_sync(self) -> AbstractContextManager[None]:
        """Backward passes inside accumulate locally and send nothing."""
        return self.reducer.no_sync()

    def inputs_only(self) -> AbstractContextManager[None]:
        """A backward inside computes input gradients only: nothing is launched for it."""
        return self.reducer.inputs_only()

    @property
    def syncing(self) -> bool:
        """False inside :meth:`no_sync`."""
        return self.reducer.syncing

    @property
    def accumulating(self) -> bool:
        """Gradients were accumulated or sent since the last optimizer step (an accumulation window
        or a step in progress)."""
        return not self.reducer.idle

    @timed
    def finish_grad_sync(self) -> list[bool] | None:
        """Complete this step's gradient communication (idempotent; all ranks). Returns which
        parameters some rank used when unused parameters are tracked, else ``None``."""
        return self.reducer.finalize()

    @timed
    def zero_grad(self) -> None:
        """Drop this step's gradients (all ranks: it may wait for collectives in flight)."""
        self.reducer.reset()

    @timed
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip by the global gradient norm over all shards; returns the norm before clipping. All ranks."""
        self.finish_grad_sync()
        shards = self.reducer.grad_shards
        if self.tensor is None:
            return grad_math.clip_by_norm(self.comm, shards, max_norm, norm_type, self._across())
        counted = self.tensor.counted(self.plan, self.comm.rank, shards)
        return grad_math.clip_by_norm(self.comm, shards, max_norm, norm_type, self._across(), counted)

    def _across(self) -> list[Comm]:
        """The groups beyond the data-parallel ranks that hold the rest of the model's gradients: the
        tensor-parallel group, then the pipeline's (reduced over in that order)."""
        tensor = None if self.tensor is None else self.tensor.comm
        return [c for c in (tensor, self.pipeline) if c is not None]

    @timed
    def unscale_(self, scale: float | Tensor) -> bool:
        """Divide the shard gradients by a loss scale; True on every rank if any rank has inf/NaN."""
        self.finish_grad_sync()
        found_inf = grad_math.unscale(self.comm, self.reducer.grad_shards, scale, self._across())
        if found_inf:  # the loss scaler skips this step: error feedback's residuals of it go too
            self.reducer.forget_sent()
        else:
            self.guard.known_finite()  # every shard was checked: the non-finite guard need not ask
        return found_inf

    @timed
    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every gradient element to ``[-clip_value, clip_value]`` (local: no communication)."""
        self.finish_grad_sync()
        for g in self.reducer.grad_shards:
            g.clamp_(-clip_value, clip_value)

    @timed
    def grad_norms(self, norm_type: float) -> tuple[list[torch.nn.Parameter], Tensor, list[bool] | None]:
        """Per-parameter gradient norms: the parameters in plan order, ``(num_params,)`` float64 norms,
        and the used mask of :meth:`finish_grad_sync`. All ranks (one all-reduce), after backward."""
        used = self.finish_grad_sync()
        if self._owned is None or self._owned[0] is not self.plan:  # once per plan (re-plans make a new one)
            self._owned = (self.plan, grad_math.owned_params(self.plan, self.comm.rank, self.comm.device))
        shards = self.reducer.grad_shards
        also = None if self.tensor is None else (self.tensor.comm, self.tensor.counted_mask(self.comm.device))
        norms = grad_math.param_norms(self.comm, self.plan, shards, norm_type, self._owned[1], also)
        return self.params_in_order, norms, used

    # ---- the step ---------------------------------------------------------------------------

    @timed
    @torch.no_grad()
    def step(self) -> None:
        """Collect the gradient rounds, update the owned shards, launch each bucket's all-gather.

        A step with no backward since the last one changes nothing (as torch's AdamW with every
        ``.grad`` ``None``). With ``skip_nonfinite_steps``, a step in which any rank's gradients hold
        inf/NaN changes nothing either, on every rank, and drops the gradients. Must be called on all
        ranks.

        Raises:
            NonFiniteGradientError: the ``skip_nonfinite_steps``-th skipped step in a row (every rank).
            RuntimeError: after :func:`~lightning_zero.unshard` made the model plain.
        """
        if self.unsharded:
            raise RuntimeError(
                "lightning_zero.unshard(model) ended stage 3 for this model: its sharded optimizer no "
                "longer steps it (the gradient hooks are gone); build a new optimizer over the plain module"
            )
        if self.units is not None:  # stage 3: between steps only the shards are held, whatever ran
            self.units.forget_step()  # (a forward with no backward, a skipped step, an idle one)
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
                self.reducer.forget_sent()  # error feedback: the skipped step's residuals too
                self.guard.skipped(step, bad_ranks)  # raises at the limit, on every rank alike
                return
            self.guard.updated()
        self.state.adopt_external_writes()
        self.state.count_steps(used_mask)
        if self.units is not None:  # stage 3: the next forward gathers each unit from the shards
            for b in range(len(self.plan.buckets)):
                with span(f"bucket {b}: update", self.flat.device):
                    self.state.update_bucket(b, self.param_groups, used_mask)
            self.reducer.reset()
            return
        for b in self.gather.order():  # each bucket's gather overlaps the next one's update
            with span(f"bucket {b}: update", self.flat.device):
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
