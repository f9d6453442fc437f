"""Pipeline parallelism under the Trainer: this rank's stages of the LightningModule and the schedules
that run them inside Lightning's training, validation, test and predict steps.

The LightningModule's part (``docs/pipeline.md`` argues it):

  * ``pipeline_layers()`` (required): the model's layers in the order its forward runs them, each a
    submodule or a list of submodules run in order (a group, one layer of the cut); every parameter
    belongs to exactly one (:func:`~lightning_zero.layout.stages.check_stage_split`).
  * ``pipeline_forward(index, x)`` (optional): run layer ``index`` on ``x``; by default
    ``pipeline_layers()[index](x)``, a group's modules one after the other (override it when a layer
    takes more, e.g. rotary tables).
  * ``pipeline_loss(output, target)`` (required to train, validate or test): the loss of one
    micro-batch, a mean over its samples.
  * a batch is ``(inputs, target)``, cut into micro-batches along dim 0 (or ``pipeline_batch(batch)``
    returns that pair).

The strategy owns the step: ``training_step``, ``validation_step`` and ``test_step`` of the module are
not called; the step's mean loss (the last stage's, sent to every rank of the pipeline) is what the
step returns, so ``on_train_batch_end(outputs, ...)`` (``outputs["loss"]``) and
``on_validation_batch_end(outputs, ...)`` (``outputs``) receive it on every rank, to log there.
``predict_step`` returns the last stage's outputs on its ranks and ``None`` on the others.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_zero.comm.pipeline import ShardedStage, pipeline_comm, schedule, send_receive_failures
from lightning_zero.layout.stages import (
    Layer,
    check_stage_split,
    keep_stages,
    layer_names,
    members,
    rank_stages,
    stage_layers,
)


class StageForward(nn.Module):
    """The forward of one stage: its layers in order, through the LightningModule's
    ``pipeline_forward`` when it defines one. It registers no module: the layers stay the model's."""

    _owner: nn.Module
    _layers: list[Layer]

    def __init__(self, owner: nn.Module, layers: list[Layer], indices: range) -> None:
        super().__init__()
        object.__setattr__(self, "_owner", owner)  # not a child: its parameters stay the model's
        object.__setattr__(self, "_layers", layers)
        self.indices = indices

    def forward(self, x: Any) -> Any:
        hook = getattr(self._owner, "pipeline_forward", None)
        for i in self.indices:
            if hook is not None:
                x = hook(i, x)
                continue
            for module in members(self._layers[i]):  # a group's modules in order
                x = module(x)
        return x


def _required(module: nn.Module, name: str, why: str) -> Callable[..., Any]:
    hook = getattr(module, name, None)
    if not callable(hook):
        raise ValueError(
            f"pipeline_parallel_size > 1 needs the LightningModule ({type(module).__name__}) to define "
            f"{name}(): {why} (docs/pipeline.md)"
        )
    return hook  # type: ignore[no-any-return]


