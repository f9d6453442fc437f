"""Trainer fits of a pipelined LightningModule on 4 CPU ranks, launched by
``tests/distributed/test_pipeline_trainer.py``: ``ZeroStrategy(pipeline_parallel_size=P)`` at each stage
and schedule, then ``validate`` and ``predict`` through the pipeline, and the refusals. Every rank
reports its stage's parameters, the samples it trained on and the losses the strategy returned; rank 0
saves them all."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EMAWeightAveraging
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from lightning_zero.integrations.trainer.step_profile import StepProfiler
from tests.distributed.workers_tp import full_parameters

WIDTH, LAYERS, SAMPLES, BATCH, STEPS, ACCUM, CLIP, LR = 8, 4, 64, 4, 3, 2, 0.5, 0.05


def dataset(seed: int = 7) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randn(SAMPLES, WIDTH, generator=g, dtype=torch.float64)
    return TensorDataset(
        inputs, torch.randn(SAMPLES, WIDTH, generator=g, dtype=torch.float64), torch.arange(SAMPLES)
    )


class PipelineModule(pl.LightningModule):
    """``LAYERS`` blocks (a linear layer and a tanh), the mean squared error; ``pipeline_layers()`` the
    blocks. ``training_step`` is the unsplit model's (the strategy does not call it under a pipeline)."""

    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(layers))
        self.seen: list[torch.Tensor] = []
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.blocks)

    def pipeline_batch(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return batch[0], batch[1]

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        return self.pipeline_loss(self(batch[0]), batch[1])

    def validation_step(self, batch: Any, index: int) -> torch.Tensor:  # Lightning checks it is defined
        return self.pipeline_loss(self(batch[0]), batch[1])

    def on_train_batch_end(self, outputs: Any, batch: Any, index: int) -> None:
        self.seen.append(batch[2].clone())  # which samples this rank's data-parallel rank trained on
        self.losses.append(float(outputs["loss"]))

    def on_validation_batch_end(self, outputs: Any, batch: Any, index: int, dataloader_idx: int = 0) -> None:
        self.val_losses.append(float(outputs))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)


class GroupedLayers(PipelineModule):
    """``pipeline_layers()`` of groups: blocks 0 and 1's modules as one layer, then blocks 2 and 3's
    each (two stages: blocks 0-2 on the first, 3 on the second)."""

    def pipeline_layers(self) -> list[Any]:
        return [[*self.blocks[0], *self.blocks[1]], list(self.blocks[2]), list(self.blocks[3])]


class TensorParallelBlocks(PipelineModule):
    """Each block a column- then row-parallel pair over ``self.device_mesh["tensor_parallel"]`` (what a
    ``ModelParallelStrategy`` user's ``configure_model`` does)."""

    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__(layers)
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(wide_block() for _ in range(layers))

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for block in self.blocks:
            if isinstance(block, nn.Sequential):  # this rank's stages' blocks (the others are gone)
                plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
                parallelize_module(block, self.device_mesh["tensor_parallel"], plan)


def wide_block() -> nn.Sequential:
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH))


class ManualModule(PipelineModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class StrayParameter(PipelineModule):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))  # in no layer


