"""Run on every rank by tests/distributed/test_divergent_paths.py: ``ShardedAdamW`` against torch DDP
(``find_unused_parameters=True``) on models whose ranks use different parameters inside a unit."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_zero import ShardedAdamW, ZeroConfig
from lightning_zero.comm import hybrid_mesh
from tests.distributed.paths_models import UNITS, MoEBlock, PathNet, batch, loss_of, path_of

STEPS, ACCUM, LR = 4, 2, 3e-2


def divergent_paths(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case: ``{"kind", "stage", "find_unused", "group"}`` (``group``: ``shard_group_size``, or
    ``None`` for flat sharding)."""
    return [_case(rank, world_size, **case) for case in cases]


def _case(rank: int, world_size: int, *, kind: str, stage: int, find_unused: bool, group: int | None) -> dict:
    torch.manual_seed(0)
    model = PathNet(kind).double()
    initial = [p.detach().clone() for p in model.parameters()]
    reference = DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    config = ZeroConfig(
        stage=stage,
        bucket_cap_mb=0.0004,  # a few parameters per bucket: the ranks' buckets fill differently
        first_bucket_cap_mb=0.0002,
        find_unused_parameters=find_unused,
        **({"unit_modules": UNITS, "min_unit_numel": 0} if stage == 3 else {}),
    )
    opt = ShardedAdamW(
        model.parameters(),
        lr=LR,
        weight_decay=0.1,
        config=config,
        module=model if stage == 3 else None,
        device_mesh=None if group is None else hybrid_mesh(group, "cpu"),
    )
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    experts = _record_experts(model)
    max_diff, paths = [], []
    for step in range(STEPS):
        for micro in range(ACCUM):
            x, y = batch(step, micro, rank)
            path = path_of(step, micro, rank)
            paths.append(path)
            last = micro == ACCUM - 1
            with _maybe(opt.no_sync(), not last):
                (loss_of(model(x, path), y) / ACCUM).backward()
            with _maybe(reference.no_sync(), not last):
                (loss_of(reference(x, path), y) / ACCUM).backward()
        if not find_unused:  # a missing gradient counts as zero (weight decay and moments move it)
            for p in reference.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        with opt.engine.full_parameters():
            max_diff.append(_max_diff(model, reference.module))
    with opt.engine.full_parameters():
        moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), initial, strict=True))
    return {"max_diff": max_diff, "moved": moved, "paths": paths, "experts": experts}


class _maybe:
    """``with _maybe(cm, on):`` enters ``cm`` only when ``on``."""

    def __init__(self, cm: Any, on: bool) -> None:
        self._cm, self._on = cm, on

    def __enter__(self) -> None:
        if self._on:
            self._cm.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._on:
            self._cm.__exit__(*exc)


def _record_experts(model: PathNet) -> list[list[int]]:
    """The experts each forward of the mixture block ran (appended to the returned list)."""
    ran: list[list[int]] = []
    for module in model.modules():
        if isinstance(module, MoEBlock):
            for e, expert in enumerate(module.experts):
                expert.register_forward_pre_hook(lambda m, a, e=e: ran[-1].append(e))
            module.register_forward_pre_hook(lambda m, a: ran.append([]))
    return ran


def _max_diff(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    return max(
        (a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters(), strict=True)
    )
