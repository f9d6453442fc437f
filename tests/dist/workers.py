"""Functions run on every rank by :func:`tests.dist.harness.run_ranks` (importable by spawn)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from lightning_zero import ShardedAdamW, ZeroConfig
from tests.dist.models import TinyNet, batch, param_groups, uses_extra


def parity(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each case, train ShardedAdamW on N ranks and a torch.optim.AdamW on the full global batch
    (recomputed on this rank), and return the max parameter difference after every step."""
    return [_parity_case(rank, world_size, **case) for case in cases]


def _parity_case(rank: int, world_size: int, *, stage: int, accum: int, clip: float | None,
                 dtype: str = "float64", steps: int = 10, micro_size: int = 4, amsgrad: bool = False,
                 reduce_dtype: str | None = None, overlap: bool = True) -> dict[str, Any]:
    torch_dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    model = TinyNet().to(torch_dtype)
    reference = copy.deepcopy(model)
    config = ZeroConfig(stage=stage, bucket_cap_mb=0.0004, first_bucket_cap_mb=0.0002, overlap_comm=overlap,
                        find_unused_parameters=True, reduce_dtype=reduce_dtype)
    names = {p: n for n, p in model.named_parameters()}
    opt = ShardedAdamW(param_groups(model), lr=3e-2, amsgrad=amsgrad, config=config,
                       param_order=model.parameters(), param_names=names)
    ref_opt = torch.optim.AdamW(param_groups(reference), lr=3e-2, amsgrad=amsgrad)
    max_diff = []
    for step in range(steps):
        for micro in range(accum):
            x, y = batch(step, micro, rank, micro_size, torch_dtype)
            loss = torch.nn.functional.mse_loss(model(x, uses_extra(step, rank)), y) / accum
            if micro < accum - 1:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
            # the reference sees every rank's micro-batch: the same global batch
            ref_loss = sum(
                torch.nn.functional.mse_loss(reference(*_xy_extra(step, micro, r, micro_size, torch_dtype)[0:2]),
                                             _xy_extra(step, micro, r, micro_size, torch_dtype)[2])
                for r in range(world_size)
            ) / (accum * world_size)
            ref_loss.backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
            torch.nn.utils.clip_grad_norm_([p for p in reference.parameters() if p.grad is not None], clip)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        max_diff.append(max((a - b).abs().max().item() for a, b in zip(model.parameters(),
                                                                          reference.parameters(), strict=True)))
    moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), TinyNet_init(torch_dtype), strict=True))
    return {"max_diff": max_diff, "moved": moved, "buckets": len(opt.plan.buckets)}


def _xy_extra(step: int, micro: int, rank: int, size: int, dtype: torch.dtype):  # noqa: ANN202
    x, y = batch(step, micro, rank, size, dtype)
    return x, uses_extra(step, rank), y


def TinyNet_init(dtype: torch.dtype) -> list[torch.Tensor]:  # noqa: N802
    torch.manual_seed(0)
    return [p.detach() for p in TinyNet().to(dtype).parameters()]
