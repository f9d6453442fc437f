"""Run on every rank by tests/distributed/test_signature_check.py, with ``LZ_CHECK_COLLECTIVES=1``."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn

from lightning_zero import ShardedAdamW, ZeroConfig
from lightning_zero.comm import CommError
from lightning_zero.comm.signatures import ENV


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.skip: int | None = None  # a block this rank does not run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i != self.skip:
                x = torch.tanh(block(x))
        return x


def _train(stage: int, steps: int, diverge: str | None, rank: int) -> dict[str, Any]:
    model = _net = _Net()
    units = {"min_unit_numel": 0} if stage == 3 else {}
    opt = ShardedAdamW(model.parameters(), lr=1e-2, config=ZeroConfig(stage=stage, **units), module=model)
    elements, error, seconds = [], None, None
    for step in range(steps):
        last = step == steps - 1
        if diverge == "unit" and last and rank == 1:
            _net.skip = 2  # the third block's unit runs on rank 0 only
        opt.engine.reset_comm_stats()
        start = time.monotonic()
        try:
            model(torch.randn(3, 6, generator=torch.Generator().manual_seed(step))).pow(2).sum().backward()
            if diverge == "clip" and last and rank == 1:
                opt.clip_grad_norm_(1.0)  # an all-reduce rank 0 does not issue
            opt.step()
            opt.zero_grad()
        except CommError as caught:
            error, seconds = str(caught), time.monotonic() - start
            break
        elements.append(opt.engine.comm_stats.elements_sent)
    with opt.engine.full_parameters():
        values = [p.detach().clone() for p in model.parameters()] if error is None else []
    return {"error": error, "seconds": seconds, "elements": elements, "values": values}


def signature_cases(
    rank: int, world_size: int, cases: list[tuple[bool, int, str | None]]
) -> list[dict[str, Any]]:
    """Each case ``(check on, stage, how to diverge or None)``."""
    out = []
    for on, stage, diverge in cases:
        os.environ[ENV] = "1" if on else "0"
        try:
            out.append(_train(stage, 3, diverge, rank))
        finally:
            os.environ.pop(ENV, None)
    return out
