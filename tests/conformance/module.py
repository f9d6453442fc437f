"""The LightningModule and callbacks of the conformance cases: small, deterministic, configurable.

One module class covers the cases through keyword arguments (an LR scheduler by name, manual
optimization modes, BatchNorm, compiled blocks, gradient-norm logging); the callbacks record what a
user would see (LR and momentum at every optimizer step, logged metrics) or change the run the way
real callbacks do (freeze a layer, add a param group, an EMA of the weights).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BaseFinetuning, Callback, WeightAveraging
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.optim.swa_utils import get_ema_multi_avg_fn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SAMPLES = 96
FEATURES, TARGETS = 6, 3


def dataset(seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    return TensorDataset(x, torch.tanh(x[:, :TARGETS] * 2) + 0.1 * torch.randn(SAMPLES, TARGETS, generator=g))


class Net(nn.Module):
    def __init__(self, batchnorm: bool = False, tied: bool = False) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.norm = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.head = nn.Linear(16, TARGETS)
        self.mix: nn.Linear | None = None
        if tied:  # a second layer sharing the backbone's weight (as an output layer shares an embedding's)
            self.mix = nn.Linear(16, 16, bias=False)
            self.mix.weight = self.backbone[2].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.backbone(x)
        if self.mix is not None:
            h = h + 0.5 * torch.tanh(self.mix(h))
        return self.head(self.norm(h))


def _scheduler(name: str, opt: torch.optim.Optimizer, total_steps: int) -> Any:
    S = torch.optim.lr_scheduler
    if name == "lambda":
        return S.LambdaLR(opt, [lambda s: 1.0 / (1 + 0.3 * s), lambda s: 0.9**s])
    if name == "step":
        return S.StepLR(opt, step_size=3, gamma=0.5)
    if name == "multistep":
        return S.MultiStepLR(opt, milestones=[2, 5, 7], gamma=0.3)
    if name == "exponential":
        return S.ExponentialLR(opt, gamma=0.8)
    if name == "cosine":
        return S.CosineAnnealingLR(opt, T_max=8, eta_min=1e-3)
    if name == "cosine_restarts":
        return S.CosineAnnealingWarmRestarts(opt, T_0=3, T_mult=2, eta_min=1e-3)
    if name == "onecycle":  # also cycles Adam's beta1
        return S.OneCycleLR(opt, max_lr=[0.05, 0.02], total_steps=total_steps)
    if name == "linear":
        return S.LinearLR(opt, start_factor=0.1, total_iters=5)
    if name == "sequential":  # warmup + cosine, the common LLM schedule
        warmup = S.LinearLR(opt, start_factor=0.1, total_iters=4)
        return S.SequentialLR(opt, [warmup, S.CosineAnnealingLR(opt, T_max=8)], milestones=[4])
    if name == "chained":
        return S.ChainedScheduler([S.ExponentialLR(opt, gamma=0.9), S.StepLR(opt, step_size=2, gamma=0.5)])
    if name == "plateau":
        return S.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0, threshold=10.0)
    raise ValueError(f"unknown scheduler {name!r}")


class ConformanceModule(L.LightningModule):
    """Regression on :func:`dataset` with AdamW in two param groups (backbone / head).

    Args:
        batch_size: per rank.
        scheduler, interval, frequency, monitor: the LR scheduler config returned with the optimizer.
        total_steps: what a scheduler that needs it (OneCycleLR) is told.
        manual: ``None`` (automatic), ``"plain"``, ``"accumulate"`` (step every 2 batches, a backward
            every batch), ``"toggle"``, ``"clip"`` or ``"gan"`` (two optimizers).
        batchnorm: a BatchNorm1d between backbone and head (buffers).
        tied: a layer after the backbone that shares a backbone layer's weight (two state-dict keys,
            one parameter).
        compile_blocks: ``torch.compile(..., backend="aot_eager")`` of backbone and head.
        log_grad_norm: log ``grad_norm`` (Lightning's or lightning-zero's) before each optimizer step.
        explicit_sampler: an unshuffled DistributedSampler (rank r takes samples r::N), so that one
            process with ``N`` times the batch sees the same global batch.
        frozen_backbone: the backbone starts frozen and outside the optimizer (fine-tuning).
        log_metrics: ``self.log`` in ``training_step`` (dynamo cannot trace it in a compiled step).
        root_scale: a parameter of the LightningModule itself (a learned output scale), read by
            ``_loss`` before any module's forward (``self.net(x * self.scale)``, not ``self(x)``).
        adam_kernel: ``"fused"`` or ``"foreach"`` (``AdamW(fused=True)`` / ``foreach=True``); ``None``
            is torch's default for the device.
    """

    def __init__(
        self,
        batch_size: int = 4,
        scheduler: str | None = None,
        interval: str = "step",
        frequency: int = 1,
        monitor: str | None = None,
        total_steps: int = 12,
        manual: str | None = None,
        batchnorm: bool = False,
        compile_blocks: bool = False,
        log_grad_norm: str | None = None,
        explicit_sampler: bool = False,
        frozen_backbone: bool = False,
        log_metrics: bool = True,
        root_scale: bool = False,
        adam_kernel: str | None = None,
        tied: bool = False,
        between_step_hooks: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = Net(batchnorm, tied)
        if compile_blocks:
            self.net.backbone = torch.compile(self.net.backbone, backend="aot_eager")  # type: ignore[assignment]
            self.net.head = torch.compile(self.net.head, backend="aot_eager")  # type: ignore[assignment]
        if frozen_backbone:
            self.net.backbone.requires_grad_(False)
        self.automatic_optimization = manual is None
        if root_scale:
            self.scale = nn.Parameter(torch.tensor(1.5, dtype=torch.get_default_dtype()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    # hooks that run between an optimizer step and the next forward, touching no parameter (a counter
    # logged, as a user's module does): overridden always, active with ``between_step_hooks``
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.hparams.between_step_hooks:
            self.batches_seen = getattr(self, "batches_seen", 0) + 1
            self.log("batches_seen", float(self.batches_seen), on_step=True, on_epoch=False)

    def on_train_epoch_end(self) -> None:
        if self.hparams.between_step_hooks:
            self.log("epochs_ended", float(self.current_epoch + 1), on_step=False, on_epoch=True)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        if self.hparams.root_scale:
            return nn.functional.mse_loss(self.net(x * self.scale), y)
        return nn.functional.mse_loss(self(x), y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        loss = self._loss(batch)
        if self.hparams.log_metrics:
            self.log("loss_step", loss, on_step=True, on_epoch=False)
            self.log("loss_epoch", loss, on_step=False, on_epoch=True, sync_dist=True)
        if self.hparams.manual is None:
            return loss
        self._manual_step(batch, loss, batch_idx)
        return None

    def _manual_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], loss: torch.Tensor, batch_idx: int
    ) -> None:
        mode = self.hparams.manual
        if mode == "gan":  # two optimizers, each steps its own part on a fresh forward
            for opt in self.optimizers():  # type: ignore[union-attr]
                self.toggle_optimizer(opt)
                self.manual_backward(self._loss(batch))
                opt.step()
                opt.zero_grad()
                self.untoggle_optimizer(opt)
            return
        opt = self.optimizers()
        if mode == "toggle":
            self.toggle_optimizer(opt)
        if mode == "accumulate":
            self.manual_backward(loss / 2)
            if (batch_idx + 1) % 2 == 0:
                opt.step()
                opt.zero_grad()
        else:
            self.manual_backward(loss)
            if mode == "clip":
                self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
        if mode == "toggle":
            self.untoggle_optimizer(opt)
        sched = self.lr_schedulers()
        if sched is not None and (mode != "accumulate" or (batch_idx + 1) % 2 == 0):
            sched.step()  # type: ignore[union-attr]

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.hparams.log_grad_norm == "lightning":
            self.log_dict(grad_norm(self, norm_type=2))
        elif self.hparams.log_grad_norm == "zero":
            import lightning_zero

            self.log_dict(lightning_zero.grad_norm(self, norm_type=2))

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def _loader(self, seed: int) -> DataLoader:
        data = dataset(seed)
        if not self.hparams.explicit_sampler:
            return DataLoader(data, batch_size=self.hparams.batch_size)
        sampler = DistributedSampler(
            data, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
        )
        return DataLoader(data, batch_size=self.hparams.batch_size, sampler=sampler)

    def train_dataloader(self) -> DataLoader:
        return self._loader(1)

    def val_dataloader(self) -> DataLoader:
        return self._loader(2)

    def test_dataloader(self) -> DataLoader:
        return self._loader(3)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(4)

    def configure_optimizers(self) -> Any:
        groups = [
            {"params": [p for p in self.net.backbone.parameters() if p.requires_grad], "weight_decay": 0.05},
            {"params": list(self.net.norm.parameters()) + list(self.net.head.parameters()), "lr": 0.02},
        ]
        if self.hparams.root_scale:
            groups[1]["params"].append(self.scale)
        groups = [g for g in groups if g["params"]]
        if self.hparams.manual == "gan":
            return (
                torch.optim.AdamW(groups[:1], lr=0.01),
                torch.optim.AdamW(groups[1:], lr=0.01),
            )
        kernel = {self.hparams.adam_kernel: True} if self.hparams.adam_kernel else {}
        opt = torch.optim.AdamW(groups, lr=0.01, **kernel)
        if self.hparams.scheduler is None:
            return opt
        config: dict[str, Any] = {
            "scheduler": _scheduler(self.hparams.scheduler, opt, self.hparams.total_steps),
            "interval": self.hparams.interval,
            "frequency": self.hparams.frequency,
        }
        if self.hparams.monitor is not None:
            config["monitor"] = self.hparams.monitor
        return {"optimizer": opt, "lr_scheduler": config}


class Recorder(Callback):
    """LR and beta1 of every param group of every optimizer, at each optimizer step."""

    def __init__(self) -> None:
        self.steps: list[list[list[float]]] = []

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self.steps.append([[float(g["lr"]), float(g["betas"][0])] for g in optimizer.param_groups])


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call: ``[(step, {name: value})]``."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> str:
        return "0"

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((int(step or 0), {k: float(v) for k, v in sorted(metrics.items())}))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class FreezeAt(Callback):
    """Sets ``requires_grad=False`` on the first backbone layer before global step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int
    ) -> None:
        if trainer.global_step == self.step:
            pl_module.net.backbone[0].requires_grad_(False)  # type: ignore[index]


