"""The peers of ``step_time.py`` on CPU (FSDP1, DeepSpeed), and the count of what they send.

The peers on CPU need workarounds, each a small subclass here: Lightning's ``FSDPStrategy`` and
``DeepSpeedStrategy`` refuse a CPU accelerator (the first only for its own class, so a subclass is
enough; the second in ``setup_environment``). FSDP1 then needs ``device_id=torch.device("cpu")`` at
the wrap (Lightning passes ``root_device.index``, None on CPU). DeepSpeed needs ``DS_ACCELERATOR=cpu``
(set for every launch) and ``device_rank=local_rank`` (Lightning passes the same None); it then
runs on gloo. Its stage 3 keeps parameters under 1e5 elements whole on every rank (its
``stage3_param_persistence_threshold``: layer norms, biases, the position table) and uses Lightning's
bucket sizes (2e8 elements). Its first launch on a machine JIT-compiles DeepSpeed's CPU
``shm_comm`` op (g++ and ninja; about 4 minutes here, cached in ``~/.cache/torch_extensions``).
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy
from torch import nn
from torch.distributed import distributed_c10d
from typing_extensions import override


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDP (FSDP1) on CPU: the accelerator check refuses only ``FSDPStrategy`` itself, and
    torch wants ``device_id=torch.device("cpu")`` where Lightning passes ``root_device.index`` (None)."""

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeed on CPU (needs ``DS_ACCELERATOR=cpu`` before deepspeed is imported): past
    the CUDA-only check and the check that device indices equal local ranks (CPU devices have none),
    with ``device_rank=local_rank`` where Lightning passes ``root_device.index``."""

    @override
    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # DeepSpeedStrategy's own only adds the CUDA check

    @override
    def setup_distributed(self) -> None:
        reset_seed()  # DeepSpeedStrategy's own, less the device-index check
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @override
    def _setup_model_and_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any = None
    ) -> tuple[Any, torch.optim.Optimizer]:
        import deepspeed

        engine, optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, optimizer


RING_NUMEL = {
    "all_reduce": lambda a, n: 2 * a["tensor"].numel(),
    "broadcast": lambda a, n: a["tensor"].numel(),
    "all_gather_single": lambda a, n: a["output_tensor"].numel(),
    "all_gather": lambda a, n: n * a["tensor"].numel(),  # FSDP1 on CPU gathers into a list
    "reduce_scatter_single": lambda a, n: a["input"].numel(),
    "reduce_scatter": lambda a, n: n * a["output"].numel(),
}
"""Collective: (bound arguments, world size) -> M, where one rank sends M(N−1)/N elements in a ring.
torch 2.13's ``all_gather_into_tensor``, ``_all_gather_base``, ``reduce_scatter_tensor`` and
``_reduce_scatter_base`` call the ``_single`` ones through ``distributed_c10d``'s globals."""


def count_collectives(counted: dict[str, int]) -> None:
    """Adds a ring's share of every torch.distributed collective this process calls from now on to
    ``counted["elements"]`` (the world size taken as the group's: the peers here use one group)."""
    for fn_name, ring_numel in RING_NUMEL.items():
        counting = _counting(getattr(distributed_c10d, fn_name), ring_numel, counted)
        setattr(distributed_c10d, fn_name, counting)  # what the deprecated aliases call
        setattr(dist, fn_name, counting)  # what FSDP, FSDP2 and DeepSpeed call


def _counting(original: Any, ring_numel: Any, counted: dict[str, int]) -> Any:
    signature = inspect.signature(original)

    def counting(*args: Any, **kwargs: Any) -> Any:
        n = dist.get_world_size()
        counted["elements"] += ring_numel(signature.bind(*args, **kwargs).arguments, n) * (n - 1) // n
        return original(*args, **kwargs)

    return counting
