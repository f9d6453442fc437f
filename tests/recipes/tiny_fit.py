"""A few training steps of a tiny `PretrainModule` on random tokens, saved as a checkpoint.

Run as a script (`python -m tests.recipes.tiny_fit --strategy zero --save DIR`) for the sharded
lightning-zero layout: a "zero" strategy sets up a process group, which must not outlive a pytest
process. `fit_tiny` is also called in-process with `strategy="auto"` (an ordinary checkpoint file).
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from recipes.training.model import GPTConfig
from recipes.training.module import OptimConfig, PretrainModule

TINY = GPTConfig(vocab_size=256, max_seq_len=32, n_layer=2, n_head=4, n_kv_head=2, d_model=32, mlp_hidden=48)
"""Grouped-query attention, tied embeddings and an explicit MLP width: every mapped field is exercised."""


def quiet_trainer(**overrides: Any) -> pl.Trainer:
    """A one-process CPU Trainer without logger, checkpointing, progress bar, summary or sanity check;
    `overrides` are further (or other) `Trainer` arguments."""
    warnings.filterwarnings("ignore", message=r".*(does not have many workers|isinstance\(treespec)")
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return pl.Trainer(**{**defaults, **overrides})


def write_text_corpus(directory: Path, documents: int = 20) -> Path:
    """`documents` small text files (validation is chosen by documents, so several are needed)."""
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(documents):
        (directory / f"{i}.txt").write_text(f"the quick brown fox {i} jumps over the lazy dog\n" * 10)
    return directory


def fit_tiny(save: str, strategy: str = "auto", steps: int = 3, config: GPTConfig = TINY) -> PretrainModule:
    """Train `config` for `steps` AdamW steps on random tokens and save a checkpoint at `save`."""
    torch.manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (16, config.max_seq_len + 1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    module = PretrainModule(config, OptimConfig(lr=1e-2, warmup_steps=1))
    trainer = quiet_trainer(strategy=strategy, max_steps=steps)
    trainer.fit(module, train_dataloaders=loader)
    trainer.save_checkpoint(save)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--save", required=True)
    parser.add_argument("--strategy", default="zero")
    parser.add_argument("--params-out", help="also torch.save the trained parameters here")
    args = parser.parse_args()
    module = fit_tiny(args.save, args.strategy)
    if args.params_out:
        torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, args.params_out)


if __name__ == "__main__":
    main()
