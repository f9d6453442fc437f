"""The recipe under `parallelism.tensor=2` and `parallelism.tensor=1` on the same global batch, in one
2-rank launch (`tests/recipes/test_tensor_parallel_recipe.py`).

Both runs compose, validate and build as `python -m recipes.pretrain` does (`recipes.config`), then fit:
tensor 2 x data 1 with micro-batches of 4, and tensor 1 x data 2 with micro-batches of 2, both
accumulating 2 micro-batches and clipping at 1.0: 8 windows per optimizer step, the same ones
(`recipes.data.sampling`). Rank 0 saves, per run, the mean training loss of each step over every
micro-batch of every rank, the whole trained weights (the tensor-parallel run's gathered by
`unsplit_copy`), the end-of-run sample, the collectives of one forward (`CommDebugMode`) and the data
layout the sampler used.
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

RUNS = {
    "tensor": ["parallelism.tensor=2", "data.batch_size=4", "model.activation_checkpointing=true"],
    "data": ["parallelism.tensor=1", "data.batch_size=2"],
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
        "trainer.enable_checkpointing=false",
        "callbacks.model_checkpoint=null",
        "callbacks.loss_plot=null",
        "~logger",
        "optim.warmup_steps=1",
        "sample.max_new_tokens=8",
        "sample.temperature=0",
        *RUNS[run],
    ]


def fit(run: str, out_dir: str, cache_dir: str) -> dict[str, Any]:
    cfg = compose_recipe(overrides(run, out_dir, cache_dir))
    built = build_run(cfg, validate(cfg))
    losses = StepLosses()
    built.trainer.callbacks.append(losses)  # type: ignore[attr-defined]
    built.trainer.fit(built.module, datamodule=built.datamodule)
    model = built.module.model
    split = is_tensor_parallel(model)
    with CommDebugMode() as comm, torch.no_grad():  # the collectives of one forward
        model(torch.zeros(2, 32, dtype=torch.long))
    whole = unsplit_copy(model) if split else model
    resume: TrainDataResume = built.datamodule.train_resume
    assert resume.sampler is not None
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, losses.losses)
    by_step: dict[int, list[float]] = {}
    for rank_losses in everyone:
        for step, loss in rank_losses:
            by_step.setdefault(step, []).append(loss)
    return {
        "split": split,
        "losses": [sum(v) / len(v) for _, v in sorted(by_step.items())],
        "params": {k: v.detach().clone() for k, v in whole.state_dict().items()},
        "sample": sample_text(built, cfg),
        "forward_collectives": {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()},
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
