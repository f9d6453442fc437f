"""The recipe under `parallelism.pipeline=2` and `parallelism.pipeline=1` on the same global batch, in one
2-rank launch (`tests/recipes/test_pipeline_recipe.py`).

Every run composes, validates and builds as `python -m recipes.pretrain` does (`recipes.config`), with
the CSV logger (every step) and `callbacks=trained_samples`, then fits 3 steps of 2 accumulated
micro-batches, clipped at 1.0, validating 2 batches after step 2 and at the end, then draws the
end-of-run greedy sample:

  * `data`: pipeline 1 x data 2, batches of 2 windows;
  * `pipeline`: pipeline 2 x data 1, batches of 4 windows cut into 2 micro-batches (1F1B), ZeRO stage 3
    (built with values: the strategy drops the other stage's layers) and activation checkpointing,
    with the recipe's checkpoint series (after step 2, and `last` at the end);
  * `interleaved`: pipeline 2 x data 1 with 2 virtual stages per rank (`interleaved_1f1b`), stage 2;
  * `resumed`, `resumed_unsplit`: the `pipeline` run's step-2 checkpoint resumed for its last step, as
    `pipeline` and as `data`.

The others run without checkpoints. All train 8 windows per optimizer step, the same ones
(`recipes.data.sampling`). Rank 0 saves, per run, every rank's training loss of each micro-batch
(Lightning's `outputs["loss"]`), the rows of `metrics.csv`, the whole trained weights (`unsplit_copy`: a
pipeline run's stages gathered), the sample, the parameters each rank held, the data layout its sampler
used, and for `pipeline` what its checkpoints hold (`saved_checkpoints`).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_zero.checkpoint import read_meta
from recipes.checkpoints.load import load_module
from recipes.config import build_run, compose_recipe, validate
from recipes.data.module import PretrainDataModule
from recipes.data.resume import TrainDataResume
from recipes.pretrain import sample_text
from recipes.training.tensor_parallel import unsplit_copy

PIPELINE = ["parallelism.pipeline=2", "parallelism.microbatches=2", "data.batch_size=4"]
NO_CHECKPOINTS = ["trainer.enable_checkpointing=false", "callbacks.model_checkpoint=null"]
DATA = ["parallelism.pipeline=1", "data.batch_size=2"]
ONE_F_ONE_B = [*PIPELINE, "strategy=zero3", "model.activation_checkpointing=true"]
SAVED = "pipeline/checkpoints/step000002.ckpt"
"""The `pipeline` run's checkpoint after step 2 (the recipe's series: `every_n_train_steps=2`)."""
RUNS = {
    "data": [*DATA, *NO_CHECKPOINTS],
    "pipeline": [*ONE_F_ONE_B, "callbacks.model_checkpoint.every_n_train_steps=2"],
    "interleaved": [
        *PIPELINE,
        "parallelism.schedule=interleaved_1f1b",
        "parallelism.virtual_stages=2",
        *NO_CHECKPOINTS,
    ],
    "resumed": [*ONE_F_ONE_B, *NO_CHECKPOINTS, f"ckpt_path={{dir}}/{SAVED}"],
    "resumed_unsplit": [*DATA, *NO_CHECKPOINTS, f"ckpt_path={{dir}}/{SAVED}"],
}
"""`resumed`: the `pipeline` run again from its step-2 checkpoint, in its layout; `resumed_unsplit`: the
same checkpoint resumed as the `data` run (pipeline 2 -> 1, ZeRO stage 3 -> 2, data-parallel 1 -> 2)."""


class MicroBatchLosses(Callback):
    """This rank's `outputs["loss"]` of every training micro-batch, as `(step, loss)`."""

    def __init__(self) -> None:
        self.losses: list[tuple[int, float]] = []
        self._step = 0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step = trainer.global_step  # the step this micro-batch is part of

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append((self._step, float(outputs["loss"])))


def overrides(run: str, out_dir: str, cache_dir: str) -> list[str]:
    return [
        f"hydra.run.dir={out_dir}/{run}",
        f"data.cache_dir={cache_dir}",
        "data.max_corpus_mb=0.1",
        "data.seq_len=32",
        "model.n_layer=4",  # 2 blocks per stage, 1 per interleaved stage (2 per rank)
        "model.d_model=64",
        "model.n_head=4",
        "model.n_kv_head=2",
        "model.mlp_hidden=96",
        "model.tie_embeddings=false",
        "trainer.devices=2",
        "trainer.max_steps=3",
        "trainer.accumulate_grad_batches=2",
        "trainer.precision=64-true",
        "trainer.val_check_interval=4",  # in batches: after step 2, and at the end
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "callbacks=trained_samples",
        "callbacks.loss_plot=null",
        "optim.warmup_steps=1",
        "sample.max_new_tokens=8",
        "sample.temperature=0",
        *(setting.format(dir=out_dir) for setting in RUNS[run]),
    ]


def metric_rows(run_dir: Path) -> list[dict[str, str]]:
    (path,) = run_dir.glob("logs/version_*/metrics.csv")
    with path.open() as handle:
        return list(csv.DictReader(handle))


def saved_checkpoints(run_dir: Path) -> dict[str, Any]:
    """What the `pipeline` run's checkpoints hold, read as the recipe reads them: the data position of
    the step-2 checkpoint, and the whole model of `last` (`recipes.checkpoints.load_module`: the
    stages' files joined, what export, generate and evaluate read)."""
    meta = read_meta(run_dir / "checkpoints" / Path(SAVED).name)
    last = load_module(run_dir / "checkpoints" / "last.ckpt")
    return {
        "position": meta["lightning"][PretrainDataModule.__qualname__]["position"],
        "last": {k: v.detach().clone() for k, v in last.model.state_dict().items()},
    }


def fit(run: str, out_dir: str, cache_dir: str) -> dict[str, Any]:
    cfg = compose_recipe(overrides(run, out_dir, cache_dir))
    built = build_run(cfg, validate(cfg))
    losses = MicroBatchLosses()
    built.trainer.callbacks.append(losses)  # type: ignore[attr-defined]
    built.trainer.fit(built.module, datamodule=built.datamodule, ckpt_path=built.ckpt_path)
    module = built.module
    pipeline = module.device_mesh["pipeline_parallel"] if module.pipelined else None  # type: ignore[index]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, losses.losses)
    held: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(held, sorted(name for name, _ in module.model.named_parameters()))
    resume: TrainDataResume = built.datamodule.train_resume
    assert resume.sampler is not None
    params = (unsplit_copy(module.model, pipeline) if pipeline is not None else module.model).state_dict()
    sample = sample_text(built, cfg)
    dist.barrier()  # rank 0's metrics.csv is complete; every rank's checkpoint written
    saved = run == "pipeline" and dist.get_rank() == 0
    return {
        "checkpoints": saved_checkpoints(built.run_dir) if saved else None,
        "pipelined": module.pipelined,
        "losses": everyone,
        "metrics": metric_rows(built.run_dir) if dist.get_rank() == 0 else None,
        "params": {k: v.detach().clone() for k, v in params.items()},
        "held": held,
        "sample": sample,
        "layout": (resume.sampler.layout.world_size, resume.sampler.rank),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    results = {run: fit(run, args.dir, f"{args.dir}/cache") for run in RUNS}
    layouts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, {run: r.pop("layout") for run, r in results.items()})
    if dist.get_rank() == 0:
        torch.save({"results": results, "layouts": layouts}, args.out)


if __name__ == "__main__":
    main()
