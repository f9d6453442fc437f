"""2-rank fits of the recipe's `PretrainModule` with and without `model.compile_blocks`, for
`tests/recipes/test_compile_blocks.py`.

Each case trains the same tiny GPT (float32) on the same tokens under `ZeroStrategy(stage=2 or 3)`; at
stage 3 every `Block` is a unit (`unit_modules`), so its forward pre/post hooks gather and free its
parameters around the compiled forward, and again for the recomputation of activation checkpointing.
Every fit records per-step losses, the final `state_dict` (stage 3 gathers it on request), how many
graphs dynamo had compiled after each step, how often a compiled block forward ran, and how many
forward hooks the blocks carry.

Run as a script; the cases run in order on every rank (each saves `<--out>.rank<R>`)::

    python -m tests.recipes.compile_fit --out result.pt --cases '[{"stage": 3, "compile_blocks": true}]'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import recipes.training.model
from recipes.training.model import Block, GPTConfig
from recipes.training.module import OptimConfig, PretrainModule

TINY = GPTConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32, mlp_hidden=48)
STEPS, BATCH_PER_RANK = 4, 2


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far, every fit included (a recompilation adds one)."""
    return int(counters["stats"]["unique_graphs"])


def counting_compiled_layers(count: list[int]) -> Callable[[str], Callable[..., torch.Tensor]]:
    """A stand-in for `recipes.training.model.compiled_layers` (which `Block.forward` looks up at every
    call) that adds one to `count[0]` whenever a compiled block forward runs."""
    original = recipes.training.model.compiled_layers

    def counting(backend: str) -> Callable[..., torch.Tensor]:
        compiled = original(backend)

        def call(*args: Any, **kwargs: Any) -> torch.Tensor:
            count[0] += 1
            return compiled(*args, **kwargs)

        return call

    return counting


class Record(pl.Callback):
    """Per-step loss and compiled-graph count, and the blocks' forward hooks at the start of training."""

    reads_parameters_between_steps = False  # stage 3 refuses batch-end hooks that might read parameters

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.graphs: list[int] = []
        self.block_hooks: list[int] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        blocks = [m for m in pl_module.modules() if isinstance(m, Block)]
        self.block_hooks = [len(b._forward_pre_hooks) + len(b._forward_hooks) for b in blocks]

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))
        self.graphs.append(compiled_graphs())


def fit(calls: list[int], stage: int, activation_checkpointing: bool, compile_blocks: bool) -> dict[str, Any]:
    """`STEPS` AdamW steps of `TINY` on 2 CPU ranks under ZeRO `stage`, compiled with "aot_eager";
    `calls`: the counter of `counting_compiled_layers`."""
    from lightning_zero import ZeroStrategy

    warnings.filterwarnings("ignore", message=r".*(does not have many workers|isinstance\(treespec)")
    config = dataclasses.replace(
        TINY,
        activation_checkpointing=activation_checkpointing,
        compile_blocks=compile_blocks,
        compile_backend="aot_eager",
    )
    torch.manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2 * BATCH_PER_RANK * STEPS, config.max_seq_len + 1))
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    record = Record()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ZeroStrategy(stage=stage, unit_modules=(Block,))
        if stage == 3
        else ZeroStrategy(stage=stage),
        precision="32-true",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=[record],
    )
    # unshuffled: rank r trains rows r::2, the same rows in every fit
    sampler: DistributedSampler[Any] = DistributedSampler(
        data, num_replicas=2, rank=trainer.global_rank, shuffle=False
    )
    module = PretrainModule(config, OptimConfig(lr=1e-2, warmup_steps=1))
    calls_before = calls[0]
    trainer.fit(module, DataLoader(data, batch_size=BATCH_PER_RANK, sampler=sampler))
    return {
        "compiled_calls": calls[0] - calls_before,
        "losses": record.losses,
        "graphs": record.graphs,
        "block_hooks": record.block_hooks,
        "state": {k: v.detach().clone() for k, v in module.state_dict().items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True, help="JSON list of keyword-argument dicts for fit()")
    args = parser.parse_args()
    torch.set_num_threads(1)
    calls = [0]
    recipes.training.model.compiled_layers = counting_compiled_layers(calls)  # type: ignore[assignment]
    results: list[Any] = []
    for case in json.loads(args.cases):
        try:
            results.append(fit(calls, **case))
        except Exception as error:  # noqa: BLE001 - reported to the test, which names the case
            results.append({"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()})
    torch.save(results, f"{args.out}.rank{os.environ.get('LOCAL_RANK', 0)}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
