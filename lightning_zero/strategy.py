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
  * LR schedulers are re-pointed at the sharded optimizer (same param-group dicts);
  * checkpoints: Lightning's ``consolidate_state_dict`` protocol writes a standard single file whose
    optimizer state is ``torch.optim.AdamW``'s; loading it reshards onto any world size.

Refused with a clear error: more than one optimizer, optimizers other than Adam/AdamW.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from functools import cache
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_zero.config import ZeroConfig
from lightning_zero.sharded_adam import ShardedAdamW


class ZeroStrategy(DDPStrategy):
    """ZeRO stage 1 or 2 data parallelism with a sharded Adam/AdamW.

    Args:
        stage, bucket_cap_mb, first_bucket_cap_mb, overlap_comm, reduce_dtype, find_unused_parameters,
        align_numel: see :class:`~lightning_zero.ZeroConfig` (validated there).
        log_comm_stats: log per step the seconds spent waiting on communication, their share of the
            step, and the elements sent (``zero/*`` metrics).
        Remaining arguments: as ``DDPStrategy``.
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = 2,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        overlap_comm: bool = True,
        reduce_dtype: str | None = None,
        find_unused_parameters: bool = False,
        align_numel: int = 1,
        log_comm_stats: bool = False,
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
        self.log_comm_stats = log_comm_stats
        self._sharded: ShardedAdamW | None = None

    @property
    def sharded_optimizer(self) -> ShardedAdamW | None:
        """The sharded optimizer once ``fit`` has set it up."""
        return self._sharded

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._shard_optimizer()  # compares bucket plans first: a mismatch is an error, not a hang
            _sync_module_states(self.model)  # identical start on every rank, as DDP does (in place)
            assert self._sharded is not None
            self._sharded.shards.refresh_master()
            self.precision_plugin.__class__ = _shard_aware(type(self.precision_plugin))
            if self.log_comm_stats:
                from lightning_zero.monitor import CommStatsMonitor

                trainer.callbacks.append(CommStatsMonitor())
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
        sharded = ShardedAdamW.from_optimizer(
            _unwrap(self.optimizers[0]),
            config=self.zero_config,
            param_order=module.parameters(),
            param_names={p: n for n, p in module.named_parameters()},
        )
        for config in self.lr_scheduler_configs:
            config.scheduler.optimizer = sharded  # type: ignore[union-attr]
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

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # parameters are views of flat buffers: clone so each saved tensor owns exactly its data
        assert self.lightning_module is not None
        return {k: v.detach().clone() for k, v in self.lightning_module.state_dict().items()}

    @override
    def teardown(self) -> None:
        if self._sharded is not None:
            self._sharded.reducer.remove_hooks()
            self._sharded = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, stage in (("zero", 2), ("zero1", 1), ("zero2", 2)):
            if name not in strategy_registry:
                strategy_registry.register(
                    name, cls, description=f"ZeRO stage {stage} (lightning-zero)", stage=stage
                )


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class _ShardAwarePrecision:
    """Mixed into the Trainer's precision plugin: clipping and loss scaling on sharded gradients.

    Clipping uses the global norm over all ranks' shards. With a ``GradScaler`` (``16-mixed``) the
    shard gradients are unscaled, overflow is agreed across ranks, the step is skipped on every
    rank or none, and the scale is updated by torch's own rule.
    """

    scaler: torch.amp.GradScaler | None

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        _sharded_of(optimizer).clip_grad_norm_(float(clip_val))

    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        _sharded_of(optimizer).clip_grad_value_(float(clip_val))

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        scaler = getattr(self, "scaler", None)
        if scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)  # type: ignore[misc]
        sharded = _sharded_of(optimizer)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            sharded.zero_grad()  # backward was skipped: nothing to step, keep ranks in lockstep
            return None
        found_inf = sharded.unscale_(scaler.get_scale())
        self._after_closure(model, optimizer)  # type: ignore[attr-defined]  # hooks, then clipping (unscaled)
        if found_inf:
            sharded.zero_grad()
        else:
            sharded.step(**kwargs)
        _update_scale(scaler, found_inf)
        return closure_result


def _update_scale(scaler: torch.amp.GradScaler, found_inf: bool) -> None:
    """torch's dynamic loss-scale rule (backoff on overflow, growth after ``growth_interval`` good steps),
    applied to the scaler's own state so that it checkpoints as usual."""
    scale, tracker = scaler._scale, scaler._growth_tracker  # noqa: SLF001 - no public hook for external inf checks
    if scale is None or tracker is None:
        return
    found = torch.full((1,), float(found_inf), device=scale.device)
    torch._amp_update_scale_(
        scale,
        tracker,
        found,
        scaler.get_growth_factor(),
        scaler.get_backoff_factor(),
        scaler.get_growth_interval(),
    )


def _sharded_of(optimizer: Any) -> ShardedAdamW:
    optimizer = _unwrap(optimizer)
    if not isinstance(optimizer, ShardedAdamW):
        raise TypeError(f"expected the sharded optimizer, got {type(optimizer).__name__}")
    return optimizer


@cache
def _shard_aware(precision_cls: type[Precision]) -> type[Precision]:
    """``precision_cls`` with shard-aware clipping and loss scaling (one subclass per plugin class)."""
    if issubclass(precision_cls, _ShardAwarePrecision):
        return precision_cls
    return type(f"Zero{precision_cls.__name__}", (_ShardAwarePrecision, precision_cls), {})
