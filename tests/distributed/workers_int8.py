"""``reduce_dtype="int8"`` on every rank: the averaged gradient shard against the fp32 wire's, within
the quantization bound of every sender's block; bytes against the fp32 wire."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from lightning_zero import ShardedAdamW, ZeroConfig
from lightning_zero.engine.quantize import BLOCK, LEVELS, blocks_of
from tests.distributed.models import BlockNet, batch, param_groups


def _optimizer(model: torch.nn.Module, stage: int, wire: str | None, cap: float) -> ShardedAdamW:
    config = ZeroConfig(
        stage=stage,
        reduce_dtype=wire,
        bucket_cap_mb=cap,
        first_bucket_cap_mb=cap / 2,
        **({"min_unit_numel": 0} if stage == 3 else {}),
    )
    return ShardedAdamW(
        param_groups(model),
        lr=1e-2,
        config=config,
        param_order=model.parameters(),
        param_names={p: n for n, p in model.named_parameters()},
        module=model if stage == 3 else None,
    )


def int8_gradients(rank: int, world_size: int, stage: int, width: int, cap: float) -> dict[str, Any]:
    torch.manual_seed(0)
    model = BlockNet(width)
    exact_model, local_model = copy.deepcopy(model), copy.deepcopy(model)
    int8 = _optimizer(model, stage, "int8", cap)
    exact = _optimizer(exact_model, stage, None, cap)
    x, y = batch(0, 0, rank, 8, torch.float32)
    for m, opt in ((model, int8), (exact_model, exact)):
        opt.engine.reset_comm_stats()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.engine.finish_grad_sync()
    torch.nn.functional.mse_loss(local_model(x), y).backward()  # this rank's own gradient, plain
    plan, n = int8.engine.plan, world_size
    local_grads = [  # a block's gate unused in this forward: no gradient, a zero one for the engines
        torch.zeros_like(p) if p.grad is None else p.grad for p in local_model.parameters() if p.requires_grad
    ]
    over, checked = [], 0
    for b, bucket in enumerate(plan.buckets):
        local = torch.zeros(bucket.padded_numel)
        for slot in bucket.slots:
            grad = local_grads[slot.param_index].reshape(-1)
            local[slot.bucket_offset : slot.bucket_offset + slot.numel] = grad
        everyone = [torch.empty_like(local) for _ in range(n)]
        dist.all_gather(everyone, local / n)  # what each sender quantizes: its mean contribution
        part = bucket.padded_numel // n
        mine = slice(rank * part, (rank + 1) * part)
        bound = torch.zeros(part)
        for sent in everyone:
            chunk = torch.zeros(blocks_of(part) * BLOCK)
            chunk[:part] = sent[mine]
            amax = chunk.view(-1, BLOCK).abs().amax(dim=1)
            bound += (amax / (2 * LEVELS)).repeat_interleave(BLOCK)[:part]
        got, want = int8.engine.reducer.grad_shards[b], exact.engine.reducer.grad_shards[b]
        error = (got - want).abs()
        slack = 1e-6 * want.abs() + 1e-7 * bound.max()  # fp32 rounding of the sums and products
        over.append(float((error - bound - slack).max()))
        checked += part
    return {
        "over": max(over),
        "checked": checked,
        "moved": float(exact.engine.reducer.grad_shards[0].abs().max()),
        "bytes_int8": int8.engine.comm_stats.bytes_sent,
        "bytes_fp32": exact.engine.comm_stats.bytes_sent,
        "expected_fp32_gradients": sum((n - 1) * (b.padded_numel // n) * 4 for b in plan.buckets)
        * (2 if stage == 1 else 1),  # reduce-scatter, or stage 1's all-reduce
        "expected_int8": sum((n - 1) * (blocks_of(b.padded_numel // n) * (BLOCK + 4)) for b in plan.buckets),
    }


def int8_training(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    """A few steps on each wire from the same start: the losses stay close (a smoke check that the
    int8 wire trains, not a convergence measurement)."""
    losses: dict[str, list[float]] = {}
    for wire in (None, "int8"):
        torch.manual_seed(0)
        model = BlockNet(32)
        opt = _optimizer(model, 2, wire, 25.0)
        losses[str(wire)] = []
        for _ in range(steps):
            x, y = batch(0, 0, rank, 8, torch.float32)  # one batch again: the loss must fall
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[str(wire)].append(float(loss))
    return losses


def int8_refused_under_hybrid(rank: int, world_size: int) -> str:
    from lightning_zero.comm import hybrid_mesh

    model = BlockNet(8)
    try:
        ShardedAdamW(
            param_groups(model),
            config=ZeroConfig(reduce_dtype="int8"),
            device_mesh=hybrid_mesh(2, "cpu"),
            param_order=model.parameters(),
        )
    except ValueError as err:
        return str(err)
    return "accepted"
