"""The LightningModule (parameter groups, learning-rate schedule) and the recipe's monitoring callbacks
(tokens/s and MFU, the loss plot), in one single-process fit shared by several tests."""

from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.trainer.connectors.logger_connector import logger_connector, result
from torch.utils.data import DataLoader, TensorDataset

import recipes.training.throughput as throughput
from recipes.data.config import DataConfig
from recipes.data.module import PretrainDataModule
from recipes.training.model import GPT, GPTConfig
from recipes.training.module import OptimConfig, PretrainModule, lr_factor, param_groups
from recipes.training.plot import TRAIN_COLOR, VAL_COLOR, LossPlot
from recipes.training.progress import RefreshProgressBar
from recipes.training.throughput import TokenThroughput, compute_dtype, peak_flops, train_flops
from tests.recipes.tiny_fit import quiet_trainer, write_text_corpus

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


def test_peak_flops_override_cpu_fallback_and_lightning_gpu_table(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert peak_flops(cpu, "32-true", None) == pytest.approx(1.5e11)  # Lightning has no CPU figure
    assert peak_flops(cpu, "bf16-mixed", 2e12) == 2e12
    assert compute_dtype("bf16-true") == torch.bfloat16 and compute_dtype("16-mixed") == torch.float16
    assert compute_dtype("64-true") == torch.float64 and compute_dtype("32-true") == torch.float32
    # The hand-written table this replaced gave an H100 PCIe the SXM peak; Lightning's tells them apart.
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr("lightning.fabric.accelerators.cuda._is_ampere_or_later", lambda: True)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")  # no TF32 rate for fp32
    for name, bf16, fp32 in (
        ("NVIDIA H100 PCIe", 756e12, 51.2e12),
        ("NVIDIA H100 80GB HBM3", 989.4e12, 66.9e12),
    ):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert peak_flops(cuda, "bf16-mixed", None) == pytest.approx(bf16)
        assert peak_flops(cuda, "32-true", None) == pytest.approx(
            fp32
        )  # TF32 off: matmul precision "highest"
    # Lightning 2.6 knows no "NVIDIA H200" (and lists H200 peaks with sparsity): the dense bf16 figure
    for name, bf16 in (("NVIDIA H200", 989.4e12), ("NVIDIA H200 NVL", 835.5e12)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert peak_flops(cuda, "bf16-mixed", None) == pytest.approx(bf16)
    assert peak_flops(cuda, "bf16-true", 5e14) == 5e14  # the configured figure still wins
    # not a CUDA device: no CUDA name lookup (it would raise there), Lightning's answer (none for MPS)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: pytest.fail("CUDA name read"))
    assert peak_flops(torch.device("mps"), "bf16-mixed", None) is None
    with pytest.raises(ValueError, match="window must be >= 1 logging interval, got 0"):
        TokenThroughput(window=0)


def test_measured_flops_are_the_model_flops_without_recomputation() -> None:
    """Lightning's measure_flops on the meta device agrees with PaLM's 6 N + 12 L d T; activation
    checkpointing (whose recomputation measure_flops would count) does not change it."""
    config = dataclasses.replace(TINY, n_layer=2, max_seq_len=64)
    measured = train_flops(config, (3, 64))
    assert measured == pytest.approx(GPT(config).flops_per_token(64) * 3 * 64, rel=0.01)
    assert train_flops(dataclasses.replace(config, activation_checkpointing=True), (3, 64)) == measured


class SlowValidation(Callback):
    """Each validation seems to last 1000 s to the throughput clock (a fake clock: no real waiting)."""

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock

    def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self.clock[0] += 1000.0


def count_reads(monkeypatch: pytest.MonkeyPatch, trainer: pl.Trainer) -> list[int]:
    """The global step at each of Lightning's conversions of logged tensors to Python numbers (for the
    progress bar after every batch, for the loggers at logging steps): the host syncs of logging."""
    steps: list[int] = []
    for module in (logger_connector, result):

        def counting(data: Any, convert: Any = module.convert_tensors_to_scalars) -> Any:
            steps.append(trainer.global_step)
            return convert(data)

        monkeypatch.setattr(module, "convert_tensors_to_scalars", counting)
    return steps


@pytest.fixture(scope="module")
def fit(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """12 steps on a tiny text corpus, logging every 4 steps, validating every 4 (one 1000 s batch), the
    progress bar redrawn every 4 batches."""
    tmp_path = tmp_path_factory.mktemp("fit")
    text_dir = write_text_corpus(tmp_path / "text")
    data = DataConfig(path=str(text_dir), seq_len=32, batch_size=4, cache_dir=str(tmp_path / "cache"))
    optim = OptimConfig(lr=1e-2, warmup_steps=2)
    clock = [0.0]
    real_perf_counter = throughput.perf_counter
    callbacks = [TokenThroughput(window=1), LossPlot(), SlowValidation(clock), RefreshProgressBar(4)]
    trainer = quiet_trainer(
        enable_progress_bar=True,
        max_steps=12,
        val_check_interval=4,
        limit_val_batches=1,
        log_every_n_steps=4,
        default_root_dir=str(tmp_path / "run"),
        logger=CSVLogger(tmp_path / "run", name="logs"),
        callbacks=callbacks,
    )
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(throughput, "perf_counter", lambda: real_perf_counter() + clock[0])
        reads = count_reads(monkeypatch, trainer)
        trainer.fit(PretrainModule(TINY, optim), datamodule=PretrainDataModule(data))
    return {
        "trainer": trainer,
        "optim": optim,
        "throughput": callbacks[0],
        "plot": callbacks[1],
        "bar": callbacks[3],
        "reads": reads,
    }


def test_single_process_fit_logs_loss_throughput_and_perplexity(fit: dict[str, Any]) -> None:
    trainer, optim = fit["trainer"], fit["optim"]
    metrics = trainer.callback_metrics
    assert trainer.global_step == 12
    assert {"train/loss", "tokens_per_s", "mfu", "val/loss", "val/ppl", "lr"} <= set(metrics)
    assert float(metrics["val/ppl"]) == pytest.approx(math.exp(float(metrics["val/loss"])), rel=1e-3)
    assert float(metrics["train/loss"]) < math.log(256)
    expected_lr = optim.lr * lr_factor(11, optim.warmup_steps, 12, optim.min_lr_ratio)
    assert float(metrics["lr"]) == pytest.approx(expected_lr)


def test_throughput_reaches_the_loggers_and_leaves_validation_out(fit: dict[str, Any]) -> None:
    """The rate covers the last logging interval (steps 9-12), which holds a validation that lasted
    1000 s by the clock: counted, it would give under 0.6 tokens/s. MFU is the same interval's model
    FLOPs/s over the CPU peak."""
    trainer, monitor = fit["trainer"], fit["throughput"]
    metrics = trainer.callback_metrics
    tokens_per_s, mfu = float(metrics["tokens_per_s"]), float(metrics["mfu"])
    assert tokens_per_s > 50
    flops_per_batch = monitor._flops_by_shape[(4, 32)]
    assert mfu == pytest.approx(tokens_per_s / (4 * 32) * flops_per_batch / 1.5e11, rel=1e-6)
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row["tokens_per_s"]]
    # Logged at the logging steps 8 and 12 (Lightning writes step - 1); step 4 only starts the window.
    assert [int(row["step"]) for row in rows] == [7, 11] and all(row["mfu"] for row in rows)


def test_loss_plot_collects_both_curves_and_writes_a_png(fit: dict[str, Any], tmp_path: Path) -> None:
    """Also: the series are in the checkpoint (loadable with weights_only) and restored from it."""
    import matplotlib.image

    trainer, plot = fit["trainer"], fit["plot"]
    assert [step for step, _ in plot.train] == [4, 8, 12] and [step for step, _ in plot.val] == [4, 8, 12]
    assert plot.train[-1][1] == pytest.approx(float(trainer.callback_metrics["train/loss"]))
    assert plot.val[-1][1] == pytest.approx(float(trainer.callback_metrics["val/loss"]))
    path = Path(trainer.default_root_dir) / "loss.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = torch.from_numpy(matplotlib.image.imread(path)[..., :3].copy())  # (H, W, 3) in [0, 1]
    assert pixels.shape[:2] == (500, 800)
    for color in (TRAIN_COLOR, VAL_COLOR):  # each curve is drawn in its own colour
        rgb = torch.tensor([int(color[i : i + 2], 16) / 255 for i in (1, 3, 5)])
        assert int(((pixels - rgb).abs().amax(dim=-1) < 0.02).sum()) > 100, color
    trainer.save_checkpoint(tmp_path / "plot.ckpt")
    saved = torch.load(tmp_path / "plot.ckpt", weights_only=True)["callbacks"][plot.state_key]
    restored = LossPlot()
    restored.load_state_dict(saved)
    assert restored.train == plot.train and restored.val == plot.val


def test_logged_tensors_are_read_at_logging_steps_only_and_the_bar_shows_the_loss(
    fit: dict[str, Any],
) -> None:
    """No step between two logging steps (4, 8, 12: logging, validation, redraw) waits for the device:
    `train/loss` is not a `prog_bar` metric, which Lightning would read after every batch; the bar
    shows it all the same."""
    trainer, bar = fit["trainer"], fit["bar"]
    assert fit["reads"] and set(fit["reads"]) <= {4, 8, 12}
    assert "train/loss" not in trainer.progress_bar_metrics
    assert (
        "train/loss=" in bar.train_progress_bar.postfix and "tokens_per_s=" in bar.train_progress_bar.postfix
    )


def test_the_final_checkpoint_is_saved_before_the_plot_is_drawn(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Lightning runs the checkpoint callbacks' `on_train_end` (the final save) after every other
    callback's; a plot that fails when training ends (a full disk) fails the run loudly, but its last
    step is saved."""
    import recipes.training.plot as plot
    from recipes.training import RunCheckpoint

    def no_space(*args: Any, **kwargs: Any) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(plot, "draw_losses", no_space)
    tokens = torch.randint(0, TINY.vocab_size, (16, TINY.max_seq_len + 1))  # 4 batches: no epoch end
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    series = RunCheckpoint(  # as conf/callbacks/default.yaml: only every 100 steps and at the end
        tmp_path / "checkpoints",
        filename="step{step:06d}",
        auto_insert_metric_name=False,
        save_last=True,
        every_n_train_steps=100,
    )
    trainer = quiet_trainer(
        max_steps=2, enable_checkpointing=True, callbacks=[LossPlot(), series], default_root_dir=tmp_path
    )
    with pytest.raises(OSError, match="No space left on device"):
        trainer.fit(PretrainModule(TINY, OptimConfig(lr=1e-2, warmup_steps=1)), train_dataloaders=loader)
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 2
