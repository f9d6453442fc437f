"""``Fabric(strategy="zero")``: the sharded engine for Lightning Fabric loops.

``ZeroFabricStrategy`` is Fabric's ``DDPStrategy`` (process group, launchers, ``num_nodes``,
distributed samplers, SLURM and torchrun environments) without the ``DistributedDataParallel``
wrapper, exactly as :class:`~lightning_zero.ZeroStrategy` is for the Trainer:

  * ``fabric.setup(model, torch.optim.AdamW(...))`` returns the sharded twin of the optimizer
    (:mod:`lightning_zero.optim.twin`): same param-group dicts, so LR schedulers built before or after
    ``setup`` drive it; parameters become views of flat buffers and rank 0's values are broadcast,
    as DDP does at construction;
  * ``fabric.backward(loss)`` launches each bucket's reduce-scatter (stage 2) or all-reduce
    (stage 1) from the gradient hooks; ``fabric.no_backward_sync(model, enabled=True)`` makes a
    micro-batch accumulate locally and send nothing;
  * ``fabric.clip_gradients`` clips by the global norm (or value) over all ranks' shards; with a
    ``GradScaler`` (``16-mixed``) the shards are unscaled, overflow is agreed across ranks and the
    step is skipped on every rank or none (the precision plugin's class gets a shard-aware mixin);
  * ``skip_nonfinite_steps``: ``optimizer.step()`` skips a step with inf/NaN gradients on every
    rank (``optimizer.skipped_steps``), and ``fabric.clip_gradients`` leaves a non-finite norm to
    that skip instead of raising;
  * buffers are broadcast from rank 0 before exactly the forwards where DDP's
    ``broadcast_buffers=True`` does it; a changed trainable set (``requires_grad``,
    ``add_param_group``) is re-planned before the next forward with gradients;
  * ``overlap_param_gather``: the all-gathers of ``optimizer.step()`` stay in flight; each module's
    forward waits for the buckets holding its parameters, and so do the model's ``state_dict()``,
    ``fabric.save`` and ``fabric.load``. Other reads of parameters between steps (``p.data``,
    ``named_parameters()`` in user code) must call ``fabric.strategy.wait_for_params()`` first;
  * checkpoints: :mod:`lightning_zero.integrations.fabric.checkpointing` (the Trainer strategy's
    directory format).

Refused with a clear error: more than one optimizer, or one set up apart from its model
(``fabric.setup_optimizers``); optimizers other than Adam/AdamW; ``async_checkpoint`` and
``log_comm_stats``, which need the Trainer's end-of-fit and logging hooks (Fabric has neither).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from typing_extensions import Unpack, override

from lightning_zero.comm.watchdog import let_errors_reach_python
from lightning_zero.engine.deferred_init import is_deferred
from lightning_zero.integrations.arguments import (
    FabricArguments,
    check_sharded_io,
    split_arguments,
    takes_zero_arguments,
)
from lightning_zero.integrations.fabric.checkpointing import FabricCheckpointing
from lightning_zero.integrations.frontend import ZeroAccessors, ZeroFrontEnd, sharded_of
from lightning_zero.integrations.loss_scale import update_scale, with_mixin
from lightning_zero.integrations.names import register_names


class ZeroFabricStrategy(ZeroAccessors, FabricCheckpointing, DDPStrategy):
    """ZeRO stage 1, 2 or 3 data parallelism with a sharded Adam/AdamW, for ``lightning.fabric.Fabric``.

    At stage 3 (``"zero3"``) each rank holds only its shard of the model set up with the optimizer: a
    unit's parameters are gathered for its forward and backward, the model's forward gathers the root,
    ``model.state_dict()``/``load_state_dict()`` gather one unit at a time (every rank calls them), and
    ``lightning_zero.unshard(model)`` makes it a plain module again. With ``skip_nonfinite_steps=K > 0``,
    ``optimizer.skipped_steps`` counts the skipped steps, the error names the step counted from
    ``fabric.setup``, and ``fabric.clip_gradients`` leaves a non-finite norm to the skip instead of
    raising. ``sharded_checkpoint=True``: ``fabric.save`` writes the Trainer strategy's directory format.

    Args:
        **arguments: keyword arguments only, each optional: the same as
            :class:`~lightning_zero.ZeroStrategy` takes (one signature, read from the same fields), with
            Fabric's ``precision`` for the Trainer's ``precision_plugin``. ``log_comm_stats`` and
            ``async_checkpoint`` are refused when ``True`` (they need the Trainer's logging and
            end-of-fit hooks), and so is ``profile_steps`` (it times the Trainer's hooks).

    Raises:
        TypeError: an argument it does not take (named, with the closest valid ones).
        ValueError: an invalid setting (named), ``log_comm_stats``/``async_checkpoint`` set,
            ``profile_steps`` set, or ``pipeline_parallel_size > 1`` (the Trainer's; Fabric drives
            :mod:`lightning_zero.comm.pipeline`).
    """

    strategy_name = "zero"

    @takes_zero_arguments(DDPStrategy)
    def __init__(self, **arguments: Unpack[FabricArguments]) -> None:
        options, lightning = split_arguments(ZeroFabricStrategy.__init__, arguments)  # all checked first
        options.refuse(
            ("log_comm_stats", "async_checkpoint"),
            "the Trainer strategy only: a Fabric loop has no end-of-fit hook to report a background "
            "save's failure, nor a logger of the strategy's own",
        )
        if options.profile_steps is not None:
            raise ValueError(
                f"profile_steps={options.profile_steps!r} is the Trainer strategy's (its step profiler times "
                "Lightning's hooks); in a Fabric loop time the steps yourself with the optimizer's figures "
                "(optimizer.engine.comm_wait_s(), memory()); leave profile_steps=None"
            )
        if options.pipeline_parallel_size > 1:
            raise ValueError(
                f"pipeline_parallel_size={options.pipeline_parallel_size} is the Trainer strategy's (it runs "
                "the schedule inside Lightning's step); a Fabric loop drives the stages itself with "
                "lightning_zero.comm.pipeline (ShardedStage, schedule) and ShardedAdamW(pipeline_group=...): "
                "docs/pipeline.md"
            )
        check_sharded_io(lightning["checkpoint_io"], options.sharded_checkpoint, "ZeroFabricStrategy")
        self._zero = ZeroFrontEnd(options)
        super().__init__(**lightning)
        self._backward_sync_control = _ZeroBackwardSyncControl(self)
        self._module: torch.nn.Module | None = None
        self._hooks: list[Any] = []

    @property
    def sharded_module(self) -> torch.nn.Module | None:
        """The model set up together with the optimizer (the one whose parameters are sharded)."""
        return self._module

    @override
    def setup_environment(self) -> None:
        let_errors_reach_python()  # before Lightning creates the process group (comm/watchdog.py)
        super().setup_environment()
        if self._zero.options.tensor_parallel_size > 1:
            self._zero.build_model_mesh(self.num_processes, self.root_device.type, self._timeout)

    @property
    def device_mesh(self) -> Any:
        """With ``tensor_parallel_size > 1``: the ``(data_parallel, tensor_parallel)`` mesh, after
        ``fabric.launch()``; parallelize the model over ``device_mesh["tensor_parallel"]`` before
        ``fabric.setup`` (as Fabric's ``ModelParallelStrategy``'s ``parallelize_fn`` does). ``None``
        otherwise."""
        return self._zero.model_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The data-parallel ranks split the data; the ranks of a tensor-parallel group get the same."""
        data = self._zero.data_parallel()
        if data is None:
            return super().distributed_sampler_kwargs
        return {"num_replicas": data[0], "rank": data[1]}

    @override
    def setup_module_and_optimizers(
        self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: Any = None
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer], Any]:
        if len(optimizers) != 1:
            raise ValueError(
                f"strategy 'zero' supports exactly one optimizer, fabric.setup received {len(optimizers)}"
            )
        if self._zero.optimizer is not None:
            raise RuntimeError(
                "strategy 'zero' shards one model and its optimizer per Fabric; fabric.setup was "
                "already called with an optimizer"
            )
        check_sharded_io(self.checkpoint_io, self._zero.options.sharded_checkpoint, "ZeroFabricStrategy")
        stage3 = self.zero_config.stage == 3
        deferred = self._zero.deferred_init(
            module, self.root_device
        )  # built under init_module(empty_init=True)
        data = self._zero.data_comm()
        # tensor parallelism: every rank's slices whole (1/T of the model) before stage 3 shards them
        if deferred is not None and (not stage3 or self._zero.model_mesh is not None):
            ZeroFrontEnd.initialize_whole(module, deferred)
            super().module_to_device(module)  # Fabric skipped moving the meta model
            deferred = None
        # stage 3: every rank must hold the same model before it keeps only its shard of rank 0's
        ZeroFrontEnd.sync_module_states(module, stage3, deferred is None, data)
        mesh = self._zero.device_mesh(self.num_processes, self.root_device.type, self._timeout)
        schedulers = [] if scheduler is None else [scheduler]
        sharded = self._zero.shard(optimizers[0], module, schedulers, mesh, deferred)
        if deferred is not None:  # initialized unit by unit: the buffers and frozen parameters, rank 0's
            super().module_to_device(module)  # the rest (a metric): Fabric skipped moving the meta model
            ZeroFrontEnd.sync_module_states(module, comm=data)
        self._module = module
        self._hooks = [
            module.register_forward_pre_hook(self._before_forward),
            module.register_forward_hook(self._after_forward),
        ]
        if self.zero_config.overlap_param_gather:
            sharded.install_forward_waits(module)
            # model.state_dict() (what checkpoints, EMA copies, exports read) waits for the gathers
            self._hooks.append(module.register_state_dict_pre_hook(lambda *_: sharded.wait_for_params()))
        if self._zero.engine is not None:  # lightning_zero.unshard(module) leaves a plain module
            self._zero.engine.remove_at_unshard(self._hooks)
        self.precision.__class__ = fabric_shard_aware(type(self.precision))
        return module, [sharded], scheduler

    @override
    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:  # type: ignore[override]  # no DDP wrapper
        """The module itself (no wrapper), with rank 0's parameters and buffers on every rank. Set up
        without the optimizer (an evaluation or teacher model) it stays a replica: its gradients, if
        any, are not synchronized (only the model set up with the optimizer is sharded). One built on
        the meta device is initialized whole (:mod:`lightning_zero.engine.deferred_init`)."""
        deferred = self._zero.deferred_init(module, self.root_device)
        if deferred is not None:
            ZeroFrontEnd.initialize_whole(module, deferred)
            super().module_to_device(module)  # Fabric skipped moving the meta model
        ZeroFrontEnd.sync_module_states(module, comm=self._zero.data_comm())
        return module

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)`` builds the model on the meta device, at every stage;
        ``fabric.setup`` initializes it (stage 3: one unit at a time, each rank keeping its shards;
        :mod:`lightning_zero.engine.deferred_init`). Otherwise as ``DDPStrategy`` (on the device)."""
        if not empty_init:
            return super().module_init_context(empty_init)
        stack = ExitStack()
        stack.enter_context(self._zero.on_meta_device(self.root_device))
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_to_device(self, module: torch.nn.Module) -> None:
        if not is_deferred(module):  # a model on the meta device gets its values in setup, on the device
            super().module_to_device(module)

    @override
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        raise RuntimeError(
            "strategy 'zero' builds its sharded optimizer from the model's parameters: set both up "
            "together with `model, optimizer = fabric.setup(model, optimizer)`"
        )

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self._zero.replan_if_changed(module, where="before this forward")
        self._zero.before_forward(module)

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """DDP's buffer rule: the next forward broadcasts after one run with gradients and sync
        (not after a ``no_backward_sync`` micro-batch or a forward under ``no_grad``)."""
        self._zero.after_forward()

    @override
    def clip_gradients_norm(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip by the global norm over all ranks' gradient shards; returns the norm before clipping."""
        sharded = sharded_of(optimizer)
        self.precision.unscale_gradients(optimizer)
        total = sharded.clip_grad_norm_(float(max_norm), float(norm_type))
        skips = self.zero_config.skip_nonfinite_steps > 0  # the step will be skipped: no need to raise
        if error_if_nonfinite and not skips and not bool(torch.isfinite(total)):  # the same total everywhere
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the gradients by "
                "the non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        return total

    @override
    def clip_gradients_value(
        self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, clip_val: float | int
    ) -> None:
        self.precision.unscale_gradients(optimizer)
        sharded_of(optimizer).clip_grad_value_(float(clip_val))

    @override
    def teardown(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._zero.teardown()  # waits for gathers still in flight
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(cls, strategy_registry)


class _ZeroBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model, enabled=True)``: backward passes accumulate locally."""

    def __init__(self, strategy: ZeroFabricStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> AbstractContextManager:
        sharded = self._strategy.sharded_optimizer
        if not enabled or sharded is None:
            return nullcontext()
        if module is not self._strategy.sharded_module:
            return nullcontext()  # a replica set up without the optimizer synchronizes nothing anyway
        return sharded.no_sync()


class _ShardAwareFabricPrecision:
    """Mixed into Fabric's precision plugin: loss scaling on sharded gradients.

    With a ``GradScaler`` (Fabric's ``MixedPrecision`` with ``16-mixed``): ``unscale_gradients``
    divides the shards by the scale and agrees on overflow across ranks (once per step, as torch's
    scaler allows); ``optimizer_step`` steps only if no rank overflowed and updates the scale by
    torch's rule. Without a scaler, the plugin's own behaviour.
    """

    scaler: torch.amp.GradScaler | None
    _zero_found_inf: bool | None = None

    def unscale_gradients(self, optimizer: Any) -> None:
        scaler = getattr(self, "scaler", None)
        if scaler is None:
            return
        if self._zero_found_inf is not None:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        self._zero_found_inf = sharded_of(optimizer).unscale_(scaler.get_scale())

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        scaler = getattr(self, "scaler", None)
        if scaler is None:
            return super().optimizer_step(optimizer, **kwargs)  # type: ignore[misc]
        if self._zero_found_inf is None:
            self.unscale_gradients(optimizer)
        found_inf = bool(self._zero_found_inf)
        self._zero_found_inf = None
        output = None if found_inf else sharded_of(optimizer).step(**kwargs)
        update_scale(scaler, found_inf)
        return output


def fabric_shard_aware(precision_cls: type[Precision]) -> type[Precision]:
    """Fabric's ``precision_cls`` with shard-aware loss scaling (one subclass per plugin class)."""
    return with_mixin(_ShardAwareFabricPrecision, precision_cls)


ZeroFabricStrategy.register_strategies(STRATEGY_REGISTRY)  # Fabric(strategy="zero"), "zero1", "zero2"
