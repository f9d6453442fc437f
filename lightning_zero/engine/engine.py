"""``ShardEngine``: the buffers, hooks, collectives and shard state behind one sharded optimizer.

One engine per set of trainable parameters. It owns:
  * ``plan`` (:mod:`lightning_zero.layout.buckets`): which parameter lives where, identical on every rank;
  * ``flat`` (:mod:`lightning_zero.layout.flat`): the flat buffers the parameters are views of;
  * ``reducer`` (:mod:`lightning_zero.engine.reducer`): the gradient hooks and the per-bucket reduce-scatter
    (stage 2) or all-reduce (stage 1), into the gradient shards;
  * ``shards`` (:mod:`lightning_zero.engine.shard_state`): master weights and Adam moments of the owned
    pieces, and the Adam(W) update on them;
  * ``gather`` (:mod:`lightning_zero.engine.param_gather`): the per-bucket parameter all-gather, optionally
    left in flight into the next forward;
  * ``comm`` (:mod:`lightning_zero.comm.communicator`, the only caller of ``torch.distributed``).

It reads the param-group dicts it is given (the optimizer's own list, shared, so a group added with
``add_param_group`` or an LR a scheduler writes is seen at the next step) and never holds a reference
to the optimizer: readers of the sharded state (:mod:`lightning_zero.optim.full_state`,
:mod:`lightning_zero.checkpoint.format`, :mod:`lightning_zero.checkpoint.reshard`,
:mod:`lightning_zero.integrations.trainer.grad_norm`)
take the engine. :class:`~lightning_zero.ShardedAdamW` is the optimizer protocol on top of it.

Communication per step (``step``): what the reducer launched during backward is collected, each
bucket's owned shard is updated and its all-gather launched at once (the next bucket's update
overlaps it). Clipping and loss-scale checks add one small all-reduce each.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from lightning_zero.comm.communicator import Comm
from lightning_zero.config import ZeroConfig
from lightning_zero.engine.param_gather import ParamGather
from lightning_zero.engine.plan_check import check_same_plan
from lightning_zero.engine.reducer import GradReducer
from lightning_zero.engine.replan import Parked, carry_state
from lightning_zero.engine.shard_state import ShardState
from lightning_zero.layout.buckets import ParamSpec, plan_buckets
from lightning_zero.layout.flat import FlatParams


class ShardEngine:
    """Flat buffers, gradient reduction, shard state and parameter gathers for ``param_groups``.

    Args:
        param_groups: the optimizer's list of param-group dicts (shared, not copied).
        config: bucketing and sharding settings.
        comm: the data-parallel group's communicator.
        param_order: the parameters in registration order (buckets follow its reverse); ``None``:
            the order of the groups.
        param_names: names for plans, errors and checkpoints.

    Raises:
        ValueError: no trainable parameter.
        PlanMismatchError: the ranks do not build the same bucket plan (checked at construction).
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        config: ZeroConfig,
        comm: Comm,
        param_order: Iterable[torch.nn.Parameter] | None = None,
        param_names: dict[torch.nn.Parameter, str] | None = None,
    ) -> None:
        self.param_groups = param_groups
        self.config = config
        self.comm = comm
        self._param_order = None if param_order is None else list(param_order)
        self._names = param_names or {}
        self._parked = Parked()
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
        self.plan = plan_buckets(
            specs, self.comm.world_size, config.bucket_cap_mb, config.first_bucket_cap_mb, config.align_numel
        )
        check_same_plan(self.plan, self.comm)
        self.params_in_order = order
        self.flat = FlatParams(order, self.plan, self.comm.rank)
        self.gather = ParamGather(self.plan, self.flat, self.comm, config.overlap_param_gather)
        self.reducer = GradReducer(order, self.plan, self.flat, self.comm, config)
        self.shards = ShardState(
            self.plan,
            self.flat,
            self.reducer.grad_shards,
            [in_groups[p] for p in order],
            amsgrad=any(g["amsgrad"] for g in self.param_groups),
        )
        self._trainable = self._trainable_signature()

    def _trainable_signature(self) -> tuple[tuple[bool, ...], ...]:
        return tuple(tuple(p.requires_grad for p in g["params"]) for g in self.param_groups)

    def trainable_changed(self) -> bool:
        """Whether a param group was added or a ``requires_grad`` flag flipped since the plan was built."""
        return self._trainable_signature() != self._trainable

    def replan(
        self,
        param_order: Iterable[torch.nn.Parameter] | None = None,
        param_names: dict[torch.nn.Parameter, str] | None = None,
    ) -> None:
        """New buckets, flat buffers and shards for the parameters trainable now, each parameter's Adam
        state carried over (a frozen one's parked). Call on all ranks between optimizer steps."""
        if param_order is not None:
            self._param_order = list(param_order)
        if param_names is not None:
            self._names = param_names
        self.reducer.reset()
        self.reducer.remove_hooks()
        module = self.gather.module
        self.gather.remove_hooks()  # waits: the new flat buffers copy complete parameters
        old = (self.plan, self.params_in_order, self.shards)
        self._build()
        carry_state(self.comm, old, (self.plan, self.params_in_order, self.shards), self._parked)
        if module is not None:
            self.gather.install_forward_waits(module, self.params_in_order)
        kept = set(self.params_in_order)
        for param in old[1]:
            if param not in kept:  # its own storage: the old flat buffer is freed with the old plan
                param.data = param.data.clone()

    def install_forward_waits(self, module: torch.nn.Module) -> None:
        """``module``'s submodules wait in their forward for the buckets holding their parameters."""
        self.gather.install_forward_waits(module, self.params_in_order)

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

    def no_sync(self) -> AbstractContextManager[None]:
        """Backward passes inside accumulate locally and send nothing."""
        return self.reducer.no_sync()

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

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip by the global gradient norm over all shards; returns the norm before clipping. All ranks."""
        self.reducer.finalize()
        grads = self.reducer.grad_shards
        if math.isinf(norm_type):
            local = torch.stack([g.abs().max() for g in grads]).max().to(self.comm.device, torch.float64)
            self.comm.wait(self.comm.all_reduce(local, op="max", control=True))
            total = local
        else:
            local = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float64) for g in grads])
            local = local.pow(norm_type).sum().to(self.comm.device)
            self.comm.wait(self.comm.all_reduce(local, control=True))
            total = local.pow(1.0 / norm_type)
        total = total.to(grads[0].device)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    @torch.no_grad()
    def unscale_(self, scale: float | Tensor) -> bool:
        """Divide the shard gradients by a loss scale; True on every rank if any rank has inf/NaN."""
        self.reducer.finalize()
        grads = self.reducer.grad_shards
        inv_scale = 1.0 / float(scale)
        for g in grads:
            g.mul_(inv_scale)
        local = (
            torch.stack([~torch.isfinite(g).all() for g in grads]).any().to(self.comm.device, torch.float32)
        )
        self.comm.wait(self.comm.all_reduce(local.reshape(1), op="max", control=True))
        return bool(local.item())

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every gradient element to ``[-clip_value, clip_value]`` (local: no communication)."""
        self.reducer.finalize()
        for g in self.reducer.grad_shards:
            g.clamp_(-clip_value, clip_value)

    @torch.no_grad()
    def step(self) -> None:
        """Collect the gradient rounds, update the owned shards, launch each bucket's all-gather.

        A step with no backward since the last one changes nothing (as torch's AdamW with every
        ``.grad`` ``None``). Must be called on all ranks.
        """
        if self.reducer.idle:
            self.reducer.reset()
            return
        self.gather.wait()  # gathers left in flight read the shards this step writes
        used_mask = self.reducer.finalize()
        self.shards.adopt_external_writes()
        self.shards.count_steps(used_mask)
        for b in self.gather.order():  # each bucket's gather overlaps the next one's update
            self.shards.update_bucket(b, self.param_groups, used_mask)
            self.gather.launch(b)
        self.gather.launched()
        self.reducer.reset()
