"""The optimizer state of this rank's shards, and the Adam/AdamW update applied to it.

For bucket ``b`` this rank holds shard-sized tensors (``(padded_numel // world_size,)``): master
weights, ``exp_avg``, ``exp_avg_sq`` and, with ``amsgrad``, ``max_exp_avg_sq``. Steps are counted
per parameter, identically on every rank, as ``torch.optim`` counts them (a skipped parameter does
not advance). The update runs over *pieces*: the part of one parameter that falls in this rank's
shard (:class:`~lightning_zero.partition.Segment`), as views into the shard tensors, batched with
``torch._foreach_*`` per (param group, step count) so hyper-parameters and bias corrections are
scalars.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_zero.config import master_dtype
from lightning_zero.layout.buckets import BucketPlan
from lightning_zero.layout.flat import FlatParams


@dataclass(frozen=True)
class _Piece:
    param_index: int
    master: Tensor
    grad: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor
    max_exp_avg_sq: Tensor | None


class ShardState:
    """Master weights and Adam moments for the shards one rank owns."""

    def __init__(
        self,
        plan: BucketPlan,
        flat: FlatParams,
        grad_shards: list[Tensor],
        group_of_param: list[int],
        amsgrad: bool,
    ) -> None:
        self.plan = plan
        self.flat = flat
        self.steps = [0] * len(plan.params)
        self.master: list[Tensor] = []
        self.exp_avg: list[Tensor] = []
        self.exp_avg_sq: list[Tensor] = []
        self.max_exp_avg_sq: list[Tensor] | None = [] if amsgrad else None
        self.separate_master: list[bool] = []
        for bucket in plan.buckets:
            shard = flat.shard(bucket)
            dtype = master_dtype(bucket.dtype)
            separate = dtype != shard.dtype
            self.separate_master.append(separate)
            self.master.append(shard.to(dtype, copy=True) if separate else shard)
            self.exp_avg.append(torch.zeros_like(self.master[-1]))
            self.exp_avg_sq.append(torch.zeros_like(self.master[-1]))
            if self.max_exp_avg_sq is not None:
                self.max_exp_avg_sq.append(torch.zeros_like(self.master[-1]))
        self._pieces: dict[tuple[int, int], list[_Piece]] = defaultdict(list)  # (bucket, group) -> pieces
        for b, bucket in enumerate(plan.buckets):
            for seg in plan.segments(bucket, flat.rank):
                window = slice(seg.shard_offset, seg.shard_offset + seg.numel)
                self._pieces[b, group_of_param[seg.param_index]].append(
                    _Piece(
                        seg.param_index,
                        self.master[b][window],
                        grad_shards[b][window],
                        self.exp_avg[b][window],
                        self.exp_avg_sq[b][window],
                        None if self.max_exp_avg_sq is None else self.max_exp_avg_sq[b][window],
                    )
                )

    def count_steps(self, used: list[bool] | None) -> None:
        """Advance the step count of every parameter that takes part in this step (all ranks agree)."""
        for index in range(len(self.steps)):
            if used is None or used[index]:
                self.steps[index] += 1

    @torch.no_grad()
    def update_bucket(self, bucket_index: int, groups: list[dict[str, Any]], used: list[bool] | None) -> None:
        """One Adam/AdamW step of the pieces in one bucket's shard; ``used[i]`` False skips parameter ``i``.

        Call :meth:`count_steps` once per optimizer step first.
        """
        for group_index, group in enumerate(groups):
            by_step: dict[int, list[_Piece]] = defaultdict(list)
            for piece in self._pieces.get((bucket_index, group_index), ()):
                if used is None or used[piece.param_index]:
                    by_step[self.steps[piece.param_index]].append(piece)
            for step, pieces in by_step.items():
                if _fused_ok(pieces[0].master):
                    _adam_fused(pieces, step, group)
                else:
                    _adam_foreach(pieces, step, group)
        if self.separate_master[bucket_index]:
            self.flat.shard(self.plan.buckets[bucket_index]).copy_(self.master[bucket_index])

    @torch.no_grad()
    def adopt_external_writes(self) -> None:
        """Take into the fp32 masters any 16-bit parameter element written since the last step.

        A write from outside the optimizer (weights loaded in ``on_fit_start``, a callback that
        averages or resets parameters) changes the 16-bit parameter but not its master, which would
        bring the old value back at the next update. Elements whose parameter no longer equals the
        master rounded to its dtype are re-read from the parameter; no host synchronisation.
        """
        for b, bucket in enumerate(self.plan.buckets):
            if self.separate_master[b]:
                shard, master = self.flat.shard(bucket), self.master[b]
                written = shard != master.to(shard.dtype)
                master.copy_(torch.where(written, shard.to(master.dtype), master))

    def refresh_master(self) -> None:
        """Re-read separate master shards from the parameter shards (after the parameters were loaded)."""
        for b, bucket in enumerate(self.plan.buckets):
            if self.separate_master[b]:
                self.master[b].copy_(self.flat.shard(bucket))

    def state_tensors(self) -> dict[str, Any]:
        """This rank's state as tensors (views, not copies)."""
        state: dict[str, Any] = {
            "steps": torch.tensor(self.steps, dtype=torch.int64),
            "master": self.master,
            "exp_avg": self.exp_avg,
            "exp_avg_sq": self.exp_avg_sq,
        }
        if self.max_exp_avg_sq is not None:
            state["max_exp_avg_sq"] = self.max_exp_avg_sq
        return state

    def nbytes(self) -> int:
        """Bytes of optimizer state this rank holds (separate master copies included)."""
        tensors = self.exp_avg + self.exp_avg_sq + (self.max_exp_avg_sq or [])
        tensors += [m for m, sep in zip(self.master, self.separate_master, strict=True) if sep]
        return sum(t.numel() * t.element_size() for t in tensors)


