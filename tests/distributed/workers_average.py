"""Weight averaging on the shards (``ShardedAdamW.keep_weight_average``), run on every rank: against
torch's ``AveragedModel`` of a single-process ``torch.optim.AdamW`` run on the same global batch.

The global batch of a step (:data:`GLOBAL` samples) does not depend on the world size; rank ``r`` of
``N`` takes its ``r``-th slice, so a run resumed on another world size continues on the same data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn, get_ema_multi_avg_fn

from lightning_zero import ShardedAdamW, ZeroConfig
from lightning_zero.checkpoint import read_meta, save_sharded
from lightning_zero.checkpoint.reshard import load_sharded, preflight
from tests.distributed.models import BlockNet, param_groups

FUNCTIONS: dict[str, dict[str, Any]] = {
    "ema": {"avg_fn": get_ema_avg_fn(0.8)},
    "ema_multi": {"multi_avg_fn": get_ema_multi_avg_fn(0.7)},
    "swa": {},
}
GLOBAL = 12
SAVE_AT, STEPS = 3, 6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return BlockNet(12).double()


def _optimizer(model: torch.nn.Module, stage: int) -> ShardedAdamW:
    config = ZeroConfig(
        stage=stage,
        bucket_cap_mb=0.0004,
        first_bucket_cap_mb=0.0002,
        **({"min_unit_numel": 0} if stage == 3 else {}),
    )
    return ShardedAdamW(
        param_groups(model),
        lr=3e-2,
        config=config,
        param_order=model.parameters(),
        param_names={p: n for n, p in model.named_parameters()},
        module=model if stage == 3 else None,
    )


def _loss(model: torch.nn.Module, step: int, part: int = 0, parts: int = 1) -> torch.Tensor:
    """The mean squared error on slice ``part`` of ``parts`` of the step's global batch."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL, 7, generator=g, dtype=torch.float64)
    y = torch.randn(GLOBAL, 5, generator=g, dtype=torch.float64)
    rows = slice(part * GLOBAL // parts, (part + 1) * GLOBAL // parts)
    return torch.nn.functional.mse_loss(model(x[rows]), y[rows])


class _Reference:
    """torch.optim.AdamW on the whole global batch, with an ``AveragedModel`` updated after each step."""

    def __init__(self, fn: str, unfreeze_at: int | None = None) -> None:
        self.unfreeze_at = unfreeze_at
        self.model = _model()
        self.opt = torch.optim.AdamW(param_groups(self.model), lr=3e-2)
        self.average = AveragedModel(self.model, **FUNCTIONS[fn])

    def step(self, step: int) -> None:
        if step == self.unfreeze_at:
            _unfreeze(self.model, self.opt)
        _loss(self.model, step).backward()
        self.opt.step()
        self.opt.zero_grad()
        self.average.update_parameters(self.model)


def _unfreeze(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """The frozen layer trains from now on, in a param group of its own (a fine-tuning callback's move)."""
    model.frozen.requires_grad_(True)
    opt.add_param_group({"params": list(model.frozen.parameters()), "weight_decay": 0.0})
    if isinstance(opt, ShardedAdamW):
        opt.replan(model.parameters(), {p: n for n, p in model.named_parameters()})


def _diff(opt: ShardedAdamW, model: torch.nn.Module, reference: torch.nn.Module) -> float:
    with opt.full_parameters():  # reading parameters outside a forward: the documented contract
        pairs = zip(model.parameters(), reference.parameters(), strict=True)
        return max((a - b).abs().max().item() for a, b in pairs)


def _train(
    opt: ShardedAdamW, model: torch.nn.Module, ref: _Reference, fn: str, steps: range, rank: int, size: int
) -> tuple[list[float], list[float]]:
    """Steps on both; after each: our weights and (swapped in, then out) our average against the
    reference's."""
    weights, averages = [], []
    for step in steps:
        if step == ref.unfreeze_at:  # the re-plan's new records start their average from the weights
            _unfreeze(model, opt)
        _loss(model, step, rank, size).backward()
        opt.step()
        opt.zero_grad()
        opt.update_weight_average(**FUNCTIONS[fn])
        ref.step(step)
        weights.append(_diff(opt, model, ref.model))
        opt.swap_weight_average()
        averages.append(_diff(opt, model, ref.average.module))
        opt.swap_weight_average()
    return weights, averages


def averaged_parity(
    rank: int,
    world_size: int,
    stage: int,
    fn: str,
    save: str | None = None,
    unfreeze_at: int | None = None,
) -> dict[str, Any]:
    """:data:`STEPS` steps with a weight average; ``save``: a checkpoint after step :data:`SAVE_AT`;
    ``unfreeze_at``: the frozen layer joins the optimizer before that step (a re-plan)."""
    model, ref = _model(), _Reference(fn, unfreeze_at)
    opt = _optimizer(model, stage)
    opt.keep_weight_average()
    weights, averages = _train(opt, model, ref, fn, range(SAVE_AT), rank, world_size)
    if save is not None:
        save_sharded(opt.engine, save, {"global_step": SAVE_AT}, {}, stage)
    more = _train(opt, model, ref, fn, range(SAVE_AT, STEPS), rank, world_size)
    start = _model()
    return {
        "weights": weights + more[0],
        "averages": averages + more[1],
        "moved": max(
            (a - b).abs().max().item()
            for a, b in zip(ref.average.module.parameters(), start.parameters(), strict=True)
        ),
        "average_nbytes": opt.engine.average_nbytes(),
        "shard_numel": sum(b.padded_numel // opt.engine.comm.world_size for b in opt.engine.plan.buckets),
        "total_numel": sum(p.numel() for p in ref.model.parameters() if p.requires_grad),
        "n_averaged": opt.n_averaged,
    }


def resumed_average(rank: int, world_size: int, path: str, stage: int, fn: str, keep: bool) -> dict[str, Any]:
    """Load the checkpoint :func:`averaged_parity` saved on ``world_size`` ranks at ``stage``.
    ``keep``: a weight average kept, then train to step :data:`STEPS` against the uninterrupted
    reference; without one, the weights loaded must be the saved average."""
    model, ref = _model(), _Reference(fn)
    for step in range(SAVE_AT):
        ref.step(step)
    opt = _optimizer(model, stage)
    if keep:
        opt.keep_weight_average()
    meta = read_meta(path)
    preflight(opt.engine, Path(path), meta)
    load_sharded(opt.engine, Path(path), meta)
    if not keep:
        vs_average = _diff(opt, model, ref.average.module)
        return {"vs_average": vs_average, "vs_weights": _diff(opt, model, ref.model)}
    n_loaded = opt.n_averaged
    weights, averages = _train(opt, model, ref, fn, range(SAVE_AT, STEPS), rank, world_size)
    return {"n_averaged_loaded": n_loaded, "weights": weights, "averages": averages}
