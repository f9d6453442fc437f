"""Tokens/s and MFU from Lightning's own tools, measured without a host synchronisation per step.

Parts, all Lightning's where they fit:

* FLOPs: `lightning.fabric.utilities.throughput.measure_flops` (torch's `FlopCounterMode`) counts one
  forward + backward of a meta-device copy of the model on a micro-batch's shape, once per shape: no
  memory, no compute. Activation checkpointing is switched off in that copy, so the count is the model's
  FLOPs, not the recomputation (MFU, not HFU). For our GPT it equals PaLM's 6 N + 12 L d T within 0.01 %.
* Peak: `peak_flops_per_device` when set; else `get_available_flops(device, dtype)` from the precision's
  compute dtype (it tells H100 SXM / PCIe / NVL apart and uses TF32 rates for fp32 on Ampere+ when
  `torch.set_float32_matmul_precision` allows it); else, on CPU (for which Lightning has no figure),
  `DEFAULT_CPU_PEAK_FLOPS`; else (a GPU Lightning does not know) no MFU, with a warning.
* Rates: `lightning.fabric.utilities.throughput.Throughput`, the windowed counter behind Lightning's
  `ThroughputMonitor`, fed once per logging interval (`trainer.log_every_n_steps` optimizer steps).

Why not Lightning's `ThroughputMonitor` callback itself: it synchronises CUDA after every micro-batch (a
host sync per step is what the ZeRO step path avoids), writes only to the loggers (not the progress bar
or `trainer.callback_metrics`) under keys like `train/device/items_per_sec`, and gives no figure before
`window_size` (100) batches. Here the device is synchronised once per logging interval - when the logger
reads the step's metrics anyway - so the interval's wall time is exact; validation time is left out.

Logged (all ranks alike, rank 0's reach the loggers): `tokens_per_s` (global: this rank's rate x the
data-parallel ranks, as the strategy deals data; shown by `recipes.training.progress.RefreshProgressBar`)
and `mfu` (model FLOPs/s per device / peak), averaged over the last `window` logging intervals; the first
figure comes after `window` + 1 logging steps (the first interval holds start-up costs). The `T` ranks of
a tensor-parallel group train the same tokens (counted once) and each does `1/T` of their FLOPs; the `P`
stages of a pipeline likewise (each is given `1/P` of them: stages of equal numbers of layers, the first
and the last with the embedding and the head, do about that).
"""

from __future__ import annotations

import dataclasses
from time import perf_counter
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.throughput import Throughput, get_available_flops, measure_flops
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from recipes.training.model import GPT, GPTConfig

DEFAULT_CPU_PEAK_FLOPS = 1.5e11
"""FLOP/s assumed per CPU process when `peak_flops_per_device` is null (one core, fp32, AVX-512 FMA, as
measured on the development machine); Lightning's `get_available_flops` knows no CPU."""

PRECISION_DTYPES = {"64": torch.float64, "bf16": torch.bfloat16, "16": torch.float16}
"""Compute dtype by the prefix of Lightning's precision string (`bf16-mixed`, `16-true`, ...); fp32 else."""


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype matmuls run in under a Lightning precision string (`"bf16-mixed"` -> bfloat16)."""
    return PRECISION_DTYPES.get(str(precision).split("-")[0], torch.float32)


DENSE_16BIT_PEAKS = {"h200 nvl": 835.5e12, "h200": 989.4e12}
"""Dense bf16/fp16 tensor-core FLOP/s of GPUs Lightning 2.6's `get_available_flops` misses or lists
with structured sparsity, by a substring of the lower-cased device name, most specific first. The
H200 datasheet's figures "with sparsity" halved: SXM 1,979 -> 989.4 TFLOP/s (the H100 SXM's dense
figure, same tensor cores), NVL 1,671 -> 835.5. Lightning does not recognise the names "NVIDIA H200"
and "NVIDIA H200 NVL", and its H200 entries are the sparse figures."""


def peak_flops(device: torch.device, precision: str, configured: float | None) -> float | None:
    """Peak FLOP/s of one device: the configured figure, the CPU default, :data:`DENSE_16BIT_PEAKS`,
    Lightning's table, or None."""
    if configured is not None:
        return configured
    if device.type == "cpu":
        return DEFAULT_CPU_PEAK_FLOPS
    dtype = compute_dtype(precision)
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        name = torch.cuda.get_device_name(device).lower()
        for chip, flops in DENSE_16BIT_PEAKS.items():
            if chip in name:
                return flops
    available = get_available_flops(device, dtype)  # warns itself when unknown
    return None if available is None else float(available)


def train_flops(config: GPTConfig, batch_shape: tuple[int, int]) -> int:
    """Model FLOPs of one training micro-batch (forward + backward) of `batch_shape` = (B, T).

    Counted on the meta device (no memory, no arithmetic), without activation checkpointing or compiled
    blocks, and outside anomaly detection (`debug=*` turns it on; its NaN checks read values meta tensors
    lack).
    """
    config = dataclasses.replace(config, activation_checkpointing=False, compile_blocks=False)
    with torch.device("meta"):
        model = GPT(config)
        inputs = torch.zeros(batch_shape, dtype=torch.long)  # (B, T)

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), inputs.flatten())

    with torch.autograd.set_detect_anomaly(False):
        return measure_flops(model, lambda: model(inputs), loss)


