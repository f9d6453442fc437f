"""``ZeroStrategy``: Lightning's Trainer hooks around the shared front end
(:mod:`lightning_zero.integrations.frontend`) and :class:`~lightning_zero.ShardedAdamW`. No math here.

It is ``DDPStrategy`` (process group, launchers, ``num_nodes``, distributed samplers, SLURM and
torchrun environments) minus the ``DistributedDataParallel`` wrapper: the model stays the
LightningModule, parameters become views into flat buffers, and the optimizer returned by
``configure_optimizers`` is replaced by its sharded twin, which owns the gradient hooks.

Lightning integration points:
  * accumulation: ``block_backward_sync`` -> ``ShardedAdamW.no_sync`` (nothing sent);
  * clipping and ``16-mixed`` loss scaling: the precision plugin is given shard-aware
    ``clip_grad_by_norm/value`` (global norm) and an ``optimizer_step`` that unscales the shards and
    agrees on overflow across ranks;
  * LR schedulers keep driving the sharded twin: it takes over the optimizer's param-group dicts,
    and every (nested) scheduler is re-pointed at it;
  * buffers are broadcast from rank 0 before exactly the forwards where DDP's
    ``broadcast_buffers=True`` does it; ``sync_batchnorm`` is applied as DDP does;
  * a changed trainable set (``requires_grad``, ``add_param_group``) is re-planned before the next
    training step;
  * ``skip_nonfinite_steps``: the engine skips a step with inf/NaN gradients on every rank;
    :class:`SkippedStepsMonitor` logs ``zero/skipped_steps``, and the engine's step count follows
    ``trainer.global_step`` (so an error names Lightning's step, also after a resume);
  * ``overlap_param_gather``: forward waits on the modules and :class:`ParamReadBarrier` first
    among the callbacks (:mod:`lightning_zero.integrations.trainer.param_barrier`);
  * the callbacks added at setup: :mod:`lightning_zero.integrations.trainer.callbacks`; what runs
    around each step function: :mod:`lightning_zero.integrations.trainer.step_functions`;
  * checkpoints: :mod:`lightning_zero.integrations.trainer.checkpointing` (sharded directories, any
    world size,
    asynchronous saves; validate/test/predict read whole parameters, or fill a stage-3 model's
    shards);
  * stage 3: the root unit is gathered before each step function; after ``fit`` the model stays
    sharded (its forward and its ``state_dict()`` gather units on request; ``lightning_zero.unshard``
    makes it plain), and a later ``fit`` on it gathers it once before sharding it anew.

Refused with a clear error: more than one optimizer, optimizers other than Adam/AdamW,
``async_checkpoint`` without ``sharded_checkpoint``, a trainable-set change inside an accumulation
window, ``SyncBatchNorm`` on CPU (DDP's own error).
"""

from __future__ import annotations

import warnings
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import Unpack, override

from lightning_zero.checkpoint.async_save import AsyncCheckpointWriter
from lightning_zero.comm import collective_failures
from lightning_zero.comm.watchdog import let_errors_reach_python
from lightning_zero.engine.deferred_init import DeferredInit, is_deferred, with_eager_states
from lightning_zero.engine.parameters import sharded_engine
from lightning_zero.integrations.arguments import (
    TrainerArguments,
    check_sharded_io,
    check_sharded_path,
    split_arguments,
    takes_zero_arguments,
)
from lightning_zero.integrations.frontend import ZeroAccessors, ZeroFrontEnd
from lightning_zero.integrations.names import register_names
from lightning_zero.integrations.trainer.callbacks import install_callbacks
from lightning_zero.integrations.trainer.load import install as install_loader
from lightning_zero.integrations.trainer.precision import shard_aware
from lightning_zero.integrations.trainer.step_functions import StepFunctions
from lightning_zero.integrations.trainer.weight_averaging import (
    replace_weight_averaging,
    restore_weight_averaging,
)


