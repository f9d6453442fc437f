"""Rank functions of the non-finite-step tests (``skip_nonfinite_steps``), importable by spawn.

Each case trains two copies of TinyNet side by side on every rank: one with the guard on, into whose
gradient a NaN/inf is injected on one rank at one (step, micro-batch), and a twin without the guard
that simply skips that step (no forward, no backward, no ``step()``: its contribution is zero and no
update happens). Everything the guarded run holds afterwards must equal the twin's bit for bit.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import torch

from lightning_zero import NonFiniteGradientError, ShardedAdamW, ZeroConfig
from tests.distributed.models import TinyNet, batch, param_groups, uses_extra

_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def _optimizer(model: torch.nn.Module, config: ZeroConfig) -> ShardedAdamW:
    names = {p: n for n, p in model.named_parameters()}
    return ShardedAdamW(
        param_groups(model), lr=3e-2, config=config, param_order=model.parameters(), param_names=names
    )


def _inject(model: TinyNet, kind: str, world_size: int) -> Any:
    """A hook that makes this backward's gradients non-finite (or, ``"fp16_overflow"``, finite but too
    large for an fp16 wire's sum); returns its handle (``None``: the loss is scaled instead)."""
    if kind == "inf_grad":  # one element of the first layer's weight: the last bucket to launch
        return model.inp.weight.register_hook(
            lambda g: g.index_put((torch.tensor([0]),), g[0] * 0 + torch.inf)
        )
    if kind == "neg_inf_grad":  # one element of the output bias: the first bucket
        return model.out.bias.register_hook(lambda g: g.index_put((torch.tensor([1]),), g[1] * 0 - torch.inf))
    if kind == "fp16_overflow":  # every rank sends 40000 (finite in fp16); the sum of the means is not
        return model.out.bias.register_hook(
            lambda g: g.index_put((torch.tensor([2]),), g[2] * 0 + 40_000.0 * world_size)
        )
    return None


def _state(opt: ShardedAdamW) -> list[torch.Tensor]:
    engine = opt.engine
    tensors = [t for record in engine.state.records for t in (record.master, *record.moments.values())]
    return tensors + [torch.tensor(engine.state.steps)]


def skip_case(
    rank: int,
    world_size: int,
    *,
    stage: int,
    dtype: str,
    accum: int,
    bad: tuple[int, int, int] | None,
    kind: str = "nan_loss",
    steps: int = 5,
    find_unused: bool = True,
    reduce_dtype: str | None = None,
    bad_ranks: list[int] | None = None,
) -> dict[str, Any]:
    """Guarded run with a non-finite gradient at ``bad = (rank, step, micro)`` (``rank = -1``: every
    rank) against a twin that skips that step. Returns what every rank saw."""
    torch_dtype = _DTYPES[dtype]
    torch.manual_seed(0)
    model = TinyNet().to(torch_dtype)
    twin = copy.deepcopy(model)
    config = ZeroConfig(
        stage=stage,
        bucket_cap_mb=0.0004,
        first_bucket_cap_mb=0.0002,
        find_unused_parameters=find_unused,
        reduce_dtype=reduce_dtype,
        skip_nonfinite_steps=3,
    )
    opt, twin_opt = _optimizer(model, config), _optimizer(twin, replace(config, skip_nonfinite_steps=0))
    bad_rank, bad_step, bad_micro = bad if bad is not None else (None, None, None)
    unchanged_over_bad_step = None
    for step in range(steps):
        before = [p.detach().clone() for p in model.parameters()]
        for micro in range(accum):
            x, y = batch(step, micro, rank, 4, torch_dtype)
            for net, optimizer, guarded in ((model, opt, True), (twin, twin_opt, False)):
                if not guarded and step == bad_step:
                    continue  # the twin skips the bad step: no contribution at all
                loss = torch.nn.functional.mse_loss(net(x, uses_extra(step, rank)), y) / accum
                hit = guarded and step == bad_step and micro == bad_micro and bad_rank in (rank, -1)
                handle = _inject(net, kind, world_size) if hit else None
                if hit and kind == "nan_loss":
                    loss = loss * float("nan")
                if micro < accum - 1:
                    with optimizer.no_sync():
                        loss.backward()
                else:
                    loss.backward()
                if handle is not None:
                    handle.remove()
        opt.step()
        opt.zero_grad()
        if step != bad_step:
            twin_opt.step()
            twin_opt.zero_grad()
        if step == bad_step:
            unchanged_over_bad_step = all(
                torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
            )
    params, twin_params = list(model.parameters()), list(twin.parameters())
    start = TinyNet_start(torch_dtype)
    return {
        "params_equal": all(torch.equal(a, b) for a, b in zip(params, twin_params, strict=True)),
        "state_equal": all(torch.equal(a, b) for a, b in zip(_state(opt), _state(twin_opt), strict=True)),
        "unchanged_over_bad_step": unchanged_over_bad_step,
        "finite": all(bool(torch.isfinite(p).all()) for p in params),
        "moved": max(
            (a.double() - b.double()).abs().max().item() for a, b in zip(params, start, strict=True)
        ),
        "skipped": opt.skipped_steps,
        "ranks": opt.engine.guard.last_ranks,
        "steps": opt.engine.state.steps,
    }


