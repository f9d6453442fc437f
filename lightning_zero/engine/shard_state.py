"""The optimizer state of this rank's shards: one :class:`ShardRecord` per bucket, and the update.

For bucket ``b`` this rank's record holds shard-sized tensors (``(padded_numel // world_size,)``):
the parameter shard (a view of the flat buffer), the master weights (that view itself for
fp32/fp64 parameters, a separate fp32 copy for 16-bit ones), the averaged gradient shard the reducer
writes, and the optimizer's moments *by name* (Adam: ``exp_avg``, ``exp_avg_sq`` and, with
``amsgrad``, ``max_exp_avg_sq``). Everything that stores, moves or converts optimizer state
(re-planning, checkpoints, resharding, full-state conversion) goes through the records, so a moment
is added, renamed or placed on another device in one place: :meth:`ShardState._record`.

Steps are counted per parameter, identically on every rank, as ``torch.optim`` counts them (a
skipped parameter does not advance). The update itself is the optimizer's :class:`UpdateRule`,
applied to *pieces*: the part of one parameter that falls in this rank's shard
(:class:`~lightning_zero.layout.partition.Segment`), as views into the record's tensors, batched per
(param group, step count) so hyper-parameters and bias corrections are scalars.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_zero.config import master_dtype
from lightning_zero.layout.buckets import Bucket, BucketPlan
from lightning_zero.layout.flat import FlatParams


@dataclass(frozen=True)
class Piece:
    """One parameter's part of a shard: views into its record's tensors."""

    param_index: int
    master: Tensor
    grad: Tensor
    moments: dict[str, Tensor]


class UpdateRule(Protocol):
    """The optimizer's math over pieces (:class:`lightning_zero.optim.adam.AdamRule`)."""

    def moment_names(self, groups: list[dict[str, Any]]) -> tuple[str, ...]:
        """Names of the shard-shaped state tensors the rule keeps for ``groups``' settings."""
        ...

    def update(self, pieces: list[Piece], step: int, group: dict[str, Any]) -> None:
        """One step of ``pieces`` that share ``group``'s hyper-parameters and a step count."""
        ...


@dataclass
class ShardRecord:
    """One bucket's shard on this rank: parameters, master, gradient and moments (live together)."""

    bucket: Bucket
    param: Tensor
    """``(shard_numel,)`` this rank's slice of the flat parameter buffer."""
    master: Tensor
    """``param`` itself, or its copy in the master dtype (fp32 for 16-bit parameters)."""
    grad: Tensor
    """``(shard_numel,)`` the averaged gradient shard, master dtype (the reducer writes it)."""
    moments: dict[str, Tensor]
    """The optimizer's state tensors by name, each like ``master``."""
    average: Tensor | None = None
    """A running average of ``master`` (EMA, SWA: :mod:`lightning_zero.engine.averaging`), or ``None``."""

    @property
    def separate_master(self) -> bool:
        return self.master is not self.param

    @property
    def device(self) -> torch.device:
        return self.master.device

    def state(self) -> dict[str, Tensor]:
        """What a re-plan must carry: the moments, the master if separate, the average if kept."""
        return {
            **({"master": self.master} if self.separate_master else {}),
            **self.moments,
            **({"average": self.average} if self.average is not None else {}),
        }

    def nbytes(self) -> int:
        """Bytes of optimizer state (moments and a separate master; not the weight average)."""
        return sum(t.numel() * t.element_size() for k, t in self.state().items() if k != "average")


class ShardState:
    """The records of one plan, the step counts, and the update over them."""

    def __init__(
        self,
        plan: BucketPlan,
        flat: FlatParams,
        grad_shards: list[Tensor],
        group_of_param: list[int],
        rule: UpdateRule,
        groups: list[dict[str, Any]],
        average_on: torch.device | None = None,
    ) -> None:
        self.plan = plan
        self.rule = rule
        self.average_on = average_on
        """Where each record keeps a weight average (``None``: none kept); set by :meth:`keep_average`."""
        self.moment_names = rule.moment_names(groups)
        self.steps = [0] * len(plan.params)
        self.records = [
            self._record(b, flat, grad) for b, grad in zip(plan.buckets, grad_shards, strict=True)
        ]
        self._pieces: dict[tuple[int, int], list[Piece]] = defaultdict(list)  # (bucket, group) -> pieces
        for b, record in enumerate(self.records):
            for seg in plan.segments(record.bucket, flat.rank):
                window = slice(seg.shard_offset, seg.shard_offset + seg.numel)
                self._pieces[b, group_of_param[seg.param_index]].append(
                    Piece(
                        seg.param_index,
                        record.master[window],
                        record.grad[window],
                        {name: t[window] for name, t in record.moments.items()},
                    )
                )

    def _record(self, bucket: Bucket, flat: FlatParams, grad: Tensor) -> ShardRecord:
        """Where each state tensor of a bucket is allocated (the one place to choose another device)."""
        param = flat.shard(bucket)
        dtype = master_dtype(bucket.dtype)
        master = param if dtype == param.dtype else param.to(dtype, copy=True)
        moments = {name: torch.zeros_like(master) for name in self.moment_names}
        record = ShardRecord(bucket, param, master, grad, moments)
        if self.average_on is not None:
            record.average = master.to(self.average_on, copy=True)
        return record

    def keep_average(self, device: torch.device) -> None:
        """Every record keeps an average on ``device``, starting from the master's current value (what
        a re-plan's new records do too)."""
        self.average_on = device
        for record in self.records:
            record.average = record.master.to(device, copy=True)

    def count_steps(self, used: list[bool] | None) -> None:
        """Advance the step count of every parameter that takes part in this step (all ranks agree)."""
        for index in range(len(self.steps)):
            if used is None or used[index]:
                self.steps[index] += 1

    @torch.no_grad()
    def update_bucket(self, bucket_index: int, groups: list[dict[str, Any]], used: list[bool] | None) -> None:
        """One optimizer step of the pieces in one bucket's shard; ``used[i]`` False skips parameter ``i``.

        Call :meth:`count_steps` once per optimizer step first.
        """
        for group_index, group in enumerate(groups):
            by_step: dict[int, list[Piece]] = defaultdict(list)
            for piece in self._pieces.get((bucket_index, group_index), ()):
                if used is None or used[piece.param_index]:
                    by_step[self.steps[piece.param_index]].append(piece)
            for step, pieces in by_step.items():
                self.rule.update(pieces, step, group)
        record = self.records[bucket_index]
        if record.separate_master:
            record.param.copy_(record.master)

    @torch.no_grad()
    def adopt_external_writes(self) -> None:
        """Take into the fp32 masters any 16-bit parameter element written since the last step.

        A write from outside the optimizer (weights loaded in ``on_fit_start``, a callback that
        averages or resets parameters) changes the 16-bit parameter but not its master, which would
        bring the old value back at the next update. Elements whose parameter no longer equals the
        master rounded to its dtype are re-read from the parameter; no host synchronisation.
        """
        for record in self.records:
            if record.separate_master:
                written = record.param != record.master.to(record.param.dtype)
                record.master.copy_(torch.where(written, record.param.to(record.master.dtype), record.master))

    @torch.no_grad()
    def refresh_master(self) -> None:
        """Re-read separate master shards from the parameter shards (after the parameters were loaded)."""
        for record in self.records:
            if record.separate_master:
                record.master.copy_(record.param)

    def nbytes(self) -> int:
        """Bytes of optimizer state this rank holds (separate master copies included)."""
        return sum(record.nbytes() for record in self.records)
