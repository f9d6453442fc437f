"""The LightningModule: parameter groups, learning-rate schedule, and a single-process fit."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from recipes.data import DataConfig, PretrainDataModule
from recipes.model import GPT, GPTConfig
from recipes.module import OptimConfig, PretrainModule, lr_factor, param_groups, peak_flops

TINY = GPTConfig(vocab_size=256, max_seq_len=32, n_layer=1, n_head=2, d_model=32)


def test_norms_biases_and_embeddings_are_not_decayed() -> None:
    model = GPT(TINY)
    decay, no_decay = param_groups(model, weight_decay=0.1, decay_embeddings=False)
    no_decay_ids = {id(p) for p in no_decay["params"]}
    assert id(model.embed.weight) in no_decay_ids  # also the tied head
    assert all(id(m.weight) in no_decay_ids for m in model.modules() if type(m).__name__ == "RMSNorm")
    assert all(p.ndim == 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    decay_all, _ = param_groups(model, 0.1, decay_embeddings=True)
    assert id(model.embed.weight) in {id(p) for p in decay_all["params"]}


def test_lr_factor_warms_up_then_follows_a_cosine_to_the_floor() -> None:
    assert lr_factor(0, 10, 110, 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 10, 110, 0.1) == pytest.approx(1.0)
    assert lr_factor(60, 10, 110, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(110, 10, 110, 0.1) == pytest.approx(0.1)
    assert lr_factor(500, 10, 110, 0.1) == pytest.approx(0.1)


def test_peak_flops_defaults() -> None:
    assert peak_flops(torch.device("cpu"), None) == pytest.approx(1.5e11)
    assert peak_flops(torch.device("cpu"), 2e12) == 2e12


def test_single_process_fit_logs_loss_throughput_and_perplexity(tmp_path: Path) -> None:
    text_dir = tmp_path / "text"
    text_dir.mkdir()
    for i in range(20):  # validation is chosen by documents
        (text_dir / f"{i}.txt").write_text(f"the quick brown fox {i} jumps over the lazy dog\n" * 10)
    data = DataConfig(path=str(text_dir), seq_len=32, batch_size=4, cache_dir=str(tmp_path / "cache"))
    optim = OptimConfig(lr=1e-2, warmup_steps=2)
    module = PretrainModule(TINY, optim)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=12,
        val_check_interval=6,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=PretrainDataModule(data))
    metrics = trainer.callback_metrics
    assert trainer.global_step == 12
    assert {"train/loss", "tokens_per_s", "mfu", "val/loss", "val/ppl", "lr"} <= set(metrics)
    assert float(metrics["val/ppl"]) == pytest.approx(math.exp(float(metrics["val/loss"])), rel=1e-3)
    assert float(metrics["train/loss"]) < math.log(256)
    assert float(metrics["tokens_per_s"]) > 0 and 0 < float(metrics["mfu"]) < 1
    expected_lr = optim.lr * lr_factor(11, optim.warmup_steps, 12, optim.min_lr_ratio)
    assert float(metrics["lr"]) == pytest.approx(expected_lr)
