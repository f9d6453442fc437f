"""Adam/AdamW on this rank's shard of every bucket, then an all-gather of the updated parameters.

Each rank keeps, for the elements it owns (``1/N`` of every bucket, see
:mod:`lightning_zero.partition`): the master weights (the flat parameter shard itself when the
parameters are fp32/fp64, a separate fp32 copy for 16-bit parameters), ``exp_avg``, ``exp_avg_sq``
(and ``max_exp_avg_sq`` with ``amsgrad``), and a step count per parameter. The update is
``torch.optim.AdamW``'s (or ``Adam``'s, with L2 weight decay) to the letter: bias correction,
``eps`` outside the square root, decoupled decay ``p *= 1 - lr·wd`` before the moments, per-group
hyper-parameters read at every step (so LR schedulers take effect). A parameter that no rank used
(``find_unused_parameters=True``) is skipped, like a ``None`` gradient in torch.

Communication per step: the reducer's reduce-scatter (stage 2) or all-reduce (stage 1) of the
gradients, then one ``all_gather_into_tensor`` per bucket, in place in the flat parameter buffer.
Elements sent: ``Ψ·(N−1)/N`` for the gather, the same again (stage 2) or twice (stage 1) for the
gradients.

Limits: parameters must be real floating point tensors on one device; ``differentiable`` and
tensor-valued ``lr`` with ``capturable`` are refused. ``foreach``/``fused`` are accepted and
ignored: the shard update always uses ``torch._foreach_*`` over the owned pieces.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_zero.buckets import ParamSpec, plan_buckets
from lightning_zero.comm import Comm
from lightning_zero.config import ZeroConfig
from lightning_zero.flat import FlatParams
from lightning_zero.full_state import gather_full_state, scatter_full_state
from lightning_zero.param_gather import ParamGather
from lightning_zero.plan_check import check_same_plan
from lightning_zero.reducer import GradReducer
from lightning_zero.replan import Parked, carry_state
from lightning_zero.shard_state import ShardState

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_REFUSED_FLAGS = ("differentiable", "capturable")


class ShardedAdamW(torch.optim.Optimizer):
    """Adam/AdamW whose state and gradients are sharded over the ranks of a process group.

    Works in a plain ``torch.distributed`` loop (``backward(); step(); zero_grad()``) or, through
    :class:`~lightning_zero.ZeroStrategy`, from an ordinary ``torch.optim.AdamW`` returned by
    ``configure_optimizers``. Construct it on every rank with the same parameters, in the same
    order: the constructor compares the bucket plans across ranks and raises on a mismatch.

    Args:
        params: parameters or param-group dicts, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay, amsgrad, maximize: as ``torch.optim.AdamW``.
        decoupled_weight_decay: ``True`` for AdamW, ``False`` for Adam's L2 penalty.
        config: bucketing and sharding settings (:class:`~lightning_zero.ZeroConfig`).
        process_group: the data-parallel group; ``None`` for the default one (or none at all).
        param_order: the parameters in registration order (e.g. ``module.parameters()``); buckets
            follow its reverse. Defaults to the order of ``params``.
        param_names: names used in error messages, plans and checkpoints.

    Raises:
        ValueError: on an unsupported option, value or parameter; on a plan mismatch between ranks.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        decoupled_weight_decay: bool = True,
        config: ZeroConfig | None = None,
        process_group: ProcessGroup | None = None,
        param_order: Iterable[torch.nn.Parameter] | None = None,
        param_names: dict[torch.nn.Parameter, str] | None = None,
    ) -> None:
        _check_hyper(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults)
        self.config = config or ZeroConfig()
        self.comm = Comm(process_group)
        for group in self.param_groups:
            _check_group(group)
        self._param_order = None if param_order is None else list(param_order)
        self._names = param_names or {}
        self._parked = Parked()
        self._build(self._param_order, self._names)

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, **kwargs: Any) -> ShardedAdamW:
        """The sharded twin of a ``torch.optim.Adam``/``AdamW`` (same groups, same hyper-parameters).

        Raises:
            TypeError: for any other optimizer class.
        """
        if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
            raise TypeError(
                "lightning_zero shards torch.optim.AdamW and torch.optim.Adam; "
                f"got {type(optimizer).__name__}. "
                "Return one of those from configure_optimizers."
            )
        defaults = dict(optimizer.defaults)
        decoupled = type(optimizer) is torch.optim.AdamW or bool(
            defaults.get("decoupled_weight_decay", False)
        )
        # the twin takes over the very group dicts (not copies): LR schedulers, including the children
        # of SequentialLR/ChainedScheduler, and user code holding a group keep reading and writing them
        groups = optimizer.param_groups
        for group in groups:
            group["decoupled_weight_decay"] = decoupled
        return cls(
            groups,
            lr=defaults["lr"],
            betas=defaults["betas"],
            eps=defaults["eps"],
            weight_decay=defaults["weight_decay"],
            amsgrad=defaults.get("amsgrad", False),
            maximize=defaults.get("maximize", False),
            decoupled_weight_decay=decoupled,
            **kwargs,
        )

    def _build(
        self, param_order: Iterable[torch.nn.Parameter] | None, names: dict[torch.nn.Parameter, str]
    ) -> None:
        in_groups = {p: gi for gi, g in enumerate(self.param_groups) for p in g["params"] if p.requires_grad}
        order = [
            p for p in (param_order or [p for g in self.param_groups for p in g["params"]]) if p in in_groups
        ]
        order = list(dict.fromkeys(order))  # tied weights appear once
        missing = [p for p in in_groups if p not in set(order)]
        order += missing
        if not order:
            raise ValueError("the optimizer has no parameter with requires_grad=True")
        specs = [
            ParamSpec(names.get(p, f"param{i}"), tuple(p.shape), str(p.dtype), p.element_size())
            for i, p in enumerate(order)
        ]
        self.plan = plan_buckets(
            specs,
            self.comm.world_size,
            self.config.bucket_cap_mb,
            self.config.first_bucket_cap_mb,
            self.config.align_numel,
        )
        check_same_plan(self.plan, self.comm)
        self.params_in_order = order
        self.flat = FlatParams(order, self.plan, self.comm.rank)
        self.gather = ParamGather(self.plan, self.flat, self.comm, self.config.overlap_param_gather)
        self.reducer = GradReducer(order, self.plan, self.flat, self.comm, self.config)
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
        """Rebuild buckets, flat buffers and shards for the parameters that are trainable now.

        Call on all ranks between optimizer steps, after changing ``requires_grad`` or adding a param
        group (fine-tuning). Every parameter keeps its Adam state; one that is frozen now keeps it
        parked, as torch keeps the state of a parameter without gradient, until it trains again.

        Raises:
            PlanMismatchError: if the ranks do not agree on the new plan.
        """
        for group in self.param_groups:
            _check_group(group)
        if param_order is not None:
            self._param_order = list(param_order)
        if param_names is not None:
            self._names = param_names
        self.reducer.reset()
        self.reducer.remove_hooks()
        module = self.gather.module
        self.gather.remove_hooks()  # waits: the new flat buffers copy complete parameters
        old = (self.plan, self.params_in_order, self.shards)
        self._build(self._param_order, self._names)
        carry_state(self.comm, old, (self.plan, self.params_in_order, self.shards), self._parked)
        if module is not None:
            self.gather.install_forward_waits(module, self.params_in_order)
        kept = set(self.params_in_order)
        for param in old[1]:
            if param not in kept:  # its own storage: the old flat buffer is freed with the old plan
                param.data = param.data.clone()

    def install_forward_waits(self, module: torch.nn.Module) -> None:
        """Let ``overlap_param_gather`` take effect: ``module``'s submodules wait in their forward for
        the buckets holding their parameters. Anything that reads parameters outside a forward must
        call :meth:`wait_for_params` first."""
        self.gather.install_forward_waits(module, self.params_in_order)

    def wait_for_params(self) -> None:
        """Complete the parameter all-gathers still in flight (a no-op without overlap)."""
        self.gather.wait()

    def is_bound(self) -> bool:
        """Whether every planned parameter still is a view of the flat buffers (``module.to(...)`` or
        Lightning's teardown on a GPU gives parameters new storage)."""
        return self.flat.is_bound(self.params_in_order)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop this step's gradients (on every rank: it may wait for collectives in flight)."""
        self.reducer.reset()

    def no_sync(self) -> AbstractContextManager[None]:
        """Backward passes inside accumulate locally and send nothing (gradient accumulation)."""
        return self.reducer.no_sync()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the global gradient norm over all shards; returns the norm before clipping.

        Must be called on all ranks, after backward and before :meth:`step`.
        """
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
        """Divide the shard gradients by a loss scale; True if any rank's gradients hold inf/NaN.

        Every rank gets the same answer (one small all-reduce), so an overflow on one rank skips
        the step on all of them. Must be called on all ranks, after backward.
        """
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
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Reduce gradients (if backward has not already), update the owned shards, all-gather.

        Must be called on all ranks.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.trainable_changed():
            raise RuntimeError(
                "the trainable parameters changed after the last backward (requires_grad flipped or a "
                "param group added); change them between optimizer steps and call replan() on every "
                "rank before the next backward (the zero strategy does this before each training step)"
            )
        self._opt_called = True  # what LR schedulers check to warn about call order
        if self.reducer.idle:  # no backward since the last step: like torch with every .grad None
            self.reducer.reset()
            return loss
        self.gather.wait()  # gathers left in flight read the shards this step writes
        used_mask = self.reducer.finalize()
        self.shards.adopt_external_writes()
        self.shards.count_steps(used_mask)
        for b in self.gather.order():  # each bucket's gather overlaps the next one's update
            self.shards.update_bucket(b, self.param_groups, used_mask)
            self.gather.launch(b)
        self.gather.launched()
        self.reducer.reset()
        return loss

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # LR schedulers rebound to us check it

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full state, in ``torch.optim.AdamW``'s format, on rank ``to``. Call on all ranks.

        Afterwards :meth:`state_dict` returns it on rank ``to`` (the protocol of torch's
        ``ZeroRedundancyOptimizer``, which Lightning's checkpointing follows).
        """
        self.gather.wait()
        self._consolidated = gather_full_state(self, dst=to)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The full state gathered by :meth:`consolidate_state_dict` (on the destination rank).

        Raises:
            RuntimeError: if this rank holds no consolidated state.
        """
        state: dict[str, Any] | None = getattr(self, "_consolidated", None)
        if state is None:
            raise RuntimeError(
                f"rank {self.comm.rank} holds no consolidated optimizer state: "
                "call consolidate_state_dict(to=...) "
                "on every rank first, then state_dict() on the destination rank"
            )
        self._consolidated = None
        return state

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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a full ``torch.optim.Adam``/``AdamW`` state (from any world size, or from plain torch).

        Every rank passes the same full state and keeps its own pieces; no communication. Load the
        model's parameters first: 16-bit parameters' fp32 master shards are re-read from them.
        """
        self.gather.wait()
        scatter_full_state(self, state_dict)


def _check_hyper(*, lr: float, betas: Sequence[float], eps: float, weight_decay: float) -> None:
    if isinstance(lr, Tensor):
        lr = float(lr)
    if not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")


def _check_group(group: dict[str, Any]) -> None:
    _check_hyper(lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"])
    for flag in _REFUSED_FLAGS:
        if group.get(flag):
            raise ValueError(
                f"{flag}=True is not supported by lightning_zero's sharded Adam; set it to False"
            )
    for p in group["params"]:
        if not p.is_floating_point():
            raise ValueError(f"only floating point parameters can be sharded, got {p.dtype}")
    if "step" in group and isinstance(group["step"], Tensor):
        raise ValueError("tensor-valued group steps are not supported")
