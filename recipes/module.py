"""LightningModule for next-token pretraining: loss, perplexity, AdamW with warmup + cosine, throughput.

Optimizer: a plain `torch.optim.AdamW` with two parameter groups - weight decay on matrices, none on
norm weights, biases and (unless `optim.decay_embeddings`) the embedding table, which with tied
embeddings is also the head. A ZeRO strategy turns this ordinary optimizer into its sharded form; the
module never sees the difference. The learning rate follows a `LambdaLR` stepped every optimizer step:
linear warmup over `optim.warmup_steps`, then a cosine from `optim.lr` down to
`optim.lr * optim.min_lr_ratio` at the trainer's last step.

Throughput: `tokens_per_s` is the global rate (this rank's tokens x world size, over the wall time
between two consecutive training steps, smoothed), shown on the progress bar. `mfu` (model FLOPs
utilisation) = `GPT.flops_per_token` x tokens/s / (peak FLOP/s per device x world size). The peak comes
from `peak_flops_per_device`; when it is null the module uses `DEFAULT_CPU_PEAK_FLOPS` on CPU (about one
AVX-512 core's fp32 matmul rate measured on the development machine: 1.5e11) and, on GPU, a small table
of dense bf16 peaks keyed by device name; an unknown GPU logs no MFU.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.text import Perplexity

import lightning_zero  # noqa: F401  (load_from_checkpoint reads sharded checkpoint directories)
from recipes.model import GPT, GPTConfig

DEFAULT_CPU_PEAK_FLOPS = 1.5e11
"""FLOP/s assumed per CPU process when `peak_flops_per_device` is null (one core, fp32, AVX-512 FMA)."""

GPU_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
}
"""Dense bf16 tensor-core peaks (vendor data sheets), matched as substrings of the CUDA device name."""


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW and learning-rate schedule settings."""

    lr: float = 3e-3
    """Peak learning rate, reached at the end of warmup."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of `lr`."""
    warmup_steps: int = 50
    """Optimizer steps of linear warmup from 0."""
    weight_decay: float = 0.1
    """Decoupled weight decay for the decay group."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam moment coefficients."""
    eps: float = 1e-8
    """Adam epsilon."""
    decay_embeddings: bool = False
    """Put the embedding table (and a tied head) in the decay group."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))  # YAML gives a list
        if self.lr <= 0 or not 0.0 <= self.min_lr_ratio <= 1.0 or self.warmup_steps < 0:
            raise ValueError("optim.lr must be > 0, optim.min_lr_ratio in [0, 1], optim.warmup_steps >= 0")
        if self.weight_decay < 0 or len(self.betas) != 2:
            raise ValueError("optim.weight_decay must be >= 0 and optim.betas a pair")


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based): warmup, then cosine."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float, decay_embeddings: bool) -> list[dict[str, Any]]:
    """Split parameters into a decayed group (matrices) and an undecayed one (norms, biases, embeddings)."""
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for param in model.parameters():  # shared (tied) tensors appear once
        if not param.requires_grad:
            continue
        is_embedding = id(param) in embedding_ids
        if param.ndim >= 2 and (decay_embeddings or not is_embedding):
            decay.append(param)
        else:
            no_decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def peak_flops(device: torch.device, configured: float | None) -> float | None:
    """Peak FLOP/s of one device: the configured figure, else a default for CPU or a known GPU."""
    if configured is not None:
        return configured
    if device.type == "cpu":
        return DEFAULT_CPU_PEAK_FLOPS
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((flops for key, flops in GPU_PEAK_FLOPS.items() if key in name), None)
    return None


class PretrainModule(pl.LightningModule):
    """Next-token language modelling of a `GPT` built from `model_config`.

    The hyper-parameters are saved in every checkpoint as plain dicts (what `torch.load(weights_only=True)`
    reads, as lightning-zero's sharded `meta.pt` is), so `PretrainModule.load_from_checkpoint(path)` needs
    no arguments, for a checkpoint file and for a sharded checkpoint directory alike.
    """

    def __init__(
        self,
        model_config: GPTConfig | dict[str, Any],
        optim: OptimConfig | dict[str, Any],
        peak_flops_per_device: float | None = None,
    ) -> None:
        super().__init__()
        if isinstance(model_config, dict):  # from a checkpoint's hyper-parameters
            model_config = GPTConfig(**model_config)
        if isinstance(optim, dict):
            optim = OptimConfig(**optim)
        # The loggers get the whole resolved config from `recipes.build`; these are for checkpoints.
        self.save_hyperparameters(
            {
                "model_config": asdict(model_config),
                "optim": asdict(optim),
                "peak_flops_per_device": peak_flops_per_device,
            },
            logger=False,
        )
        self.model_config = model_config
        self.optim_config = optim
        self.peak_flops_per_device = peak_flops_per_device
        self.model = GPT(model_config)
        self.val_perplexity = Perplexity()
        self._step_started: float | None = None
        self._tokens_per_s: float | None = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def on_train_start(self) -> None:
        scheduler = self.lr_schedulers()
        if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) and scheduler.last_epoch > 0:
            # A restored optimizer carries the lr of the previous command's schedule; recompute it in case
            # max_steps changed, so the first resumed step already follows the new cosine.
            groups = scheduler.optimizer.param_groups
            for group, base_lr, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
                group["lr"] = base_lr * factor(scheduler.last_epoch)
        if self.trainer.is_global_zero:  # after a resume this shows the restored step
            params = self.model.num_params()
            print(f"training {params / 1e6:.2f}M parameters from global step {self.trainer.global_step}")

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch  # each (B, T)
        loss = self._loss(self(inputs), targets)
        self.log("train/loss", loss, prog_bar=True)
        self._log_throughput(inputs.numel(), inputs.shape[1])
        return loss

    def _log_throughput(self, local_tokens: int, seq_len: int) -> None:
        now = time.perf_counter()
        started, self._step_started = self._step_started, now
        self.log("lr", self.optimizers().param_groups[0]["lr"], prog_bar=False)  # type: ignore[union-attr]
        if started is None:
            return  # the first step includes start-up costs; no rate yet
        rate = local_tokens * self.trainer.world_size / (now - started)
        self._tokens_per_s = rate if self._tokens_per_s is None else 0.8 * self._tokens_per_s + 0.2 * rate
        self.log("tokens_per_s", self._tokens_per_s, prog_bar=True)
        peak = peak_flops(self.device, self.peak_flops_per_device)
        if peak is not None:
            flops_per_s = self.model.flops_per_token(seq_len) * self._tokens_per_s
            self.log("mfu", flops_per_s / (peak * self.trainer.world_size))

    def on_validation_epoch_start(self) -> None:
        self._step_started = None  # validation time must not count as one slow training step

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        logits = self(inputs)
        self.val_perplexity.update(logits.float(), targets)
        self.log("val/loss", self._loss(logits, targets), sync_dist=True)
        # Logging the metric object lets Lightning compute it across ranks and reset it per epoch.
        self.log("val/ppl", self.val_perplexity, prog_bar=True, on_step=False, on_epoch=True)

    def configure_optimizers(self) -> dict[str, Any]:
        config = self.optim_config
        groups = param_groups(self.model, config.weight_decay, config.decay_embeddings)
        optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps)
        total_steps = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, config.warmup_steps, total_steps, config.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
