"""Pipeline parallelism: torch's schedules (``torch.distributed.pipelining``) driving stages whose
parameters ZeRO shards over each stage's data-parallel ranks.

The model is split by layers into ``P`` stages on different ranks; a schedule streams ``M``
micro-batches through them, sending activations forward and their gradients back between
neighbouring stages (point-to-point, on the pipeline group). What a ZeRO stage needs from it:

  * **One gradient reduction per step, not per micro-batch.** :class:`ShardedStage` runs every
    micro-batch's backward but the last under the optimizer's ``no_sync()`` (as torch's own stage
    does for DDP and FSDP2), so the gradients of the ``M`` micro-batches accumulate locally and the
    bucketed reduction runs once, in the last backward, overlapped with it as in any step.
  * **Gradients of the mean over micro-batches.** torch's schedules divide ``p.grad`` by ``M``
    after the last backward (``scale_grads``); at stages 2 and 3 the reduced gradients live in the
    optimizer's shards by then, not in ``p.grad``. :func:`schedule` turns that off and divides each
    micro-batch's loss by ``M`` instead: the same gradients, scaled before the reduction. The
    ``losses`` a schedule returns on the last stage are each micro-batch's loss divided by ``M``:
    their sum is the step's mean loss.
  * **The whole model's norm**: the optimizer of each stage takes the pipeline group
    (``ShardedAdamW(..., pipeline_group=...)``), over which clipping's norm, a loss-scale overflow
    and the non-finite guard's flags are reduced (:class:`~lightning_zero.engine.ShardEngine`).

The schedules by name (:data:`SCHEDULES`): ``"gpipe"`` (all forwards, then all backwards: ``M``
micro-batches' activations held), ``"1f1b"`` (at most ``P`` in flight), ``"interleaved_1f1b"``
(several smaller stages per rank, a smaller bubble; pass each rank's stages as a list).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from lightning_zero.comm.communicator import Comm
from lightning_zero.comm.handles import CommError
from lightning_zero.comm.history import last_collectives
from lightning_zero.comm.host_clock import STAGE_CLOCK

SCHEDULES: dict[str, Any] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}
"""The pipeline schedules by name: torch's classes."""


def pipeline_comm(group: Any) -> Comm:
    """The communicator of a pipeline group: a ``ProcessGroup`` or a 1-D ``DeviceMesh``. All its
    ranks (one barrier).

    Raises:
        ValueError: a mesh of more than one dimension.
    """
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"the pipeline group must be a 1-D mesh (e.g. mesh['pipeline']), got a {group.ndim}-D mesh "
                f"{tuple(group.mesh_dim_names or ())}"
            )
        group = group.get_group()
    comm = Comm(group, role="pipeline")
    comm.barrier("pipeline group")  # every stage meets here first (and the recorder learns the stages)
    return comm


