"""Run on every rank by tests/distributed/test_load_agreement.py: ``load_parameters`` from readers
that hold wrong, missing or short tensors, at stages 2 and 3."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_zero import ShardedAdamW, ZeroConfig
from lightning_zero.checkpoint import CheckpointError, SafetensorsReader, load_parameters

SHAPES = {"0.weight": (3, 3), "0.bias": (3,), "2.weight": (3, 3), "2.bias": (3,)}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))


def stored(case: str) -> dict[str, torch.Tensor]:
    """The tensors a reader holds in ``case``: the right shapes but for the case's one."""
    tensors = {
        name: torch.arange(float(torch.Size(shape).numel())).view(shape) for name, shape in SHAPES.items()
    }
    if case == "larger_weight":
        tensors["2.weight"] = torch.zeros(4, 3)
    elif case == "larger_bias":
        tensors["0.bias"] = torch.zeros(5)
    elif case == "smaller_weight":
        tensors["2.weight"] = torch.zeros(2, 3)
    elif case == "missing":
        del tensors["0.bias"]
    return tensors


class _DictReader:
    """A plain reader (no shapes): elements ``[start, end)`` of a stored tensor, as many as it has."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.failed = False  # a read of this rank's found the tensor missing or short

    def __call__(self, name: str, start: int, end: int) -> torch.Tensor:
        if name not in self.tensors or self.tensors[name].numel() < end:
            self.failed = True
        return self.tensors[name].reshape(-1)[start:end]  # KeyError where it is not stored


def load_each(
    rank: int, world_size: int, directory: str, cases: list[tuple[str, str, int]]
) -> list[dict[str, Any]]:
    """For each ``(case, reader kind, stage)``: the error every rank got (or ``None``), how long the
    load took, and whether the model's values were left as they were."""
    out = []
    for case, kind, stage in cases:
        model = _model()
        units = {"min_unit_numel": 0} if stage == 3 else {}
        config = ZeroConfig(stage=stage, bucket_cap_mb=1.0, first_bucket_cap_mb=1.0, **units)  # one per unit
        opt = ShardedAdamW(model.parameters(), config=config, module=model if stage == 3 else None)
        with opt.engine.full_parameters():
            before = [p.detach().clone() for p in model.parameters()]
        path = Path(directory) / f"{case}.safetensors"
        reader = SafetensorsReader(path) if kind == "safetensors" else _DictReader(stored(case))
        start, error = time.monotonic(), None
        try:
            load_parameters(model, reader, opt.engine)
        except CheckpointError as caught:
            error = str(caught)
        with opt.engine.full_parameters():
            unchanged = all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
        failed = getattr(reader, "failed", None)
        out.append(
            {"error": error, "seconds": time.monotonic() - start, "unchanged": unchanged, "failed": failed}
        )
    return out
