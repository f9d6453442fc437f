"""Sharded checkpoints of pipelined Trainer fits on 4 CPU ranks, launched by
``tests/distributed/test_pipeline_checkpoints.py``: one training run in four fits, each resumed from the
checkpoint its predecessor's ``ModelCheckpoint`` wrote, across layouts:

  a. pipeline 2 x data 2 at stage 2, steps 0 -> 2 (the checkpoint the test consolidates);
  b. pipeline 2 x data 2 at stage 3, steps 2 -> 4 (the same pipeline layout: each stage its own files),
     saved in the background (``async_checkpoint=True``);
  c. no pipeline, data 4 at stage 2 (the unsplit model), steps 4 -> 6 (P=2 read into P=1);
  d. pipeline 2 x data 2 at stage 1, interleaved (two one-block stages per rank: blocks 0 and 2 on the
     first pipeline rank), steps 6 -> 8 (P=1 read into P=2).

Each block of the model holds a buffer that fit a sets and the later fits must load (a fresh module has
zeros). Then ``validate(ckpt_path=...)`` of a zeroed module at pipeline 2 reads fit b's checkpoint (each
stage its whole parameters, without an optimizer), and three fits run under ``EMAWeightAveraging`` with
buffers that drift as they train: one saved at step 2, one resumed from it to step 4, one unbroken to
step 4; and the same three at pipeline 2 x tensor 2, stage 3. Every rank reports the parameters it
holds at the end of each fit and the samples it trained on; rank 0 saves them all with the checkpoint
paths."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

import lightning_zero
from tests.distributed.pp_fit import PipelineModule

WIDTH, LAYERS, SAMPLES, BATCH, ACCUM, CLIP, LR = 4, 4, 32, 4, 2, 0.5, 0.05
FITS = [  # name, pipeline size, ZeRO stage, last step, stages per pipeline rank
    ("a", 2, 2, 2, 1),
    ("b", 2, 3, 4, 1),
    ("c", 1, 2, 6, 1),
    ("d", 2, 1, 8, 2),
]


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    inputs = torch.randn(SAMPLES, WIDTH, generator=g, dtype=torch.float64)
    targets = torch.randn(SAMPLES, WIDTH, generator=g, dtype=torch.float64)
    return TensorDataset(inputs, targets, torch.arange(SAMPLES))


def shifts() -> list[torch.Tensor]:
    """The buffer of each block that the first fit trains with (a fresh module holds zeros)."""
    return [torch.full((WIDTH,), 0.1 * (i + 1), dtype=torch.float64) for i in range(LAYERS)]


class Block(nn.Module):
    shift: torch.Tensor

    def __init__(self, drift: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("shift", torch.zeros(WIDTH))
        self.register_buffer("gain", torch.ones(WIDTH), persistent=False)  # as rotary embeddings' tables
        self.drift = drift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.drift:  # a buffer that changes as it trains, as a running mean does
            self.shift.add_(self.drift)
        return torch.tanh(self.linear(x)) * self.gain + self.shift  # gain: saved for the backward


class CheckpointModule(PipelineModule):
    """``LAYERS`` blocks with a buffer each, and the Trainer pipeline test's hooks and loss
    (:class:`tests.distributed.pp_fit.PipelineModule`); ``training_step`` is the unsplit model's (a fit
    without a pipeline calls it)."""

    def __init__(self, drift: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(drift * (i + 1)) for i in range(LAYERS))


def _trainer(strategy: Any, steps: int, root: Path, *callbacks: Any, clip: float | None = CLIP) -> pl.Trainer:
    """A 4-rank fit to ``steps`` whose ModelCheckpoint (the first callback) saves into ``root`` every 2
    steps, accumulating ``ACCUM`` batches, clipping at ``clip``."""
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=4,
        max_steps=steps,
        accumulate_grad_batches=ACCUM,
        gradient_clip_val=clip,
        callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=1), *callbacks],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def _saved(trainer: pl.Trainer) -> str:
    """The checkpoint the fit's ModelCheckpoint saved last."""
    return trainer.checkpoint_callback.best_model_path  # type: ignore[union-attr]