class ShardedStage(PipelineStage):
    """A pipeline stage whose parameters a ZeRO optimizer shards: every micro-batch's backward but the
    last runs under ``no_sync`` (the optimizer's), so its gradients are reduced once per step.

    Args:
        module: this stage's part of the model.
        stage_index: its index among all stages (``0`` holds the input, ``num_stages - 1`` the loss).
        num_stages: how many stages the model is split into.
        device: where the stage runs.
        group: the pipeline group (``ProcessGroup``, or a 1-D ``DeviceMesh``): one rank per stage.
        no_sync: the optimizer's ``no_sync`` (``ShardedAdamW.no_sync``).
        state: the module whose buffers torch's shape-inference forward (the first micro-batch of a new
            schedule, :class:`_Kept`) must leave as they were: ``module`` by default; a stage
            that calls the model's layers without registering them passes the model.
        inputs_only: the optimizer's ``inputs_only`` (``ShardedAdamW.inputs_only``), around torch's
            shape-inference backward, which computes the stage's input gradients alone: at stage 3 its
            unit hooks would otherwise launch a round of zero gradients (and warn that each got none).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        group: Any,
        no_sync: Callable[[], AbstractContextManager[Any]],
        state: torch.nn.Module | None = None,
        inputs_only: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> None:
        if isinstance(group, DeviceMesh):
            group = group.get_group()
        super().__init__(module, stage_index, num_stages, device, group=group)
        self._no_sync = no_sync
        self._inputs_only = inputs_only
        self._state = module if state is None else state
        self.kept = _Kept()
        """The buffers put back after torch's shape inference (shared by the stages of one rank)."""
        self.siblings: list[ShardedStage] = [self]
        """This rank's stages under one optimizer (the interleaved schedule's; set by :func:`schedule`):
        the gradients are reduced in the last backward of the last of them to finish its step."""
        self._finished = False

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        self.kept.keep(self._state)  # put back once torch's backward inference is done with the graph
        with _stage_work(), _same_random_numbers(self.device):
            return super()._forward_metadata_inference(*args, **kwargs)

    def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        with _stage_work(), self._inputs_only():  # torch.autograd.grad for the inputs: no bucket launches
            return super()._backward_metadata_inference(*args, **kwargs)

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        self.kept.put_back()

    def _shape_inference(self, *args: Any, **kwargs: Any) -> Any:  # before torch 2.13: forward only
        self.kept.keep(self._state)
        try:
            with _stage_work(), _same_random_numbers(self.device):
                return super()._shape_inference(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.kept.put_back()

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        with _stage_work(), STAGE_CLOCK.timing(self.device):
            return super().forward_maybe_with_nosync(*args, **kwargs)

    def backward_maybe_with_nosync(
        self, backward_type: Any, bwd_kwargs: dict[str, Any], last_backward: bool = False
    ) -> Any:
        if last_backward:
            self._finished = True
        if all(s._finished for s in self.siblings):  # the step's reduction, bucket by bucket in this backward
            for stage in self.siblings:
                stage._finished = False
            with _stage_work(), STAGE_CLOCK.timing(self.device):
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        with _stage_work(), self._no_sync(), STAGE_CLOCK.timing(self.device):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


_STAGE_WORK = "_lightning_zero_stage_work"
"""Attribute :func:`_stage_work` sets on an exception raised by a stage's own work."""


@contextmanager
def _stage_work() -> Iterator[None]:
    """Marks an exception raised inside a stage's forward, backward, loss or shape inference (the
    model's code, and our own collectives, which raise :class:`CommError` themselves): what
    :func:`send_receive_failures` must not take for a failed send or receive."""
    try:
        yield
    except BaseException as err:
        with suppress(AttributeError, TypeError):  # an exception type without a __dict__
            setattr(err, _STAGE_WORK, True)
        raise


def _from_stage_work(err: BaseException) -> bool:
    """Whether ``err`` or one of its causes (torch re-raises a stage's error as its own
    ``RuntimeError("[Stage 1] failed to run forward ...")``) came from a stage's own work."""
    seen: BaseException | None = err
    for _ in range(16):  # a chain's length, bounded: a cycle of contexts is possible
        if seen is None:
            return False
        if getattr(seen, _STAGE_WORK, False):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@contextmanager
def send_receive_failures(what: str) -> Iterator[None]:
    """Run a schedule's ``step``/``eval`` with a failure of its point-to-point sends and receives
    between stages (a peer stage died, hung past the process group's timeout, or the backend broke)
    re-raised as a :class:`CommError` naming ``what``, as every collective of ours is, so that code
    acting on a peer's failure (the recipes' requeue) sees one. A failure of the stage's own work (its
    forward, backward, loss: out of memory, a shape error; marked by :class:`ShardedStage`) and torch's
    own checks of the pipeline pass through unchanged."""
    try:
        yield
    except CommError:
        raise
    except (RuntimeError, TimeoutError, ConnectionError) as err:  # torch's DistError is a RuntimeError
        if _from_stage_work(err) or type(err).__module__.startswith("torch.distributed.pipelining"):
            raise
        raise CommError(
            f"{what}: a send or receive between pipeline stages failed ({type(err).__name__}: {err}); a "
            "peer stage has died, hung past the process group's timeout, or the backend broke; "
            + last_collectives()
        ) from err


class _Kept:
    """torch learns the shapes a new schedule's stage sends from a forward (and a backward) of its first
    micro-batch, in training mode, which a ``"ddp"`` run does not have: the buffers it changed (a
    running mean, a step counter) are put back as they were, once torch is done with that graph (an
    in-place write before its backward would break it). The stages of one rank share one."""

    def __init__(self) -> None:
        self._values: dict[tuple[int, str], tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor]] = {}

    def keep(self, module: torch.nn.Module) -> None:
        """Note ``module``'s buffers (those a sibling stage noted first keep their first value)."""
        for owner in module.modules():
            for name, buffer in owner.named_buffers(recurse=False):
                key = (id(owner), name)
                if key not in self._values:
                    self._values[key] = (owner, name, buffer, buffer.detach().clone())

    def put_back(self) -> None:
        """Each buffer's value written back in place (a buffer the forward replaced: the kept one)."""
        with torch.no_grad():
            for owner, name, buffer, value in self._values.values():
                if getattr(owner, name) is buffer:
                    buffer.copy_(value)
                else:
                    setattr(owner, name, buffer.copy_(value))
        self._values.clear()


@contextmanager
def _same_random_numbers(device: torch.device) -> Iterator[None]:
    """The generators as they were after the block (torch 2.13's schedule forks them around its shape
    inference itself; older ones did not): dropout's masks as in a run without it."""
    accelerated = [device] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=accelerated, device_type=device.type if accelerated else "cuda"):
        yield


def schedule(
    kind: str,
    stages: ShardedStage | Sequence[ShardedStage],
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Any:
    """A torch schedule of ``kind`` over this rank's stage (a list of its stages for
    ``"interleaved_1f1b"``), ``microbatches`` per step, the loss of each divided by ``microbatches``
    (see the module docstring). Call ``.step(inputs)`` on the first stage's ranks,
    ``.step(target=..., losses=[])`` on the last one's and ``.step()`` elsewhere, then the optimizer's
    ``step()`` on every rank.

    Raises:
        ValueError: an unknown ``kind``, fewer than one micro-batch, or a single stage given to the
            interleaved schedule (a list to another).
    """
    if kind not in SCHEDULES:
        raise ValueError(f"pipeline schedule {kind!r} is not one of {sorted(SCHEDULES)}")
    if not (isinstance(microbatches, int) and not isinstance(microbatches, bool) and microbatches >= 1):
        raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
    several = not isinstance(stages, ShardedStage)
    if several != (kind == "interleaved_1f1b"):
        raise ValueError(
            f"schedule {kind!r} takes "
            + ("a list of this rank's stages" if kind == "interleaved_1f1b" else "one stage per rank")
        )

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with _stage_work(), STAGE_CLOCK.timing(output.device):
            return loss_fn(output, target) / microbatches

    chosen = list(stages) if several else stages  # type: ignore[arg-type]
    if several:
        for stage in chosen:  # type: ignore[union-attr]
            stage.siblings = list(chosen)  # type: ignore[arg-type]
            stage.kept = chosen[0].kept  # type: ignore[index]
    return SCHEDULES[kind](chosen, n_microbatches=microbatches, loss_fn=loss, scale_grads=False)
