"""``ZeroStrategy``: Lightning glue around :class:`~lightning_zero.ShardedAdamW`. No math here.

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
  * ``overlap_param_gather``: forward waits on the modules and :class:`ParamReadBarrier` first
    among the callbacks (:mod:`lightning_zero.integrations.trainer.param_barrier`);
  * checkpoints: :mod:`lightning_zero.integrations.trainer.checkpointing` (sharded directories, any
    world size,
    asynchronous saves; validate/test/predict read whole parameters).

Refused with a clear error: more than one optimizer, optimizers other than Adam/AdamW,
``async_checkpoint`` without ``sharded_checkpoint``, a trainable-set change inside an accumulation
window, ``SyncBatchNorm`` on CPU (DDP's own error).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_zero.checkpoint.async_save import AsyncCheckpointWriter
from lightning_zero.config import ZeroConfig, register_names
from lightning_zero.integrations.trainer.checkpointing import _ShardedCheckpointing
from lightning_zero.integrations.trainer.load import install as install_loader
from lightning_zero.integrations.trainer.monitor import CommStatsMonitor
from lightning_zero.integrations.trainer.param_barrier import ParamReadBarrier
from lightning_zero.integrations.trainer.precision import shard_aware, unwrap_optimizer
from lightning_zero.optim.sharded_adam import ShardedAdamW
from lightning_zero.optim.twin import make_twin, repoint_scheduler


class ZeroStrategy(_ShardedCheckpointing):
    """ZeRO stage 1 or 2 data parallelism with a sharded Adam/AdamW.

    Args:
        stage, bucket_cap_mb, first_bucket_cap_mb, overlap_comm, overlap_param_gather, reduce_dtype,
        find_unused_parameters, align_numel: see :class:`~lightning_zero.ZeroConfig` (validated there).
        log_comm_stats: log per step the seconds spent waiting on communication, their share of the
            step, and the elements sent (``zero/*`` metrics).
        sharded_checkpoint: ``save_checkpoint`` writes a directory, one shard file per rank
            (:mod:`lightning_zero.checkpoint.format`); ``False`` writes one standard Lightning file with the
            optimizer state gathered on rank 0. Both kinds load on any world size.
        async_checkpoint: a sharded save during ``fit`` copies what this rank writes to host memory
            and returns; the files are written and committed in the background
            (:mod:`lightning_zero.checkpoint.async_save`). The next save, a load and the end of ``fit`` wait
            for it and raise its failure on every rank. Saves block as before outside ``fit``, while
            handling an exception, for ``hpc_ckpt_*`` (a requeue follows at once) and for a path a
            ``ModelCheckpoint(save_last="link")`` links to right after the save.
        broadcast_buffers: module buffers (BatchNorm statistics) are broadcast from rank 0 before a
            forward pass exactly when torch DDP's default ``broadcast_buffers=True`` does it.
        Remaining arguments: as ``DDPStrategy``.

    Raises:
        ValueError: ``async_checkpoint=True`` with ``sharded_checkpoint=False`` (the single gathered
            file is written by Lightning's own, blocking, checkpoint IO).
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = 2,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        overlap_comm: bool = True,
        overlap_param_gather: bool = False,
        reduce_dtype: str | None = None,
        find_unused_parameters: bool = False,
        align_numel: int = 1,
        log_comm_stats: bool = False,
        sharded_checkpoint: bool = True,
        async_checkpoint: bool = False,
        broadcast_buffers: bool = True,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
    ) -> None:
        self.zero_config = ZeroConfig(
            stage=stage,
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            overlap_comm=overlap_comm,
            overlap_param_gather=overlap_param_gather,
            reduce_dtype=reduce_dtype,
            find_unused_parameters=find_unused_parameters,
            align_numel=align_numel,
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,  # type: ignore[arg-type]
        )
        if async_checkpoint and not sharded_checkpoint:
            raise ValueError("async_checkpoint=True needs sharded_checkpoint=True (directories of shards)")
        self.log_comm_stats = log_comm_stats
        self.sharded_checkpoint = sharded_checkpoint
        self._async_writer = AsyncCheckpointWriter() if async_checkpoint else None
        if not isinstance(broadcast_buffers, bool):
            raise ValueError(f"broadcast_buffers must be True or False, got {broadcast_buffers!r}")
        self.broadcast_buffers = broadcast_buffers
        self._buffers_need_sync = True
        self._fit_running = False  # between setup and teardown of a fit: a later wait reports failures
        self._unwinding = False  # on_exception was called: teardown must not wait for the other ranks
        self._sharded = None
        self._pending_load = None

    @property
    def sharded_optimizer(self) -> ShardedAdamW | None:
        """The sharded optimizer once ``fit`` has set it up."""
        return self._sharded

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)  # sync_batchnorm=True, as DDPStrategy does
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING and self.root_device.type == "cpu":
            if any(isinstance(m, torch.nn.SyncBatchNorm) for m in self.model.modules()):
                raise ValueError("SyncBatchNorm layers only work with GPU modules")  # torch DDP's own refusal
        self._buffers_need_sync = True  # a fresh DDP wrapper's state
        self._fit_running, self._unwinding = trainer.state.fn == TrainerFn.FITTING, False
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._shard_optimizer()  # compares bucket plans first: a mismatch is an error, not a hang
            _sync_module_states(self.model)  # identical start on every rank, as DDP does (in place)
            assert self._sharded is not None
            self._sharded.shards.refresh_master()
            self.precision_plugin.__class__ = shard_aware(type(self.precision_plugin))
            callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning
            if self.log_comm_stats and not any(isinstance(cb, CommStatsMonitor) for cb in callbacks):
                callbacks.append(CommStatsMonitor())
            if self.zero_config.overlap_param_gather:
                assert self.lightning_module is not None
                self._sharded.install_forward_waits(self.lightning_module)
                callbacks[:] = [cb for cb in callbacks if not isinstance(cb, ParamReadBarrier)]
                callbacks.insert(0, ParamReadBarrier(self._sharded.wait_for_params, trainer))
        else:
            _sync_module_states(self.model)
        self.setup_precision_plugin()

    def _shard_optimizer(self) -> None:
        if len(self.optimizers) != 1:
            raise ValueError(
                f"strategy 'zero' supports exactly one optimizer, configure_optimizers returned "
                f"{len(self.optimizers)}"
            )
        assert self.lightning_module is not None
        module = self.lightning_module
        sharded = make_twin(unwrap_optimizer(self.optimizers[0]), self.zero_config, module.named_parameters())
        for config in self.lr_scheduler_configs:
            repoint_scheduler(config.scheduler, sharded)
        self.optimizers = [sharded]
        self._sharded = sharded

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        if self._sharded is None:
            yield None
            return
        with self._sharded.no_sync():
            yield None

    def wait_for_params(self) -> None:
        """Complete the parameter all-gathers left in flight by ``overlap_param_gather``: needed before
        reading parameters outside a module's forward in code the strategy does not know of."""
        if self._sharded is not None:
            self._sharded.wait_for_params()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._sharded is not None and self._sharded.trainable_changed():
            self._replan()
        self._before_forward()
        if self._sharded is not None:  # training_step, not the root's forward: its pre-hook won't fire
            self._sharded.wait_for_params(root_only=True)
        output = super().training_step(*args, **kwargs)
        self._after_forward()
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._fitting():  # trainer.validate(): DDP's wrapper is not there either
            return super().validation_step(*args, **kwargs)
        self._before_forward()
        output = super().validation_step(*args, **kwargs)
        self._after_forward()
        return output

    def _before_forward(self) -> None:
        """DDP's buffer rule: broadcast rank 0's buffers before a forward that follows a forward
        run with gradients and gradient sync (so not after ``no_sync`` micro-batches, evaluation, or
        in manual optimization, where Lightning turns DDP's sync off around the forward)."""
        if self._buffers_need_sync and self.broadcast_buffers and self._sharded is not None:
            assert self.lightning_module is not None
            self._sharded.comm.broadcast_tensors(list(self.lightning_module.buffers()), src=0)

    def _after_forward(self) -> None:
        assert self.lightning_module is not None
        syncing = self._sharded is not None and self._sharded.reducer.syncing
        self._buffers_need_sync = (
            torch.is_grad_enabled() and syncing and self.lightning_module.automatic_optimization
        )

    def _replan(self) -> None:
        """The trainable set changed (fine-tuning): new buckets and shards, state carried over."""
        assert self._sharded is not None and self.lightning_module is not None
        if not self._sharded.reducer.idle:
            raise RuntimeError(
                "the trainable parameters changed in the middle of a gradient accumulation window "
                f"(global step {self.lightning_module.trainer.global_step}); change requires_grad or "
                "add param groups at an optimizer-step boundary"
            )
        module = self.lightning_module
        self._sharded.replan(module.parameters(), {p: n for n, p in module.named_parameters()})

    @override
    def teardown(self) -> None:
        try:
            self._finish_saves()
        finally:
            self._fit_running = self._unwinding = False
            if self._sharded is not None:
                self._sharded.gather.remove_hooks()  # waits for gathers still in flight
                self._sharded.reducer.remove_hooks()  # the optimizer stays: a save after fit still works
            self._pending_load = None
            if self.model is not None and self._fitting() and self._layer_sync:
                self.model = self._layer_sync.revert(self.model)
            super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(cls, strategy_registry)


# "zero", "zero1", "zero2" on import (lightning_zero.integrations.autoregister)
ZeroStrategy.register_strategies(StrategyRegistry)
install_loader()  # Model.load_from_checkpoint(DIR) reads sharded checkpoint directories
