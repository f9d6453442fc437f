"""The recipe's `PretrainModule` with `model.init_from=DIR` (a Hugging Face Llama) under `"zero3"` on 2 ranks:
built on the meta device as the recipe builds it, it starts from the Llama's weights. Rank 0 saves the
largest difference between the module's logits at `on_train_start` and `transformers`' own, and the
loss of one step (it trains on from there)::

    python -m tests.distributed.pretrained_fit --hf DIR --config JSON --out result.pt
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import lightning as L
import torch
import transformers
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from recipes.training import GPTConfig, OptimConfig, PretrainModule


class CompareLogits(L.Callback):
    def __init__(self, directory: str, tokens: torch.Tensor) -> None:
        self.directory, self.tokens = directory, tokens
        self.result: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with torch.no_grad():
            ours = pl_module(self.tokens)  # every rank: the units gather in their forward
            theirs = transformers.LlamaForCausalLM.from_pretrained(self.directory).eval()(self.tokens).logits
        self.result = {"max_diff": (ours - theirs).abs().max().item(), "scale": theirs.abs().max().item()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    config = GPTConfig(**json.loads(args.config), init_from=args.hf)
    tokens = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    compare = CompareLogits(args.hf, tokens)
    trainer = L.Trainer(
        strategy=lightning_zero.ZeroStrategy(stage=3, min_unit_numel=1000),
        devices=2,
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[compare],
    )
    with trainer.init_module(empty_init=True):  # as the recipe builds it under "zero3"
        module = PretrainModule(config, OptimConfig(warmup_steps=1))
    data = torch.randint(0, config.vocab_size, (8, 9), generator=torch.Generator().manual_seed(1))
    trainer.fit(module, DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=2))
    if trainer.is_global_zero:
        torch.save(compare.result, args.out)


if __name__ == "__main__":
    main()
