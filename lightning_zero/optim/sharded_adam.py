"""``ShardedAdamW``: the optimizer protocol on :class:`~lightning_zero.engine.ShardEngine`, which holds
the buffers, hooks, collectives and shard state: Adam/AdamW on this rank's shard of every bucket,
then an all-gather of the updated parameters.

Each rank keeps, for the elements it owns (``1/N`` of every bucket, see
:mod:`lightning_zero.layout.partition`): the master weights (the flat parameter shard itself when the
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
tensor-valued ``lr`` with ``capturable`` are refused. ``fused``/``foreach`` choose the kernel family
as in torch (:mod:`lightning_zero.optim.adam`), so fp32 results equal torch's for the same choice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_zero.comm.groups import CommGroups
from lightning_zero.comm.host_clock import timed
from lightning_zero.config import ZeroConfig
from lightning_zero.engine.averaging import AvgFn, MultiAvgFn
from lightning_zero.engine.deferred_init import DeferredInit
from lightning_zero.engine.engine import ShardEngine
from lightning_zero.optim.adam import AdamRule
from lightning_zero.optim.checks import check_group, check_hyper
from lightning_zero.optim.full_state import gather_full_state, scatter_full_state

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh


class ShardedAdamW(torch.optim.Optimizer):
    """Adam/AdamW whose state and gradients are sharded over the ranks of a process group.

    Works in a plain ``torch.distributed`` loop (``backward(); step(); zero_grad()``) or, through
    :class:`~lightning_zero.ZeroStrategy`, from an ordinary ``torch.optim.AdamW`` returned by
    ``configure_optimizers``. Construct it on every rank with the same parameters, in the same
    order: the constructor compares the bucket plans across ranks and raises on a mismatch.

    Args:
        params: parameters or param-group dicts, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay, amsgrad, maximize: as ``torch.optim.AdamW``.
        foreach, fused: as ``torch.optim.AdamW``: ``fused=True`` runs torch's fused kernel (CPU or
            CUDA; it rounds differently); otherwise the update is torch's for-loop/foreach one.
        decoupled_weight_decay: ``True`` for AdamW, ``False`` for Adam's L2 penalty.
        config: bucketing and sharding settings (:class:`~lightning_zero.ZeroConfig`).
        process_group: the data-parallel group; ``None`` for the default one (or none at all).
        device_mesh: instead of ``process_group``: a torch ``DeviceMesh``. 1-D: flat sharding over its
            ranks. 2-D, ``(replicate, shard)`` as in FSDP2's hybrid sharding: buckets split over the
            ranks of dim 1, replicated across dim 0 (:mod:`lightning_zero.comm.groups`;
            :func:`~lightning_zero.comm.hybrid_mesh` builds one with ``G`` ranks per shard group).
        param_order: the parameters in registration order (e.g. ``module.parameters()``); buckets
            follow its reverse. Defaults to the order of ``params``.
        param_names: names used in error messages, plans and checkpoints.
        module: the model. Required at stage 3 (``config.stage=3``), whose parameters are sharded
            too and gathered around each unit's forward and backward by hooks on ``module``; then
            ``param_order`` and ``param_names`` default to ``module``'s. Parameters outside a
            forward are readable only inside ``opt.full_parameters()`` and writable only inside
            ``opt.full_parameters(writeback=True)`` (elsewhere they read NaN and a write raises,
            naming the parameter).
        deferred_init: stage 3, ``module`` built on the meta device: initialize it unit by unit on
            this device from this generator state (:mod:`lightning_zero.engine.deferred_init`; call
            its ``check_deferred(module)`` first; every rank must pass the same state).
        groups: instead of ``process_group`` or ``device_mesh``: the groups themselves
            (:class:`~lightning_zero.comm.CommGroups`), e.g. ``CommGroups.simulated(r, N)``, which
            runs this optimizer as rank ``r`` of ``N`` in one process (:mod:`lightning_zero.comm.simulated`).
        pipeline_group: pipeline parallelism, where this optimizer holds one stage's parameters: the
            group (a ``ProcessGroup``, or a 1-D ``DeviceMesh`` such as ``mesh["pipeline"]``) of this
            rank and its peers holding the other stages. Clipping uses the whole model's gradient
            norm, and a loss-scale overflow or a non-finite step (``skip_nonfinite_steps``) on one
            stage skips every stage (:mod:`lightning_zero.comm.pipeline` runs the schedule).

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
        foreach: bool | None = None,
        fused: bool | None = None,
        decoupled_weight_decay: bool = True,
        config: ZeroConfig | None = None,
        process_group: ProcessGroup | None = None,
        device_mesh: DeviceMesh | None = None,
        param_order: Iterable[torch.nn.Parameter] | None = None,
        param_names: dict[torch.nn.Parameter, str] | None = None,
        module: torch.nn.Module | None = None,
        deferred_init: DeferredInit | None = None,
        groups: CommGroups | None = None,
        pipeline_group: ProcessGroup | DeviceMesh | None = None,
    ) -> None:
        check_hyper(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults)
        self.config = config or ZeroConfig()
        for group in self.param_groups:
            check_group(group)
        chosen = {"process_group": process_group, "device_mesh": device_mesh, "groups": groups}
        given = [name for name, value in chosen.items() if value is not None]
        if len(given) > 1:
            raise ValueError(f"pass one of process_group, device_mesh and groups, not {' and '.join(given)}")
        if groups is None:
            groups = (
                CommGroups.flat_over(process_group)
                if device_mesh is None
                else CommGroups.from_mesh(device_mesh)
            )
        if module is not None:
            param_order = module.parameters() if param_order is None else param_order
            param_names = {p: n for n, p in module.named_parameters()} if param_names is None else param_names
        self.engine = ShardEngine(
            self.param_groups,
            self.config,
            groups,
            AdamRule(),
            param_order,
            param_names,
            module,
            deferred_init,
            pipeline=None if pipeline_group is None else _pipeline_comm(pipeline_group),
        )
        """The buffers, hooks, collectives and shard state (:class:`~lightning_zero.engine.ShardEngine`)."""

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
            foreach=defaults.get("foreach"),
            fused=defaults.get("fused"),
            decoupled_weight_decay=decoupled,
            **kwargs,
        )

    def trainable_changed(self) -> bool:
        """Whether a param group was added or a ``requires_grad`` flag flipped since the plan was built."""
        return self.engine.trainable_changed()

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
            check_group(group)
        self.engine.replan(param_order, param_names)

    def install_forward_waits(self, module: torch.nn.Module) -> None:
        """Let ``overlap_param_gather`` take effect: ``module``'s submodules wait in their forward for
        the buckets holding their parameters. Anything that reads parameters outside a forward must
        call :meth:`wait_for_params` first."""
        self.engine.install_forward_waits(module)

    def wait_for_params(self, root_only: bool = False) -> None:
        """Complete the parameter all-gathers still in flight (a no-op without overlap); with
        ``root_only``, only those of the parameters the module given to :meth:`install_forward_waits`
        owns itself (its submodules wait in their own forward)."""
        self.engine.wait_for_params(root_only)

    def full_parameters(self, writeback: bool = False) -> AbstractContextManager[None]:
        """Inside ``with opt.full_parameters():`` every parameter holds its full value: at stage 3 every
        unit is gathered (and freed at the exit), below it the gathers in flight complete. Writes
        inside are kept at stage 3 only with ``writeback=True`` (each rank keeps its own slice of what
        it wrote: write the same values on every rank). Call on all ranks."""
        return self.engine.full_parameters(writeback)

    def is_bound(self) -> bool:
        """Whether every planned parameter still is a view of the flat buffers (``module.to(...)`` or
        Lightning's teardown on a GPU gives parameters new storage)."""
        return self.engine.is_bound()

    @timed
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop this step's gradients (on every rank: it may wait for collectives in flight); nothing
        once after :meth:`keep_next_zero_grad`."""
        if self.__dict__.pop("_keep_next_zero_grad", False):
            return
        self.engine.zero_grad()

    def keep_next_zero_grad(self, keep: bool = True) -> None:
        """The next :meth:`zero_grad` keeps the gradients (``keep=False``: it zeroes them again). For a
        loop that calls ``zero_grad()`` after a backward has already run: Lightning's training closure
        zeroes the gradients between the training step and its backward, and under pipeline
        parallelism the training step runs the schedule's backwards."""
        self.__dict__["_keep_next_zero_grad"] = keep

    def no_sync(self) -> AbstractContextManager[None]:
        """Backward passes inside accumulate locally and send nothing (gradient accumulation)."""
        return self.engine.no_sync()

    def inputs_only(self) -> AbstractContextManager[None]:
        """A backward inside computes input gradients only (``torch.autograd.grad(..., inputs=...)``, as
        torch's shape inference of a pipeline stage does): no parameter gets a gradient, nothing is sent."""
        return self.engine.inputs_only()

    @timed
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the global gradient norm over all shards; returns the norm before clipping.

        Must be called on all ranks, after backward and before :meth:`step`.
        """
        return self.engine.clip_grad_norm_(max_norm, norm_type)

    @timed
    def unscale_(self, scale: float | Tensor) -> bool:
        """Divide the shard gradients by a loss scale; True if any rank's gradients hold inf/NaN.

        Every rank gets the same answer (one small all-reduce), so an overflow on one rank skips
        the step on all of them. Must be called on all ranks, after backward.
        """
        return self.engine.unscale_(scale)

    @timed
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every gradient element to ``[-clip_value, clip_value]`` (local: no communication)."""
        self.engine.clip_grad_value_(clip_value)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Reduce gradients (if backward has not already), update the owned shards, all-gather.

        With ``config.skip_nonfinite_steps``, a step in which any rank's gradients hold inf/NaN is
        skipped on every rank (counted in :attr:`skipped_steps`). Must be called on all ranks.

        Raises:
            NonFiniteGradientError: the ``skip_nonfinite_steps``-th skipped step in a row (every rank).
            RuntimeError: after ``lightning_zero.unshard(model)`` ended stage 3 for the model.
        """
        loss = None
        if closure is not None:  # the training step: not our code (its hooks into ours time themselves)
            with torch.enable_grad():
                loss = closure()
        self._update()
        return loss

    @timed
    def _update(self) -> None:
        """The step after its closure: check the trainable parameters, update the shards."""
        if self.trainable_changed():
            raise RuntimeError(
                "the trainable parameters changed after the last backward (requires_grad flipped or a "
                "param group added); change them between optimizer steps and call replan() on every "
                "rank before the next backward (the zero strategy does this before each training step)"
            )
        self._opt_called = True  # what LR schedulers check to warn about call order
        self.engine.step()

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # LR schedulers rebound to us check it

    def keep_weight_average(self, device: torch.device | str | None = None) -> None:
        """Keep a weight average (EMA, SWA) of this rank's shards from now on: ``1/N`` of the fp32
        weights, starting from the current ones, on ``device`` (``None``: beside the optimizer state).
        Checkpoints save and restore it (:mod:`lightning_zero.engine.averaging`). All ranks."""
        self.engine.keep_weight_average(device)

    def update_weight_average(
        self, avg_fn: AvgFn | None = None, multi_avg_fn: MultiAvgFn | None = None
    ) -> None:
        """After :meth:`step`: average the new weights in, as ``torch.optim.swa_utils.AveragedModel``'s
        ``update_parameters`` does with the same ``avg_fn``/``multi_avg_fn`` (e.g.
        ``get_ema_multi_avg_fn(0.999)``; neither: equal weights, SWA). No communication."""
        self.engine.update_weight_average(avg_fn, multi_avg_fn)

    def swap_weight_average(self) -> None:
        """Exchange the model's weights and their average (call again to swap back): evaluate or save
        the averaged model in between. All ranks."""
        self.engine.swap_weight_average()

    def copy_weight_average(self) -> None:
        """Make the average the model's weights (e.g. at the end of training). All ranks."""
        self.engine.copy_weight_average()

    @property
    def n_averaged(self) -> int:
        """Updates of the weight average so far (0: the next one copies the weights)."""
        return self.engine.n_averaged

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for inf/NaN gradients (``skip_nonfinite_steps``) since this optimizer was
        built; the same on every rank, read without communication."""
        return self.engine.skipped_steps

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full state, in ``torch.optim.AdamW``'s format, on rank ``to``. Call on all ranks.

        Afterwards :meth:`state_dict` returns it on rank ``to`` (the protocol of torch's
        ``ZeroRedundancyOptimizer``, which Lightning's checkpointing follows).
        """
        self.engine.wait_for_params()
        self._consolidated = gather_full_state(self.engine, dst=to)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The full state gathered by :meth:`consolidate_state_dict` (on the destination rank).

        Raises:
            RuntimeError: if this rank holds no consolidated state.
        """
        state: dict[str, Any] | None = getattr(self, "_consolidated", None)
        if state is None:
            raise RuntimeError(
                f"rank {self.engine.comm.rank} holds no consolidated optimizer state: "
                "call consolidate_state_dict(to=...) "
                "on every rank first, then state_dict() on the destination rank"
            )
        self._consolidated = None
        return state

    def group_hyperparameters(self) -> list[dict[str, Any]]:
        """The param groups without their parameters, and with the parameters' plan indices."""
        return self.engine.group_hyperparameters()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a full ``torch.optim.Adam``/``AdamW`` state (from any world size, or from plain torch).

        Every rank passes the same full state and keeps its own pieces; no communication. Load the
        model's parameters first: 16-bit parameters' fp32 master shards are re-read from them.
        """
        self.engine.wait_for_params()
        scatter_full_state(self.engine, state_dict)


def _pipeline_comm(group: Any) -> Any:
    """:func:`lightning_zero.comm.pipeline.pipeline_comm`, imported when pipeline parallelism is used
    (``torch.distributed.pipelining`` is not imported otherwise)."""
    from lightning_zero.comm.pipeline import pipeline_comm

    return pipeline_comm(group)