_FUSED_DEVICES = ("cuda", "cpu")
_FUSED_DTYPES = (torch.float32, torch.float64)


def _fused_ok(master: Tensor) -> bool:
    """torch's fused Adam(W) kernel exists for this device and master dtype."""
    return master.device.type in _FUSED_DEVICES and master.dtype in _FUSED_DTYPES


def _adam_fused(pieces: list[_Piece], step: int, group: dict[str, Any]) -> None:
    """The same update as :func:`_adam_foreach` in one fused kernel per call (``torch._fused_adamw_``,
    or ``torch._fused_adam_`` for Adam's L2 decay). The step count is a device scalar made by a
    fill kernel, not copied from the host, so nothing waits for the device."""
    masters = [p.master for p in pieces]
    step_t = torch.full((), float(step), dtype=torch.float32, device=masters[0].device)
    fused = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
    beta1, beta2 = group["betas"]
    fused(
        masters,
        [p.grad for p in pieces],
        [p.exp_avg for p in pieces],
        [p.exp_avg_sq for p in pieces],
        [p.max_exp_avg_sq for p in pieces] if group["amsgrad"] else [],  # type: ignore[misc]
        [step_t] * len(pieces),
        lr=float(group["lr"]),
        beta1=beta1,
        beta2=beta2,
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        amsgrad=group["amsgrad"],
        maximize=group["maximize"],
    )


def _adam_foreach(pieces: list[_Piece], step: int, group: dict[str, Any]) -> None:
    """torch.optim.Adam(W)'s single-tensor update, batched over pieces sharing a step count."""
    lr = float(group["lr"])
    beta1, beta2 = group["betas"]
    eps, weight_decay = group["eps"], group["weight_decay"]
    params = [p.master for p in pieces]
    exp_avgs = [p.exp_avg for p in pieces]
    exp_avg_sqs = [p.exp_avg_sq for p in pieces]
    grads: list[Tensor] = [p.grad for p in pieces]
    if group["maximize"]:
        grads = list(torch._foreach_neg(grads))
    if weight_decay != 0:
        if group["decoupled_weight_decay"]:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        else:
            grads = list(torch._foreach_add(grads, params, alpha=weight_decay))
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    if group["amsgrad"]:
        maxes = [p.max_exp_avg_sq for p in pieces]
        torch._foreach_maximum_(maxes, exp_avg_sqs)  # type: ignore[arg-type]
        denom = torch._foreach_sqrt(maxes)  # type: ignore[arg-type]
    else:
        denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-(lr / bias_correction1))