class AddGroupAt(Callback):
    """Unfreezes the (initially frozen) backbone and adds it to the optimizer at global step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int
    ) -> None:
        if trainer.global_step == self.step and not next(pl_module.net.backbone.parameters()).requires_grad:
            pl_module.net.backbone.requires_grad_(True)
            trainer.optimizers[0].add_param_group(
                {"params": list(pl_module.net.backbone.parameters()), "lr": 0.005}
            )


class Finetune(BaseFinetuning):
    """Lightning's fine-tuning callback: backbone frozen, unfrozen into a new group at epoch 1."""

    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze(pl_module.net.backbone)

    def finetune_function(
        self, pl_module: L.LightningModule, epoch: int, optimizer: torch.optim.Optimizer
    ) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.net.backbone, optimizer, lr=0.003)


class EMAEveryOther(WeightAveraging):
    """Lightning's ``WeightAveraging`` with a multi-tensor EMA and its own ``should_update``: every
    other optimizer step from the second on."""

    def __init__(self, decay: float, use_buffers: bool = True) -> None:
        super().__init__(use_buffers=use_buffers, multi_avg_fn=get_ema_multi_avg_fn(decay))

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        return step_idx is not None and step_idx >= 1 and step_idx % 2 == 1


class EMA(Callback):
    """An exponential moving average of the weights (reads parameters every step), swapped in for
    validation and written into the model at the end of fit (writes parameters)."""

    def __init__(self, decay: float = 0.8) -> None:
        self.decay = decay
        self.shadow: dict[str, torch.Tensor] = {}
        self.backup: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        for name, p in pl_module.named_parameters():
            if name not in self.shadow:
                self.shadow[name] = p.detach().clone()
            else:
                self.shadow[name].mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

    def _swap_in(self, pl_module: L.LightningModule) -> None:
        with torch.no_grad():
            for name, p in pl_module.named_parameters():
                if name in self.shadow:
                    self.backup[name] = p.detach().clone()
                    p.copy_(self.shadow[name])

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "fit":
            self._swap_in(pl_module)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with torch.no_grad():
            for name, p in pl_module.named_parameters():
                if name in self.backup:
                    p.copy_(self.backup.pop(name))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._swap_in(pl_module)
        self.backup.clear()