class ZeroStrategy(ZeroAccessors, StepFunctions):
    """ZeRO stage 1, 2 or 3 data parallelism with a sharded Adam/AdamW.

    At stage 3 (``"zero3"``) every rank holds only its shard of the parameters during ``fit``;
    callbacks and LightningModule hooks run as under ``"ddp"``, and one that reads or writes a parameter
    outside its unit's forward and backward fails at that op, naming the parameter and
    ``lightning_zero.gathered(module)``, which gives full parameters for a block of code. After ``fit``
    the model stays sharded: its forward, ``state_dict()`` and ``load_state_dict()`` gather one unit at
    a time on every rank, and ``lightning_zero.unshard(model)`` makes it a plain module. A model built
    under ``trainer.init_module(empty_init=True)`` (any stage) or in ``configure_model()`` (stage 3) is
    built on the meta device and initialized at setup, at stage 3 one unit at a time
    (:mod:`lightning_zero.engine.deferred_init`). With ``skip_nonfinite_steps=K > 0``,
    ``zero/skipped_steps`` is logged and the error names ``trainer.global_step``.

    Args:
        **arguments: keyword arguments only, each optional: every field of
            :class:`~lightning_zero.ZeroConfig` and of
            :class:`~lightning_zero.integrations.options.ZeroOptions` (their docstrings say what each
            does), and Lightning ``DDPStrategy``'s ``accelerator``, ``parallel_devices``,
            ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``, ``process_group_backend``,
            ``timeout`` and ``start_method``
            (:data:`~lightning_zero.integrations.arguments.LIGHTNING_ARGUMENTS`), with their defaults:
            ``inspect.signature(ZeroStrategy)`` and ``docs/reference.md`` list them all.

    Raises:
        TypeError: an argument it does not take (named, with the closest valid ones).
        ValueError: a bad value (named, with what would be valid), or ``async_checkpoint=True`` with
            ``sharded_checkpoint=False`` (the single gathered file is written by Lightning's own,
            blocking, checkpoint IO).
    """

    strategy_name = "zero"

    @takes_zero_arguments(DDPStrategy)
    def __init__(self, **arguments: Unpack[TrainerArguments]) -> None:
        options, lightning = split_arguments(ZeroStrategy.__init__, arguments)  # every argument checked first
        check_sharded_io(lightning["checkpoint_io"], options.sharded_checkpoint, "ZeroStrategy")
        self._zero = ZeroFrontEnd(options)
        super().__init__(**lightning)
        self._async_writer = AsyncCheckpointWriter(self._timeout) if options.async_checkpoint else None
        self._fit_running = False  # between setup and teardown of a fit: a later wait reports failures
        self._unwinding = False  # on_exception was called: teardown must not wait for the other ranks
        self._pending_load = None

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The data-parallel ranks split the data; under tensor parallelism the ranks of a tensor-parallel
        group get the same batches."""
        data = self._zero.data_parallel()
        if data is None:
            return super().distributed_sampler_kwargs
        return {"num_replicas": data[0], "rank": data[1]}

    @property
    def timeout(self) -> timedelta | None:
        """How long a collective may wait for a peer: the training process group's timeout, which
        every group the strategy creates uses too (the background checkpoint writer's)."""
        return self._timeout

    @override
    def setup_environment(self) -> None:
        let_errors_reach_python()  # before Lightning creates the process group (comm/watchdog.py)
        super().setup_environment()
        module = self.lightning_module
        options = self._zero.options
        if (
            options.tensor_parallel_size > 1 or options.pipeline_parallel_size > 1
        ):  # configure_model reads self.device_mesh, as
            mesh = self._zero.build_model_mesh(self.num_processes, self.root_device.type, self._timeout)
            if module is not None:  # under ModelParallelStrategy
                module._device_mesh = mesh
        trainer = None if module is None else module._trainer
        if trainer is not None:  # before any callback's setup: WeightAveraging's deep copy never happens
            replace_weight_averaging(
                trainer.callbacks,  # type: ignore[attr-defined]  # set by Lightning
                lambda: self._zero.engine if self._fit_running else None,
                self._zero.writes_shards,
            )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        left_sharded = sharded_engine(self.lightning_module)
        if fitting and left_sharded is not None:  # a stage-3 fit before: full parameters to start from
            rank_zero_info("lightning-zero: gathering the model a previous stage-3 fit left sharded")
            left_sharded.unshard()
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)  # sync_batchnorm=True, as DDPStrategy does
        stage3 = self.zero_config.stage == 3
        deferred = self._zero.deferred_init(self.model, self.root_device)  # a model on the meta device
        if self._zero.options.pipeline_parallel_size > 1:  # before anything is materialized or sharded
            if deferred is not None:  # the other stages' draws, so that this stage's equal a whole build
                deferred = with_eager_states(self.model, deferred)
            self._split_pipeline(trainer, fitting)
        data = self._zero.data_comm()
        self.precision_plugin.convert_module(self.model)
        # tensor parallelism: every rank's slices whole (1/T of the model) before stage 3 shards them
        whole = not (fitting and stage3) or self._zero.model_mesh is not None
        if deferred is not None and whole:
            ZeroFrontEnd.initialize_whole(self.model, deferred)
            deferred = None
        if deferred is None:
            self.model_to_device()
        if fitting and self.root_device.type == "cpu":
            if any(isinstance(m, torch.nn.SyncBatchNorm) for m in self.model.modules()):
                raise ValueError("SyncBatchNorm layers only work with GPU modules")  # torch DDP's own refusal
        self._fit_running, self._unwinding = fitting, False
        self._check_checkpoint_targets(trainer)
        if fitting:
            self.setup_optimizers(trainer)
            if stage3:  # rank 0's full parameters, before each rank keeps only its shard of them
                ZeroFrontEnd.sync_module_states(self.model, True, deferred is None, data)
            self._shard_optimizer(deferred)  # compares bucket plans first: a mismatch is an error, not a hang
            if deferred is not None:  # the rest of the module (e.g. a metric's state) to the device
                self.model_to_device()  # the parameters and buffers are there: they stay as they are
            if not stage3 or deferred is not None:  # deferred: the buffers and frozen parameters
                ZeroFrontEnd.sync_module_states(self.model, comm=data)  # identical start, as DDP does
            engine = self._zero.engine
            assert engine is not None and self.lightning_module is not None
            engine.refresh_master()
            if self._pipeline is not None:  # the schedule built now: a bad micro-batch count fails here
                self._pipeline.train(self._zero.optimizer, trainer.accumulate_grad_batches)
            self.precision_plugin.__class__ = shard_aware(type(self.precision_plugin))
            options = self._zero.options
            install_callbacks(
                trainer,
                engine,
                options.log_comm_stats,
                options.profile_steps,
                self._pipeline is not None,
                options.profile_peak_tflops,
                options.tensor_parallel_size > 1,
            )
        else:
            ZeroFrontEnd.sync_module_states(self.model, comm=data)
        self.setup_precision_plugin()

    def _split_pipeline(self, trainer: pl.Trainer, fitting: bool) -> None:
        """This rank's pipeline stages of the LightningModule (once; the other stages' layers are
        dropped from it), after refusing what the pipeline cannot run (:mod:`.pipeline`)."""
        from lightning_zero.integrations.trainer.pipeline import TrainerPipeline

        module, options = self.lightning_module, self._zero.options
        assert module is not None
        size = options.pipeline_parallel_size
        if fitting and not module.automatic_optimization:
            raise ValueError(
                f"pipeline_parallel_size={size} runs forward and backward inside the schedule: manual "
                "optimization (automatic_optimization=False) is not supported with it"
            )
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                f"pipeline_parallel_size={size} does not support precision='16-mixed' (its loss scaler "
                "would have to scale every micro-batch's loss inside the schedule): use 'bf16-mixed' or "
                "'bf16-true'"
            )
        if trainer.checkpoint_callbacks and not options.sharded_checkpoint:
            raise ValueError(
                f"pipeline_parallel_size={size} writes sharded checkpoint directories only (each stage "
                "holds only its layers): sharded_checkpoint=False is not supported with a ModelCheckpoint"
            )
        if self._pipeline is None:
            mesh = self._zero.pipeline_group()
            self._pipeline = TrainerPipeline(
                module,
                mesh,
                self.root_device,
                options.pipeline_schedule,
                options.pipeline_microbatches,
                options.pipeline_virtual_stages,
            )

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Under pipeline parallelism the schedule ran every micro-batch's backward inside the training
        step: the hooks around a backward run (``on_before_backward``, ``on_after_backward``), the
        backward itself does not."""
        if self._pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        assert module is not None
        self._pipeline.after_zero_grad()
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _check_checkpoint_targets(self, trainer: pl.Trainer) -> None:
        """Before any work: a checkpoint IO plugin or a URL that sharded saves could not honour."""
        sharded = self._zero.options.sharded_checkpoint
        check_sharded_io(self.checkpoint_io, sharded, "ZeroStrategy")
        if sharded:
            for callback in trainer.checkpoint_callbacks:
                dirpath = getattr(callback, "dirpath", None)
                if dirpath is not None:
                    check_sharded_path(dirpath)

    def _shard_optimizer(self, deferred: DeferredInit | None = None) -> None:
        if len(self.optimizers) != 1:
            raise ValueError(
                f"strategy 'zero' supports exactly one optimizer, configure_optimizers returned "
                f"{len(self.optimizers)}"
            )
        assert self.lightning_module is not None
        inner = self.optimizers[0]
        inner = getattr(inner, "_optimizer", inner)  # a LightningOptimizer's torch optimizer
        schedulers = [config.scheduler for config in self.lr_scheduler_configs]
        mesh = self._zero.device_mesh(self.num_processes, self.root_device.type, self._timeout)
        self.optimizers = [self._zero.shard(inner, self.lightning_module, schedulers, mesh, deferred)]

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``Trainer.init_module(empty_init=True)`` builds the model on the meta device, at every stage;
        ``fit`` initializes it (stage 3: one unit at a time, each rank keeping its shards;
        :mod:`lightning_zero.engine.deferred_init`). Otherwise as ``DDPStrategy`` (on the device)."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with self._zero.on_meta_device(self.root_device), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Stage 3: what ``configure_model()`` builds lands on the meta device, initialized unit by unit
        at setup; below stage 3 it is built as under ``"ddp"``."""
        if self.zero_config.stage != 3 or self._zero.options.tensor_parallel_size > 1:
            with super().model_sharded_context():
                yield
            return
        with self._zero.on_meta_device(self.root_device):
            yield

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        engine = self._zero.engine
        if engine is None:
            yield None
            return
        with engine.no_sync():
            yield None

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        with collective_failures("Lightning's barrier"):
            super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        with collective_failures(f"Lightning's broadcast from rank {src}"):
            return super().broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        # e.g. ModelCheckpoint's file_exists: a peer that dies there must end this rank as any other
        # collective does, with a CommError (the recipes requeue on it)
        with collective_failures("Lightning's reduce"):
            return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def teardown(self) -> None:
        try:
            self._finish_saves()
        finally:
            self._fit_running = self._unwinding = False
            module = self.lightning_module
            if module is not None and module._trainer is not None:
                restore_weight_averaging(module._trainer.callbacks)  # type: ignore[attr-defined]
            self._zero.teardown()  # waits for gathers still in flight; the optimizer stays for saving
            self._pending_load = None
            if self.model is not None and self._fitting() and self._layer_sync:
                self.model = self._layer_sync.revert(self.model)
            sharded = sharded_engine(self.lightning_module)
            meta = self.lightning_module is not None and is_deferred(self.lightning_module)
            if sharded is None and not meta:
                super().teardown()  # moves the module to the CPU (new storage, when it was on a GPU)
                self._zero.follow_module()
            else:  # stage 3: the model stays sharded where it is (FSDP's teardown does not move it either);
                # a model still on the meta device (its initialization failed) has nothing to move, and
                # moving it would raise over the error that stopped the setup
                if sharded is not None:
                    sharded.finish_training()  # validate/test/predict after fit: the units they gathered
                assert self.cluster_environment is not None and self.accelerator is not None
                self.cluster_environment.teardown()
                self.precision_plugin.teardown()
                self.accelerator.teardown()
                self.checkpoint_io.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(cls, strategy_registry)


# Lightning warns that `trainer.init_module` "cannot fully support" a strategy that overrides
# model_sharded_context (ours does, for stage 3's configure_model()); ours supports both fully
warnings.filterwarnings("ignore", message=r"`trainer.init_module` cannot fully support .* `ZeroStrategy`")

# "zero", "zero1", "zero2" on import (lightning_zero.integrations.autoregister)
ZeroStrategy.register_strategies(StrategyRegistry)
install_loader()  # Model.load_from_checkpoint(DIR) reads sharded checkpoint directories
