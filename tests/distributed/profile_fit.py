"""Fits under ``ZeroStrategy(profile_steps=...)`` with timers of the test's own, for
``tests/distributed/test_step_profile.py``.

Run as a script (Lightning's launcher re-runs it for the other ranks, which run the same fits in the
same order), each rank writes ``--out/case{i}_rank{r}.json`` per case: its own clock's step times (the
LightningModule's ``on_train_batch_end`` of each step's last batch, after the strategy's callbacks
ran), the engine's communication wait at the window's first batch start and last batch end, the
engine's memory at the window's end, and whether a ``StepProfiler`` was installed::

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
        self.memory: dict[str, int] = {}
        self._step_before = 0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.blocks(x)), y)

    def _engine(self) -> Any:
        return self.trainer.strategy.sharded_optimizer.engine  # type: ignore[attr-defined]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._step_before = self.global_step
        if self.window and self.global_step == self.window[0] and "start" not in self.wait_at:
            self.wait_at["start"] = self._engine().comm_wait_s()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        if self.global_step == self._step_before:  # a micro-batch that only accumulates
            return
        self.step_ends[self._step_before] = now
        if self.window and self._step_before == self.window[1]:
            self.wait_at["end"] = self._engine().comm_wait_s()
            self.memory = dataclasses.asdict(self._engine().memory())

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(256, 64, generator=g), torch.randn(256, 1, generator=g))
        return DataLoader(data, batch_size=8)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(
    out: Path, index: int, stage: int, profile_steps: list[int] | None, accum: int = 1, steps: int = 4
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
    model = ProfiledLit(window)
    trainer.fit(model)
    profilers = [cb for cb in trainer.callbacks if isinstance(cb, StepProfiler)]  # type: ignore[attr-defined]
    result = {
        "rank": trainer.global_rank,
        "root": str(root),
        "profilers": len(profilers),
        "step_ends": {str(k): v for k, v in model.step_ends.items()},
        "wait_at": model.wait_at,
        "memory": model.memory,
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
