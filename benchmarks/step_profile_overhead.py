"""What ``ZeroStrategy(profile_steps=...)`` costs a step: profiled steps against the same steps unprofiled.

    python benchmarks/step_profile_overhead.py [--stage 2] [--steps 40] [--repeats 3] [--width 256] [--out D]

One Lightning launch of 2 CPU ranks (gloo, one thread each; the launcher re-runs this script for rank
1) fits a small MLP (8 blocks of ``--width``, batches of 32) ``--repeats`` times with the profiler off
(``profile_steps=None``: no callback) and on (``profile_steps=(5, steps - 5)``), alternately, so that
load from elsewhere falls on both. Each fit's step times come from a clock of this script's own (a
callback's ``on_train_batch_end``, installed before the strategy's); the steps inside the window are
compared with the same steps of the fit before it. Printed: the median step time off and on, the median
of the paired ratios, and the profiler's own work per step timed alone (its hooks' calls on an open
step, ``timeit``) over the step time, which is steadier than the ratio on a loaded machine; and the host
clock's (``host_s``): the timed entry points one step of the MLP enters (counted), times what one costs
on and off over a bare call (``timeit``). Figures, not assertions.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, not another install

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_zero  # noqa: E402
from lightning_zero.integrations.trainer.step_profile import StepProfiler  # noqa: E402


class Mlp(L.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.width = width
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(8)))
        self.head = nn.Linear(width, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.blocks(x)), y)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(4096, self.width, generator=g), torch.randn(4096, 1, generator=g))
        return DataLoader(data, batch_size=32)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Clock(L.Callback):
    """Each optimizer step's end, on this script's clock."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.ends.append(time.perf_counter())


def fit(args: argparse.Namespace, window: tuple[int, int] | None) -> tuple[list[float], int]:
    """The step times of ``window``'s steps (or of the default window's when off), and the global rank."""
    clock = Clock()
    trainer = L.Trainer(
        strategy=lightning_zero.ZeroStrategy(stage=args.stage, profile_steps=window),
        devices=2,
        accelerator="cpu",
        max_steps=args.steps,
        callbacks=[clock],
        logger=False,
        default_root_dir=args.out,  # where step_profile.json goes
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Mlp(args.width))
    first, last = 5, args.steps - 5
    times = [clock.ends[s] - clock.ends[s - 1] for s in range(first, last + 1)]
    return times, trainer.global_rank


def hooks_per_step_s(width: int) -> float:
    """The profiler's own calls for one open step of one batch, timed alone (CPU, stage 2's figures).
    All ranks (the optimizer is built on the launch's process group)."""
    from lightning_zero import ShardedAdamW, ZeroConfig

    model = Mlp(width)  # no tokens_in_batch: the batch's first tensor is counted
    opt = ShardedAdamW(model.parameters(), config=ZeroConfig(stage=2))
    profiler = StepProfiler(opt.engine, 0, 10**9)
    batch = (torch.zeros(32, width), torch.zeros(32, 1))

    class Trainer:
        global_step = 0

    trainer: Any = Trainer()

    def one_step() -> None:
        profiler.on_train_batch_start(trainer, model, batch, 0)  # type: ignore[arg-type]
        profiler.on_before_backward(trainer, None, None)  # type: ignore[arg-type]
        profiler.on_after_backward(trainer, None)  # type: ignore[arg-type]
        profiler.on_before_optimizer_step(trainer, None, None)  # type: ignore[arg-type]
        trainer.global_step += 1
        profiler.on_train_batch_end(trainer, None, None, None, 0)  # type: ignore[arg-type]

    n = 20_000
    seconds = min(timeit.repeat(one_step, number=n, repeat=3)) / n
    opt.engine.time_host(False)  # the window never closed: its host clock off again
    return seconds


def host_clock_per_step(width: int, stage: int) -> tuple[int, float, float]:
    """The timed entry points one optimizer step of the MLP enters (a real step, counted), and what one
    costs over a bare call with the host clock on and off (``timeit`` of a timed no-op). All ranks."""
    from lightning_zero import ShardedAdamW, ZeroConfig
    from lightning_zero.comm.host_clock import CLOCK, timed

    model = Mlp(width)
    config = ZeroConfig(stage=stage, **({"min_unit_numel": 1} if stage == 3 else {}))
    opt = ShardedAdamW(model.parameters(), config=config, module=model if stage == 3 else None)
    entries = 0
    enter = CLOCK.enter

    def counted() -> bool:
        nonlocal entries
        entries += 1
        return enter()

    CLOCK.enter = counted  # type: ignore[method-assign]
    was = CLOCK.start()
    try:
        for _ in range(2):  # the second one counted: the first builds buffers
            entries = 0
            x, y = torch.zeros(32, width), torch.zeros(32, 1)
            nn.functional.mse_loss(model.head(model.blocks(x)), y).backward()
            opt.step()
            opt.zero_grad()
    finally:
        CLOCK.enter = enter  # type: ignore[method-assign]
        CLOCK.stop(keep=was)

    def bare() -> None: ...

    wrapped = timed(bare)
    n = 200_000
    plain_s = min(timeit.repeat(bare, number=n, repeat=5)) / n
    off_s = min(timeit.repeat(wrapped, number=n, repeat=5)) / n - plain_s
    CLOCK.start()
    on_s = min(timeit.repeat(wrapped, number=n, repeat=5)) / n - plain_s
    CLOCK.stop(keep=was)
    return entries, on_s, off_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "step_profile_overhead"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    window = (5, args.steps - 5)
    offs, ons, ratios, rank = [], [], [], 0
    for _ in range(args.repeats):
        off, rank = fit(args, None)
        on, rank = fit(args, window)
        offs += off
        ons += on
        ratios.append(statistics.median(on) / statistics.median(off))
    hooks_s = hooks_per_step_s(args.width)  # every rank: the optimizer checks its plan with the other
    entries, entry_on_s, entry_off_s = host_clock_per_step(args.width, args.stage)
    if rank != 0:
        return
    step_s = statistics.median(offs)
    first, last = window
    print(f"stage {args.stage}, width {args.width}, 2 ranks, steps {first}..{last}, pairs {args.repeats}")
    print(f"  median step off {step_s * 1e3:.2f} ms, on {statistics.median(ons) * 1e3:.2f} ms")
    print(
        f"  median paired ratio on/off {statistics.median(ratios):.4f} (each: {[f'{r:.3f}' for r in ratios]})"
    )
    print(f"  the profiler's calls per step alone {hooks_s * 1e6:.1f} us = {hooks_s / step_s:.2%} of a step")
    on, off = entries * entry_on_s, entries * entry_off_s
    print(
        f"  the host clock: {entries} timed entry points per step; each costs {entry_on_s * 1e9:.0f} ns on, "
        f"{entry_off_s * 1e9:.0f} ns off over a bare call: {on * 1e6:.1f} us = {on / step_s:.2%} of a step "
        f"on, {off * 1e6:.1f} us = {off / step_s:.3%} off"
    )


if __name__ == "__main__":
    main()