def TinyNet_start(dtype: torch.dtype) -> list[torch.Tensor]:  # noqa: N802
    torch.manual_seed(0)
    return [p.detach() for p in TinyNet().to(dtype).parameters()]


def skip_cases(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [skip_case(rank, world_size, **case) for case in cases]


def consecutive(
    rank: int, world_size: int, *, limit: int, bad_at: dict[int, list[int]], stage: int, find_unused: bool
) -> dict[str, Any]:
    """NaN on the ranks ``bad_at[step]`` at each listed step, until the guard raises (or 8 steps).
    Returns the error's message, step and ranks, and the skip count when it was raised."""
    torch.manual_seed(0)
    model = TinyNet().double()
    config = ZeroConfig(
        stage=stage,
        bucket_cap_mb=0.0004,
        first_bucket_cap_mb=0.0002,
        find_unused_parameters=find_unused,
        skip_nonfinite_steps=limit,
    )
    opt = _optimizer(model, config)
    last_update: list[torch.Tensor] = []
    for step in range(8):
        x, y = batch(step, 0, rank, 4, torch.float64)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if rank in bad_at.get(step, ()):
            loss = loss * float("nan")
        loss.backward()
        try:
            opt.step()
        except NonFiniteGradientError as err:
            return {
                "message": str(err),
                "step": err.step,
                "ranks": err.ranks,
                "skipped": opt.skipped_steps,
                "unchanged": all(
                    torch.equal(a, b) for a, b in zip(last_update, model.parameters(), strict=True)
                ),
                "idle_after": opt.engine.accumulating,
            }
        if not bad_at.get(step):
            last_update = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
    return {"message": None, "skipped": opt.skipped_steps}


def consecutive_cases(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [consecutive(rank, world_size, **case) for case in cases]


def collectives_per_step(rank: int, world_size: int) -> dict[str, int]:
    """Collectives of one optimizer step with the guard off and on: with ``find_unused_parameters``
    (the flags ride on its mask), without it, and after ``unscale_`` (loss scaling already agreed)."""
    counts: dict[str, int] = {}
    for find_unused in (True, False):
        for unscale in (False, True):
            for limit in (0, 2):
                torch.manual_seed(0)
                model = TinyNet()
                config = ZeroConfig(
                    bucket_cap_mb=0.0004,
                    first_bucket_cap_mb=0.0002,
                    find_unused_parameters=find_unused,
                    skip_nonfinite_steps=limit,
                )
                opt = _optimizer(model, config)
                for step in range(2):
                    opt.engine.comm_stats.reset()
                    x, y = batch(step, 0, rank, 4, torch.float32)
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    if unscale:
                        assert not opt.unscale_(1.0)
                    opt.step()
                    opt.zero_grad()
                key = f"unused={find_unused},unscale={unscale},guard={limit > 0}"
                counts[key] = opt.engine.comm_stats.collectives
    return counts
