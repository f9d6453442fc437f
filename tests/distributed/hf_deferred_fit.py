"""Hugging Face models (``transformers``, random weights, built here) in a LightningModule on 2 ranks,
float64: built eagerly under ``"ddp"``, and built on the meta device under
``trainer.init_module(empty_init=True)`` at ``"zero3"``, where they are initialized unit by unit by
replaying the model's own ``_init_weights`` (and each layer's ``reset_parameters()``) in the order an
eager build runs them. Also ``applied``: a model whose eager build ends with ``self.apply(init)``
(nanoGPT's way), built on the meta device with ``ZeroStrategy(param_init_fn=init)``. Rank 0 saves,
per case, the full state at the start of training and after 5 steps, and at stage 3 the most
elements held full during the initialization and each unit's size::

    python -m tests.distributed.hf_deferred_fit --out result.pt
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import transformers
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from tests.distributed.deferred_fit import Record

VOCAB, SEQ = 64, 12
SMALL = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4
)
ARCHS = {
    # tied input and output embeddings: one parameter under two modules
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig, {"tie_word_embeddings": True}),
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, {"tie_word_embeddings": False}),
}


class Gain(torch.nn.Module):
    """No ``reset_parameters()``: only the ``param_init_fn`` initializes it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.empty(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def init_weights(module: torch.nn.Module) -> None:
    """nanoGPT's ``_init_weights``: normal(0, 0.02) weights, zero biases; gains of one."""
    if isinstance(module, torch.nn.Linear | torch.nn.Embedding):
        torch.nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            torch.nn.init.zeros_(module.bias)
    elif isinstance(module, Gain):
        torch.nn.init.ones_(module.gain)


class Applied(torch.nn.Module):
    """Embedding, three residual blocks, head; its eager build ends with ``self.apply(init_weights)``."""

    def __init__(self, apply: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        blocks = (torch.nn.Sequential(torch.nn.Linear(32, 32), Gain(32)) for _ in range(3))
        self.blocks = torch.nn.ModuleList(blocks)
        self.head = torch.nn.Linear(32, VOCAB)
        if apply:
            self.apply(init_weights)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


class Causal(L.LightningModule):
    def __init__(self, arch: str, meta: bool) -> None:
        super().__init__()
        if arch == "applied":
            self.model: torch.nn.Module = Applied(apply=not meta)
            return
        cls, config, extra = ARCHS[arch]
        self.model = cls(config(**SMALL, num_key_value_heads=2, max_position_embeddings=SEQ, **extra))

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens = batch[0]
        out = self.model(input_ids=tokens[:, :-1])
        logits = out if isinstance(out, torch.Tensor) else out.logits
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(arch: str, strategy: str) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    record = Record()
    init = init_weights if arch == "applied" else None
    zero = lightning_zero.ZeroStrategy(stage=3, min_unit_numel=1000, bucket_cap_mb=0.01, param_init_fn=init)
    trainer = L.Trainer(
        strategy=zero if strategy == "zero3" else "ddp",
        devices=2,
        accelerator="cpu",
        precision="64-true",
        max_steps=5,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[record],
    )
    with trainer.init_module(empty_init=strategy == "zero3"):
        model = Causal(arch, meta=strategy == "zero3")
    assert next(model.parameters()).is_meta == (strategy == "zero3")
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randint(0, VOCAB, (20, SEQ), generator=generator))
    trainer.fit(model, DataLoader(data, batch_size=2))
    out: dict[str, Any] = {
        "start": record.start,
        "end": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "buffers": {k: v.detach().clone() for k, v in model.named_buffers()},
    }
    optimizer = getattr(trainer.strategy, "sharded_optimizer", None)
    if optimizer is not None:
        engine = optimizer.engine
        out["peak"] = engine.init_peak_elements
        out["units"] = [sum(b.padded_numel for b in unit.buckets) for unit in engine.units.units]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = {f"{arch}_{s}": fit(arch, s) for arch in (*ARCHS, "applied") for s in ("ddp", "zero3")}
    if torch.distributed.get_rank() == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