def fit(
    name: str, pipeline: int, stage: int, steps: int, virtual: int, root: Path, resume: str | None
) -> dict[str, Any]:
    """One fit to ``steps``, resumed from ``resume``; its ModelCheckpoint saves at its last step."""
    options: dict[str, Any] = {"stage": stage, "bucket_cap_mb": 0.0001, "async_checkpoint": name == "b"}
    if pipeline > 1:
        options.update(pipeline_parallel_size=pipeline, pipeline_microbatches=2)
    if virtual > 1:
        options.update(pipeline_schedule="interleaved_1f1b", pipeline_virtual_stages=virtual)
    strategy = lightning_zero.ZeroStrategy(**options)
    trainer = _trainer(strategy, steps, root / name)
    module = CheckpointModule()
    if resume is None:
        with torch.no_grad():
            for block, shift in zip(module.blocks, shifts(), strict=True):
                block.get_buffer("shift").copy_(shift)
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH), ckpt_path=resume)
    with lightning_zero.gathered(module) if stage == 3 else contextlib.nullcontext():
        params = {n: p.detach().clone() for n, p in module.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in module.named_buffers() if n.endswith("shift")}
    path = _saved(trainer)
    assert path, f"fit {name}: ModelCheckpoint saved nothing"
    writer = strategy._async_writer  # its own process group exists once it wrote in the background
    background = writer is not None and writer._comm is not None
    return {
        "params": params,
        "buffers": buffers,
        "seen": torch.stack(module.seen),
        "path": path,
        "background": background,
    }


def averaged(steps: int, root: Path, resume: str | None) -> dict[str, Any]:
    """A fit at pipeline 2 x data 2, stage 2, under ``EMAWeightAveraging`` (drifting buffers: their
    average differs from them), to ``steps``, resumed from ``resume``; it saves at its last step. Its
    parameters and buffers at the end are the averages."""
    strategy = lightning_zero.ZeroStrategy(
        stage=2, bucket_cap_mb=0.0001, pipeline_parallel_size=2, pipeline_microbatches=2
    )
    trainer = _trainer(strategy, steps, root, EMAWeightAveraging(decay=0.5), clip=None)
    module = CheckpointModule(drift=0.01)
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH), ckpt_path=resume)
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in module.named_buffers() if n.endswith("shift")}
    return {"params": params, "buffers": buffers, "path": _saved(trainer)}


def tensor_parallel(steps: int, root: Path, resume: str | None) -> dict[str, Any]:
    """A fit at pipeline 2 x tensor 2 (the Trainer pipeline test's column- then row-parallel blocks),
    stage 3, to ``steps``, resumed from ``resume``; it saves at its last step. Every parameter whole
    at the end (a collective over the tensor-parallel group)."""
    from tests.distributed import pp_fit
    from tests.distributed.workers_tp import full_parameters

    strategy = lightning_zero.ZeroStrategy(
        stage=3,
        min_unit_numel=1,
        bucket_cap_mb=0.0001,
        pipeline_parallel_size=2,
        pipeline_microbatches=2,
        tensor_parallel_size=2,
    )
    trainer = _trainer(strategy, steps, root)
    module = pp_fit.TensorParallelBlocks()
    epoch = Subset(pp_fit.dataset(), range(2 * ACCUM * pp_fit.BATCH))  # 2 steps: it saves at an epoch's end
    trainer.fit(module, DataLoader(epoch, batch_size=pp_fit.BATCH), ckpt_path=resume)
    with lightning_zero.gathered(module):
        params = full_parameters(module)
    return {"params": params, "path": _saved(trainer)}


def validated(path: str) -> dict[str, Any]:
    """A zeroed module's parameters and buffers after ``validate(ckpt_path=path)`` at pipeline 2."""
    strategy = lightning_zero.ZeroStrategy(stage=2, pipeline_parallel_size=2, pipeline_microbatches=2)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=4,
        limit_val_batches=1,
        logger=False,
        enable_progress_bar=False,
    )
    module = CheckpointModule()
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
    trainer.validate(module, DataLoader(dataset(), batch_size=BATCH), ckpt_path=path, verbose=False)
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in module.named_buffers() if n.endswith("shift")}
    return {"params": params, "buffers": buffers}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    root = Path(args.out).parent / "checkpoints"
    results: dict[str, Any] = {}
    resume = None
    for name, pipeline, stage, steps, virtual in FITS:
        results[name] = fit(name, pipeline, stage, steps, virtual, root, resume)
        resume = results[name]["path"]
    results["validated"] = validated(results["b"]["path"])
    first = averaged(2, root / "averaged", None)  # the average of each stage's buffers saved and resumed
    sliced = tensor_parallel(2, root / "tensor", None)  # each stage's tensor-parallel shards saved, resumed
    results["tensor"] = {
        "saved": sliced,
        "resumed": tensor_parallel(4, root / "tensor-resumed", sliced["path"]),
        "unbroken": tensor_parallel(4, root / "tensor-unbroken", None),
    }
    results["averaged"] = {
        "resumed": averaged(4, root / "resumed", first["path"]),
        "unbroken": averaged(4, root / "unbroken", None),
    }
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, results)
    if dist.get_rank() == 0:
        torch.save(everyone, args.out)


if __name__ == "__main__":
    main()
