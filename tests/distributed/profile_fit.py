"""Fits under ``ZeroStrategy(profile_steps=...)`` with timers of the test's own, for
``tests/distributed/test_step_profile.py``.

Run as a script (Lightning's launcher re-runs it for the other ranks, which run the same fits in the
same order), each rank writes ``--out/case{i}_rank{r}.json`` per case: its own clock's step times (the
LightningModule's ``on_train_batch_end`` of each step's last batch, after the strategy's callbacks
ran), the engine's communication wait (all, and on parameter gathers) at the window's first batch
start and last batch end, the engine's memory at the window's end, the tokens it trained in each
step (its own count), what its buckets must send per step (from the plan: the reduce-scatter's
padded elements, the engine's minimum per step), Lightning's ``measure_flops`` of one micro-batch on
a meta-device copy of the model, and whether a ``StepProfiler`` was installed. ``given``: the
LightningModule states ``tokens_in_batch`` (one token per sample) and ``flops_per_token``; else the
profiler counts the FLOPs and takes a batch's first tensor's elements as its tokens::

    python -m tests.distributed.profile_fit --out DIR --cases '[{"stage": 2, "profile_steps": [1, 2]}]'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class ProfiledLit(L.LightningModule):
    """A small MLP whose hooks keep the test's clock and read the engine at the window's edges."""

    def __init__(self, window: tuple[int, int] | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)))
        self.head = nn.Linear(64, 1)
        self.window = window
        self.step_ends: dict[int, float] = {}  # step -> this hook's clock at its last batch's end
        self.wait_at: dict[str, float] = {}
        self.gather_wait_at: dict[str, float] = {}
        self.host_at: dict[str, float] = {}  # the engine's host seconds in our code (the profiler's clock)
        self.memory: dict[str, int] = {}
        self.tokens: dict[int, int] = {}  # step -> samples and elements of x trained in it, counted here
        self._step_before = 0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.blocks(x)), y)

    def _engine(self) -> Any:
        return self.trainer.strategy.sharded_optimizer.engine  # type: ignore[attr-defined]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._step_before = self.global_step
        self.tokens[self.global_step] = self.tokens.get(self.global_step, 0) + len(batch[0])
        if self.window and self.global_step == self.window[0] and "start" not in self.wait_at:
            self.wait_at["start"] = self._engine().comm_wait_s()
            self.gather_wait_at["start"] = self._engine().comm_gather_wait_s()
            self.host_at["start"] = self._engine().host_s()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        if self.global_step == self._step_before:  # a micro-batch that only accumulates
            return
        self.step_ends[self._step_before] = now
        if self.window and self._step_before == self.window[1]:
            self.wait_at["end"] = self._engine().comm_wait_s()
            self.gather_wait_at["end"] = self._engine().comm_gather_wait_s()
            self.host_at["end"] = self._engine().host_s()
            self.memory = dataclasses.asdict(self._engine().memory())

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(256, 64, generator=g), torch.randn(256, 1, generator=g))
        return DataLoader(data, batch_size=8)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class GivenLit(ProfiledLit):
    """States its tokens (one per sample) and FLOPs per token, as the recipe's module does."""

    def tokens_in_batch(self, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        return len(batch[0])

    def flops_per_token(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        return FLOPS_PER_SAMPLE


FLOPS_PER_SAMPLE = 6 * 4 * 64 * 64 + 6 * 64 - 2 * 64 * 64
"""Forward and backward matmuls of one sample: 2 per weight forward, 2 for the weight's gradient, 2 for
the input's gradient but in the first layer (whose input needs none); ``measure_flops`` agrees (the
launched test compares)."""


def measured_flops(batch: int) -> int:
    """Lightning's ``measure_flops`` of one forward and backward of ``batch`` samples, meta device."""
    from lightning.fabric.utilities.throughput import measure_flops

    with torch.device("meta"):
        model = ProfiledLit(None)
        x, y = torch.randn(batch, 64), torch.randn(batch, 1)
    return measure_flops(model, lambda: model.training_step((x, y), 0), lambda loss: loss)


def must_send(engine: Any) -> dict[str, int]:
    """What a step must send, in fp32 bytes, from the plan: the reduce-scatter of every bucket's padded
    elements (ring: ``(N-1)/N`` of them) and all of it (the engine's minimum per step)."""
    world = engine.comm.world_size
    scatter = sum(b.padded_numel * (world - 1) // world for b in engine.plan.buckets)
    return {
        "reduce_scatter_bytes": 4 * scatter,
        "reduce_scatters": len(engine.plan.buckets),
        "all_bytes": 4 * engine.min_elements_per_step(),
    }


def fit(
    out: Path,
    index: int,
    stage: int,
    profile_steps: list[int] | None,
    accum: int = 1,
    steps: int = 4,
    given: bool = False,
) -> None:
    import lightning_zero
    from lightning_zero.integrations.trainer.step_profile import StepProfiler

    window = None if profile_steps is None else (profile_steps[0], profile_steps[1])
    root = out / f"case{index}"
    units = {"min_unit_numel": 1} if stage == 3 else {}  # each block a unit
    trainer = L.Trainer(
        strategy=lightning_zero.ZeroStrategy(stage=stage, profile_steps=window, **units),
        devices=2,
        accelerator="cpu",
        max_steps=steps,
        accumulate_grad_batches=accum,
        default_root_dir=str(root),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = (GivenLit if given else ProfiledLit)(window)
    trainer.fit(model)
    profilers = [cb for cb in trainer.callbacks if isinstance(cb, StepProfiler)]  # type: ignore[attr-defined]
    result = {
        "rank": trainer.global_rank,
        "root": str(root),
        "profilers": len(profilers),
        "step_ends": {str(k): v for k, v in model.step_ends.items()},
        "wait_at": model.wait_at,
        "gather_wait_at": model.gather_wait_at,
        "host_at": model.host_at,
        "memory": model.memory,
        "tokens": {str(k): v for k, v in model.tokens.items()},
        "must_send": must_send(model._engine()),
        "measure_flops_per_batch": measured_flops(8),
    }
    (out / f"case{index}_rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for index, case in enumerate(json.loads(args.cases)):
        fit(args.out, index, **case)


if __name__ == "__main__":
    main()