class TrainerPipeline:
    """This rank's stages of ``module`` over the pipeline dimension of ``mesh`` (cut down in place:
    :func:`~lightning_zero.layout.stages.keep_stages`), and the schedules of its steps.

    Raises:
        ValueError: a LightningModule without ``pipeline_layers()``, fewer layers than stages, a
            parameter outside the layers or shared across stages (named).
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: Any,
        device: torch.device,
        kind: str,
        microbatches: int | None,
        virtual: int,
    ) -> None:
        self.group = mesh
        self.ranks = mesh.size()
        self.rank = mesh.get_local_rank()
        self.kind = kind
        self.virtual = virtual
        self.microbatches = self.ranks if microbatches is None else microbatches
        self.device = device
        self.module = module
        stages = self.ranks * virtual
        layers = list(
            _required(module, "pipeline_layers", "the model's layers in the order of its forward")()
        )
        layer_names(module, layers)  # each a submodule, none twice: before any change
        self.bounds = stage_layers(len(layers), stages)
        check_stage_split(module, layers, self.bounds)
        self.mine = rank_stages(self.rank, self.ranks, virtual)
        keep_stages(module, layers, self.bounds, self.mine)
        layers = list(module.pipeline_layers())  # type: ignore[operator]  # this rank's, and placeholders
        self.forwards = [StageForward(module, layers, self.bounds[s]) for s in self.mine]
        self.first, self.last = 0 in self.mine, stages - 1 in self.mine
        self.stage_peers = pipeline_comm(mesh)
        self._runs: dict[tuple[Any, ...], Any] = {}
        self._no_sync: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
        self._optimizer: Any = None
        self._accumulate = 1

    def train(self, optimizer: Any, accumulate: int) -> None:
        """Training from now on with ``optimizer`` (a ``ShardedAdamW``), the loss divided by
        ``accumulate`` (the batches per optimizer step). Builds the training schedule once, so that a
        bad micro-batch count is refused before the first step."""
        self._optimizer, self._no_sync, self._accumulate = optimizer, optimizer.no_sync, accumulate
        self._runs = {key: run for key, run in self._runs.items() if key[0] != "train"}
        self._schedule("train", None)

    def _loss(self, mode: str) -> Callable[[Any, Any], torch.Tensor]:
        """``pipeline_loss``, divided by the batches per optimizer step in training (an evaluation's is
        not: its schedule may outlive a change of them)."""
        loss = _required(self.module, "pipeline_loss", "the loss of a micro-batch's output and target")
        accumulate = self._accumulate if mode == "train" else 1

        def fn(output: Any, target: Any) -> torch.Tensor:
            return loss(output, target) / accumulate

        return fn

    def _schedule(self, mode: str, shapes: Any) -> Any:
        key = (mode, shapes)
        if key not in self._runs:
            no_sync = self._no_sync if mode == "train" else contextlib.nullcontext
            training = mode == "train" and self._optimizer is not None
            inputs_only = self._optimizer.inputs_only if training else contextlib.nullcontext
            count = self.ranks * self.virtual
            stages = [
                ShardedStage(f, s, count, self.device, self.group, no_sync, self.module, inputs_only)
                for f, s in zip(self.forwards, self.mine, strict=True)
            ]
            loss = self._loss(mode) if mode != "predict" else None
            if loss is None:
                self._runs[key] = _predict_schedule(self.kind, stages, self.microbatches)
            else:
                self._runs[key] = schedule(
                    self.kind, stages if self.virtual > 1 else stages[0], self.microbatches, loss
                )
        return self._runs[key]

    def split(self, batch: Any) -> tuple[Any, Any]:
        """``(inputs, target)`` of a batch (``pipeline_batch(batch)`` when the module defines it).

        Raises:
            ValueError: a batch that is no pair, or a first dimension ``pipeline_microbatches`` does not
                divide.
        """
        hook = getattr(self.module, "pipeline_batch", None)
        pair = hook(batch) if hook is not None else batch
        if not (isinstance(pair, list | tuple) and len(pair) == 2):
            raise ValueError(
                "under pipeline_parallel_size > 1 a batch must be (inputs, target), got "
                f"{type(pair).__name__}"
                f"{'' if not isinstance(pair, list | tuple) else f' of {len(pair)}'}; or define "
                "pipeline_batch(batch) returning that pair"
            )
        inputs, target = pair
        rows = inputs.shape[0]
        if rows % self.microbatches:
            raise ValueError(
                f"a batch of {rows} samples cannot be cut into pipeline_microbatches={self.microbatches} "
                "equal micro-batches: use a batch size it divides (and drop_last=True for a last short batch)"
            )
        return inputs, target

    def _shapes(self, *tensors: Any) -> tuple[Any, ...]:
        return tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in tensors)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Forward and backward of every micro-batch; the batch's mean loss on every rank.

        Lightning zeroes the gradients at the first batch of an accumulation window between the training
        step and its backward: here the backward runs inside the step, so the gradients are zeroed
        before it and Lightning's ``zero_grad`` that follows keeps them (its hooks still run)."""
        inputs, target = self.split(batch)
        run = self._schedule("train", self._shapes(inputs, target))
        first_of_window = batch_idx % self._accumulate == 0  # Lightning's own rule for its zero_grad
        if first_of_window:
            self._optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        self._drive(run.step, inputs, target, losses)
        if first_of_window:
            self._optimizer.keep_next_zero_grad()
        return self._share(losses) * self._accumulate

    def after_zero_grad(self) -> None:
        """Lightning's backward of the step (after its ``zero_grad``): a ``zero_grad`` it skipped keeps
        nothing armed for the next window."""
        if self._optimizer is not None:
            self._optimizer.keep_next_zero_grad(False)

    def evaluation_step(self, batch: Any) -> torch.Tensor:
        """Forward of every micro-batch (no gradients); the batch's mean loss on every rank."""
        inputs, target = self.split(batch)
        run = self._schedule("eval", self._shapes(inputs, target))
        losses: list[torch.Tensor] = []
        self._drive(run.eval, inputs, target, losses)
        return self._share(losses)

    def _drive(
        self, call: Callable[..., Any], inputs: Any, target: Any, losses: list[torch.Tensor] | None
    ) -> Any:
        """A schedule's ``step``/``eval`` as this rank calls it: the first stage gives the inputs, the
        last the target (and gets each micro-batch's loss in ``losses``), the others nothing; the last
        stage's outputs, ``None`` elsewhere."""
        with send_receive_failures(f"pipeline rank {self.rank}'s schedule step"):
            if self.first:
                call(inputs)
                return None
            if self.last:
                return call(target=target, losses=losses)
            call()
            return None

    def predict_step(self, batch: Any) -> Any:
        """Forward of every micro-batch of the batch's inputs; the last stage's outputs there, ``None``
        on the other stages' ranks."""
        hook = getattr(self.module, "pipeline_batch", None)
        inputs = (
            hook(batch)[0] if hook is not None else (batch[0] if isinstance(batch, list | tuple) else batch)
        )
        if inputs.shape[0] % self.microbatches:
            raise ValueError(
                f"a batch of {inputs.shape[0]} samples cannot be cut into pipeline_microbatches="
                f"{self.microbatches} equal micro-batches"
            )
        return self._drive(self._schedule("predict", self._shapes(inputs)).step, inputs, None, None)

    def _share(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The sum of the last stage's micro-batch losses (each already divided by ``M``), sent to
        every rank of the pipeline."""
        if self.last:
            total = torch.stack([loss.detach().double() for loss in losses]).sum()
        else:  # float64 on every rank (one element): the loss of a float64 model stays exact
            total = torch.zeros((), dtype=torch.float64, device=self.device)
        self.stage_peers.broadcast_tensors([total], src=self.ranks - 1)
        return total


def _predict_schedule(kind: str, stages: list[ShardedStage], microbatches: int) -> Any:
    from lightning_zero.comm.pipeline import SCHEDULES

    chosen: Any = stages if kind == "interleaved_1f1b" else stages[0]
    return SCHEDULES[kind](chosen, n_microbatches=microbatches, loss_fn=None, scale_grads=False)