class TiedStages(PipelineModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks[-1][0].weight = self.blocks[0][0].weight  # the first and the last stage


def _trainer(strategy: Any, **kwargs: Any) -> pl.Trainer:
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 4,
        "max_steps": STEPS,
        "accumulate_grad_batches": ACCUM,
        "gradient_clip_val": CLIP,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    return pl.Trainer(strategy=strategy, **{**settings, **kwargs})


def _strategy(case: dict[str, Any]) -> lightning_zero.ZeroStrategy:
    stage = case.get("stage", 2)
    units = {"min_unit_numel": 1} if stage == 3 else {}  # every block a unit of its own
    return lightning_zero.ZeroStrategy(
        stage=stage,
        **units,
        pipeline_parallel_size=case.get("pipeline", 2),
        pipeline_schedule=case.get("schedule", "1f1b"),
        pipeline_microbatches=case.get("microbatches", BATCH),
        pipeline_virtual_stages=case.get("virtual", 1),
        tensor_parallel_size=case.get("tensor", 1),
        bucket_cap_mb=0.0002,
        reduce_dtype=case.get("wire"),
        gather_dtype=case.get("wire") if stage == 3 else None,
        profile_steps=(1, 2) if case.get("profile") else None,
    )


def fit(case: dict[str, Any], root: str) -> dict[str, Any]:
    """One fit, then (``evaluate``) a validation and a prediction through the pipeline; ``root``: the
    Trainer's directory (a profile's file goes there)."""
    strategy = _strategy(case)
    averaging = [EMAWeightAveraging(decay=case["ema"])] if "ema" in case else []
    accumulate = {"accumulate_grad_batches": case["accum"]} if "accum" in case else {}
    trainer = _trainer(strategy, callbacks=averaging, default_root_dir=root, **accumulate)
    kind = TensorParallelBlocks if case.get("tensor", 1) > 1 else PipelineModule
    kind = GroupedLayers if case.get("grouped") else kind
    torch.manual_seed(0)  # where a deferred build's initialization starts (init_module's entry)
    with trainer.init_module(empty_init=True) if case.get("deferred") else contextlib.nullcontext():
        module = kind(layers=case.get("layers", LAYERS))
    held = DataLoader(dataset(seed=8), batch_size=BATCH)
    if case.get("evaluate"):  # the evaluation schedule made before fit, used again after it
        trainer.validate(module, held, verbose=False)
    before, module.val_losses = module.val_losses, []
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    engine = strategy.sharded_optimizer.engine
    sent = engine.comm.stats.elements_sent  # the step's collectives of this stage's data-parallel ranks
    stage3 = case.get("stage", 2) == 3
    with lightning_zero.gathered(module) if stage3 else contextlib.nullcontext():
        params = full_parameters(module)
    out: dict[str, Any] = {
        "params": params,
        "seen": torch.stack(module.seen),
        "losses": module.losses,
        "engine_numel": sum(b.numel for b in engine.plan.buckets),  # planned here
        "sent": sent,
        "padded": sum(b.padded_numel for b in engine.plan.buckets),
    }
    if case.get("profile"):  # every rank's report (no logger: no file)
        out["profile"] = next(c for c in trainer.callbacks if isinstance(c, StepProfiler)).report
    if case.get("evaluate"):
        trainer.validate(module, held, verbose=False)
        out["val_losses"], out["val_before"] = module.val_losses, before
        predictions = trainer.predict(module, held)
        out["predictions"] = None if predictions[0] is None else torch.cat(predictions)  # type: ignore[arg-type]
    return out


REFUSALS: dict[str, Any] = {
    "manual": lambda: (ManualModule(), {}),
    "stray": lambda: (StrayParameter(), {}),
    "tied": lambda: (TiedStages(), {}),
    "batch": lambda: (PipelineModule(), {"microbatches": 3}),  # 3 does not divide the batch of 4
}


def refused(name: str) -> str:
    """The message a refused setting raises (on every rank), or ``""`` if it ran."""
    module, settings = REFUSALS[name]()
    microbatches = settings.pop("microbatches", BATCH)
    plain = {"max_steps": 1, "gradient_clip_val": None, "accumulate_grad_batches": 1}  # manual optimization
    trainer = _trainer(_strategy({"microbatches": microbatches}), **{**plain, **settings})
    try:
        trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    except ValueError as error:
        return str(error)
    return ""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True)
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    cases = json.loads(args.cases)
    root = os.path.dirname(os.path.abspath(args.out))
    results: dict[str, Any] = {case["name"]: fit(case, root) for case in cases if "refuse" not in case}
    results.update({case["name"]: refused(case["refuse"]) for case in cases if "refuse" in case})
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, results)
    if dist.get_rank() == 0:
        torch.save(everyone, args.out)


if __name__ == "__main__":
    main()
