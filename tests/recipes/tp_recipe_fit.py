"""The recipe under `parallelism.tensor=2` and `parallelism.tensor=1` on the same global batch, and
resumed from a tensor-parallel checkpoint, in one 2-rank launch
(`tests/recipes/test_tensor_parallel_recipe.py`).

Every run composes, validates and builds as `python -m recipes.pretrain` does (`recipes.config`), with
`callbacks=trained_samples`, then fits:

  * `tensor`: tensor 2 x data 1 with micro-batches of 4, 3 steps, the recipe's checkpoint callback
    saving every 2 steps (`<dir>/tensor/checkpoints/step000002.ckpt`) and at the end (`last.ckpt`);
  * `data`: tensor 1 x data 2 with micro-batches of 2, 3 steps;
  * `tensor_resumed`: tensor 2 from `step000002.ckpt` (the same layout) to step 3;
  * `data_resumed`: tensor 1 x data 2 from the same tensor-parallel checkpoint (each parameter joined
    whole, then sharded over 2 data-parallel ranks) to step 3.

All accumulate 2 micro-batches and clip at 1.0: 8 windows per optimizer step, the same ones
(`recipes.data.sampling`). Rank 0 saves, per run, the mean training loss of each step over every
micro-batch of every rank, the whole trained weights (a tensor-parallel run's gathered by
`unsplit_copy`), the end-of-run sample and the collectives of one forward (`CommDebugMode`) of the
first two, and the data layout the sampler used; the trained samples are in `<dir>/<run>/trained_samples`.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor.debug import CommDebugMode

from recipes.config import build_run, compose_recipe, validate
from recipes.data.resume import TrainDataResume
from recipes.pretrain import sample_text
from recipes.training.tensor_parallel import is_tensor_parallel, unsplit_copy

TENSOR = ["parallelism.tensor=2", "data.batch_size=4", "model.activation_checkpointing=true"]
DATA = ["parallelism.tensor=1", "data.batch_size=2"]
NO_CHECKPOINTS = ["trainer.enable_checkpointing=false", "callbacks.model_checkpoint=null"]
RESUME_FROM = "tensor/checkpoints/step000002.ckpt"  # under --dir
RUNS = {
    "tensor": [*TENSOR, "callbacks.model_checkpoint.every_n_train_steps=2"],
    "data": [*DATA, *NO_CHECKPOINTS],
    "tensor_resumed": [*TENSOR, *NO_CHECKPOINTS],
    "data_resumed": [*DATA, *NO_CHECKPOINTS],
}


class StepLosses(Callback):
    """Every micro-batch's training loss on this rank, by optimizer step."""

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
        "model.n_layer=2",
        "model.d_model=64",
        "model.n_head=4",
        "model.n_kv_head=2",
        "model.mlp_hidden=96",
        "model.tie_embeddings=true",
        "trainer.devices=2",
        "trainer.max_steps=3",
        "trainer.accumulate_grad_batches=2",
        "trainer.precision=64-true",
        "trainer.limit_val_batches=0",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "callbacks=trained_samples",
        "callbacks.loss_plot=null",
        "~logger",
        "optim.warmup_steps=1",
        "sample.max_new_tokens=8",
        "sample.temperature=0",
        *RUNS[run],
        *([f"ckpt_path={out_dir}/{RESUME_FROM}"] if run.endswith("_resumed") else []),
    ]


def fit(run: str, out_dir: str, cache_dir: str) -> dict[str, Any]:
    cfg = compose_recipe(overrides(run, out_dir, cache_dir))
    built = build_run(cfg, validate(cfg))
    losses = StepLosses()
    built.trainer.callbacks.append(losses)  # type: ignore[attr-defined]
    built.trainer.fit(built.module, datamodule=built.datamodule, ckpt_path=built.ckpt_path)
    model = built.module.model
    split = is_tensor_parallel(model)
    resume: TrainDataResume = built.datamodule.train_resume
    assert resume.sampler is not None
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, losses.losses)
    by_step: dict[int, list[float]] = {}
    for rank_losses in everyone:
        for step, loss in rank_losses:
            by_step.setdefault(step, []).append(loss)
    result = {
        "split": split,
        "losses": {step: sum(v) / len(v) for step, v in sorted(by_step.items())},
        "params": {
            k: v.detach().clone() for k, v in (unsplit_copy(model) if split else model).state_dict().items()
        },
        "layout": (resume.sampler.layout.world_size, resume.sampler.rank),
    }
    if run.endswith("_resumed"):
        return result
    with CommDebugMode() as comm, torch.no_grad():  # the collectives of one forward
        model(torch.zeros(2, 32, dtype=torch.long))
    result["forward_collectives"] = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    result["sample"] = sample_text(built, cfg)
    return result


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