def ends_optimizer_step(trainer: pl.Trainer, batch_idx: int) -> bool:
    """True in `on_train_batch_end` of the micro-batch that completed an optimizer step."""
    last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
    return (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or last


def is_logged_step(trainer: pl.Trainer, batch_idx: int) -> bool:
    """True in `on_train_batch_end` of an optimizer step whose metrics the loggers write now (every
    `trainer.log_every_n_steps` steps, and when training stops)."""
    # Lightning's logger connector decides; its ThroughputMonitor asks it the same way.
    return ends_optimizer_step(trainer, batch_idx) and trainer._logger_connector.should_update_logs


class TokenThroughput(Callback):
    """Logs `tokens_per_s` and `mfu` once per logging interval (see the module docstring).

    FLOPs (and so `mfu`) need the module's `model_config` (a `GPTConfig`, as `PretrainModule` has) and
    batches whose first element is the (B, T) token ids; other modules get `tokens_per_s` only.

    Args:
        window: logging intervals averaged (>= 1).
        peak_flops_per_device: FLOP/s of one device for MFU; None: Lightning's table or the CPU default.

    Raises:
        ValueError: if `window` < 1 or `peak_flops_per_device` <= 0.
    """

    reads_parameters_between_steps = False  # ZeroStrategy's overlapped gathers need not wait for it

    def __init__(self, window: int = 2, peak_flops_per_device: float | None = None) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 logging interval, got {window}")
        if peak_flops_per_device is not None and peak_flops_per_device <= 0:
            raise ValueError(f"peak_flops_per_device must be > 0 FLOP/s or null, got {peak_flops_per_device}")
        self.window = window
        self.peak_flops_per_device = peak_flops_per_device
        self.peak: float | None = None
        self._flops_by_shape: dict[tuple[int, ...], int] = {}
        self._throughput = Throughput(window_size=window + 1)
        self._counts = {"steps": 0, "windows": 0, "tokens": 0, "flops": 0}
        self._data_parallel = self._tensor_parallel = 1
        """Ranks that train different samples, and ranks that share each one (a tensor-parallel group)."""
        self._started = 0.0
        self._paused_s = 0.0
        self._pause_started: float | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        device = trainer.strategy.root_device
        self.peak = peak_flops(device, trainer.precision, self.peak_flops_per_device)
        if self.peak is None:
            rank_zero_warn(f"no MFU: set peak_flops_per_device to the FLOP/s of one {device} device")
        kwargs = trainer.distributed_sampler_kwargs  # how the strategy deals data: its data-parallel ranks
        self._data_parallel = trainer.world_size if kwargs is None else int(kwargs["num_replicas"])
        self._tensor_parallel = trainer.world_size // self._data_parallel
        self._throughput = Throughput(
            available_flops=self.peak, world_size=trainer.world_size, window_size=self.window + 1
        )

    def _now(self, trainer: pl.Trainer) -> float:
        """Seconds of training so far, after the queued device work has finished."""
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        return perf_counter()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._throughput.reset()
        self._counts = dict.fromkeys(self._counts, 0)
        self._started, self._paused_s = self._now(trainer), 0.0

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pause_started = self._now(trainer)  # a sanity check's pause is reset by on_train_start

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pause_started is not None:
            self._paused_s += self._now(trainer) - self._pause_started
            self._pause_started = None

    def _micro_batch_flops(self, pl_module: pl.LightningModule, shape: tuple[int, ...]) -> int | None:
        config = getattr(pl_module, "model_config", None)
        if not isinstance(config, GPTConfig) or len(shape) != 2:
            return None  # not a GPT of ours: tokens/s only
        if shape not in self._flops_by_shape:  # a tensor-parallel group shares each micro-batch's FLOPs
            self._flops_by_shape[shape] = train_flops(config, (shape[0], shape[1])) // self._tensor_parallel
        return self._flops_by_shape[shape]

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        inputs = batch[0]  # (B, T)
        flops = self._micro_batch_flops(pl_module, tuple(inputs.shape))
        self._counts["windows"] += inputs.shape[0]
        self._counts["tokens"] += inputs.numel()
        self._counts["flops"] += flops or 0
        if not ends_optimizer_step(trainer, batch_idx):
            return
        self._counts["steps"] += 1
        if not trainer._logger_connector.should_update_logs:
            return
        self._throughput.update(
            time=self._now(trainer) - self._started - self._paused_s,
            batches=self._counts["steps"],
            samples=self._counts["windows"],
            lengths=self._counts["tokens"],
            flops=self._counts["flops"] if flops is not None else None,
        )
        self._counts["flops"] = 0  # `Throughput` takes the FLOPs since its previous update
        self._log(pl_module, self._throughput.compute())

    def _log(self, pl_module: pl.LightningModule, metrics: dict[str, float]) -> None:
        if "device/items_per_sec" in metrics:
            # Not prog_bar: Lightning would read the logged tensor back to the host after every batch.
            pl_module.log("tokens_per_s", metrics["device/items_per_sec"] * self._data_parallel)
        if "device/mfu" in metrics:
            pl_module.log("mfu", metrics["device/mfu"])
