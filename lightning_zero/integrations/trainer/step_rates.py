"""The step profiler's rates: tokens per second, achieved TFLOPS and MFU, and where their inputs come from;
and the activation bytes the LightningModule estimates.

Read by :class:`~lightning_zero.integrations.trainer.step_profile.StepProfiler` (this module holds no
state of a fit):

  * **tokens** of a batch: ``pl_module.tokens_in_batch(batch)`` when the LightningModule defines it
    (the recipe does); else the element count of ``batch["input_ids"]`` (a mapping), or of the batch's
    first tensor (a tensor, or the first item of a tuple or list: a ``(B, T)`` tensor of token ids);
    else unknown (the rates are then ``null``);
  * **FLOPs per token** (training: forward and backward, the model's, no recomputation):
    ``pl_module.flops_per_token`` (a number, or a function of the batch) when defined (the recipe's:
    ``6 N + 12 L d T``, :meth:`recipes.training.model.GPT.flops_per_token`); else counted by torch's
    ``FlopCounterMode`` (what Lightning's ``measure_flops`` runs) over one real forward and backward,
    the first micro-batch of the step before the window (so the window's timing does not carry the
    counter), divided by that micro-batch's tokens. Not counted under tensor or pipeline parallelism (a
    rank then runs a part of the model: give ``flops_per_token``) nor when the window starts at step 0;
  * **peak**: ``profile_peak_tflops`` when set; else :data:`PEAK_TFLOPS` by the CUDA device's name,
    for 16-bit precisions (dense tensor-core rates: the datasheets' figures "with sparsity" halved);
    else none, and ``mfu`` is ``null`` with ``peak_source`` saying why (a CPU, fp32, an unknown GPU);
  * **activation bytes** (the report's ``estimate.activation_bytes``, beside the bytes measured on the
    same micro-batch): ``pl_module.activation_bytes`` (a number, or a function of the batch) when
    defined (the recipe's: :mod:`lightning_zero.layout.activations` for its GPT); else none.

The formula (``docs/strategy.md``, "Step profile"): over the window, ``tokens_per_s`` = the tokens
every data-parallel rank trained in the window's steps / the window's time (the slowest rank's sum of
``step_s``); ``achieved_tflops_per_device`` = ``flops_per_token · tokens_per_s / devices / 1e12``
(``devices``: the Trainer's world size, tensor and pipeline ranks included); ``mfu`` =
``achieved_tflops_per_device / peak_tflops_per_device``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.flop_counter import FlopCounterMode

PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("h100 nvl", 835.5),
    ("h100 pcie", 756.0),
    ("h100", 989.4),  # SXM: "NVIDIA H100 80GB HBM3"
    ("h200 nvl", 835.5),
    ("h200", 989.4),  # the H100 SXM's tensor cores
    ("a100", 312.0),
)
"""Dense bf16/fp16 tensor-core TFLOPS of one device, by a substring of its lower-cased CUDA name, the
most specific first."""

SIXTEEN_BIT = ("bf16", "16", "transformer-engine")
"""Precision names (their part before ``-``) whose matmuls run on 16-bit tensor cores."""


def peak_tflops(device: torch.device, precision: str, configured: float | None) -> tuple[float | None, str]:
    """One device's peak TFLOPS for the run, and where it comes from (``peak_source``)."""
    if configured is not None:
        return float(configured), "profile_peak_tflops"
    if device.type != "cuda":
        return None, f"no peak for a {device.type} device: set profile_peak_tflops for an MFU"
    name = torch.cuda.get_device_name(device)
    if str(precision).split("-")[0] not in SIXTEEN_BIT:
        return (
            None,
            f"no peak for precision {precision!r} in the table (16-bit only): set profile_peak_tflops",
        )
    for chip, tflops in PEAK_TFLOPS:
        if chip in name.lower():
            return tflops, f"table: {name} ({chip}), dense 16-bit"
    return None, f"{name} is not in the table: set profile_peak_tflops for an MFU"


def batch_tokens(pl_module: pl.LightningModule, batch: Any) -> int | None:
    """The tokens of one micro-batch on this rank (the module docstring's rule), or ``None``."""
    count = getattr(pl_module, "tokens_in_batch", None)
    if callable(count):
        return int(count(batch))
    if isinstance(batch, Mapping):
        batch = batch.get("input_ids")
    elif isinstance(batch, (tuple, list)) and batch:
        batch = batch[0]
    return batch.numel() if isinstance(batch, torch.Tensor) else None


def _stated(pl_module: pl.LightningModule, name: str, batch: Any) -> Any:
    """``pl_module.<name>``: a value, or what it returns for the batch; ``None`` when not defined."""
    given = getattr(pl_module, name, None)
    return given(batch) if callable(given) else given


def given_flops_per_token(pl_module: pl.LightningModule, batch: Any) -> float | None:
    """``pl_module.flops_per_token`` (a number, or called with the batch), or ``None``."""
    given = _stated(pl_module, "flops_per_token", batch)
    return None if given is None else float(given)


def given_activation_bytes(pl_module: pl.LightningModule, batch: Any) -> int | None:
    """``pl_module.activation_bytes`` (a number, or called with the batch: what one micro-batch's
    forward saves for backward on this rank, as the module estimates it), or ``None``."""
    given = _stated(pl_module, "activation_bytes", batch)
    return None if given is None else int(given)


class FlopCount:
    """Counts one forward and backward with ``FlopCounterMode`` (entered at a batch's start, left after
    its backward): :attr:`flops_per_token` once done."""

    def __init__(self) -> None:
        self._mode: FlopCounterMode | None = None
        self._tokens = 0
        self.flops_per_token: float | None = None

    def start(self, tokens: int | None) -> None:
        if tokens:
            self._tokens, self._mode = tokens, FlopCounterMode(display=False)
            self._mode.__enter__()

    def stop(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self.flops_per_token = self._mode.get_total_flops() / self._tokens
            self._mode = None


def rates(
    tokens: list[list[int]],
    step_s: list[list[float]],
    flops_per_token: float | None,
    formula: str,
    devices: int,
    peak: tuple[float | None, str],
) -> dict[str, Any]:
    """The report's ``"throughput"`` from every reported rank's tokens and ``step_s`` per step of the
    window (rank by rank); tokens ``< 0``: unknown."""
    known = all(t >= 0 for rank in tokens for t in rank)
    total = sum(sum(rank) for rank in tokens) if known else None
    window_s = max(sum(rank) for rank in step_s)
    per_s = total / window_s if total is not None and window_s > 0 else None
    achieved = flops_per_token * per_s / devices / 1e12 if flops_per_token and per_s is not None else None
    peak_tflops_per_device, source = peak
    return {
        "tokens_per_step": total / len(step_s[0]) if total is not None else None,
        "tokens_per_s": per_s,
        "tokens_per_s_per_device": per_s / devices if per_s is not None else None,
        "flops_per_token": flops_per_token,
        "flops_formula": formula,
        "achieved_tflops_per_device": achieved,
        "peak_tflops_per_device": peak_tflops_per_device,
        "peak_source": source,
        "mfu": achieved / peak_tflops_per_device if achieved is not None and peak_tflops_per_device else None,
        "devices": devices,
        "window_s": window_s,
    }