class ParamProbe(Callback):
    """Reads the parameters where a phase starts or ends (and nowhere between steps): a sum per read,
    in ``recorded``, compared across strategies."""

    def __init__(self) -> None:
        self.recorded: list[float] = []

    def _read(self, pl_module: L.LightningModule) -> None:
        self.recorded.append(float(sum(p.detach().double().sum() for p in pl_module.parameters())))

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._read(pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._read(pl_module)


class HookCounter(Callback):
    """Counts the hooks around steps and phases (touching no parameter), in ``recorded``."""

    def __init__(self) -> None:
        self.recorded: list[float] = []

    def _count(self, trainer: L.Trainer, hook: int) -> None:
        self.recorded += [float(hook), float(trainer.global_step), float(trainer.current_epoch)]

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._count(trainer, 1)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._count(trainer, 2)

    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._count(trainer, 3)

    def on_train_epoch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._count(trainer, 4)

    def on_validation_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._count(trainer, 5)

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._count(trainer, 6)


class DeferGathers(Callback):
    """Parameter all-gathers run only when waited for (``overlap_param_gather``): any read of the
    parameters that the strategy did not make wait for them sees stale values, deterministically."""

    reads_parameters_between_steps = False

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from tests.distributed.workers import _defer_gathers

        _defer_gathers(trainer.strategy.sharded_optimizer.engine.comm)  # type: ignore[attr-defined]


class DetachAfterFit(Callback):
    """What Lightning's teardown does on a GPU (``module.cpu()``): every parameter gets new storage."""

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from lightning_zero.engine.parameters import sharded_engine

        # "zero3" leaves the model sharded where it is, as FSDP's teardown does: nothing is moved
        if stage == "fit" and sharded_engine(pl_module) is None:
            for p in pl_module.parameters():
                p.data = p.data.clone()


class WriteWeightsAt(Callback):
    """Overwrites every weight in place (as loading pretrained weights does) before global step
    ``step``, and sets the LR to 0 for that step: the parameters after it must be exactly the
    written ones (a stale fp32 master copy would bring the old weights back)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int
    ) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                for p in pl_module.parameters():
                    p.copy_(torch.full_like(p, 0.25))
            for g in trainer.optimizers[0].param_groups:
                g["lr"] = 0.0
