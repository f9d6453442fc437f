"""Weight averaging (EMA, SWA) kept on the shards: each rank averages only the elements it owns.

torch's ``AveragedModel`` (and Lightning's ``WeightAveraging`` callbacks built on it) keep a whole
second copy of the model on every rank and average it after each optimizer step. Here every bucket
record (:class:`~lightning_zero.engine.shard_state.ShardRecord`) keeps ``average``, a tensor shaped
like its master shard: ``1/N`` of the fp32 weights per rank (``N`` = the shard group's size), at
every stage, updated from the master right after the step without any communication.

The update is ``AveragedModel.update_parameters``' to the letter, applied to the flat shards instead
of to the parameters: the first update copies, each later one calls the averaging function with the
number of updates so far (a ``long`` tensor on the average's device); ``multi_avg_fn`` gets lists of
shards grouped by device and dtype, ``avg_fn`` one shard at a time, and neither given means torch's
SWA (equal weights). The functions torch ships (``get_ema_avg_fn``, ``get_ema_multi_avg_fn``,
``get_swa_*``) are elementwise, so the result is the same element for element; a function that
depends on a parameter's shape cannot be applied to shards (a shard holds pieces of several
parameters, flattened).

The average is taken of the master weights: for fp32/fp64 parameters the parameters themselves (as
``AveragedModel`` does), for 16-bit ones their fp32 masters (``AveragedModel`` averages the rounded
16-bit values in 16 bits).

Swapping the average in (validation with the averaged weights, as ``WeightAveraging`` does) writes
it into the masters, keeps the current weights in the averages' place, and publishes the shards: an
all-gather of every bucket below stage 3; at stage 3 the units are freed and the next forward
gathers the averaged shards. A second swap restores both. Transient memory: one shard.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.optim.swa_utils import get_swa_avg_fn, get_swa_multi_avg_fn
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

from lightning_zero.engine.shard_state import ShardRecord, ShardState

AvgFn = Callable[[Tensor, Tensor, Tensor], Tensor]
MultiAvgFn = Callable[[list[Tensor], list[Tensor], Tensor], None]


@torch.no_grad()
def average_into(
    averaged: Sequence[Tensor],
    current: Sequence[Tensor],
    n_averaged: int,
    avg_fn: AvgFn | None = None,
    multi_avg_fn: MultiAvgFn | None = None,
) -> None:
    """One update of ``averaged`` towards ``current`` after ``n_averaged`` earlier updates, as
    ``torch.optim.swa_utils.AveragedModel.update_parameters`` does it (the first update copies).

    Raises:
        ValueError: if both ``avg_fn`` and ``multi_avg_fn`` are given.
    """
    if avg_fn is not None and multi_avg_fn is not None:
        raise ValueError("give avg_fn or multi_avg_fn, not both (as torch's AveragedModel)")
    pairs = [(a, c.detach().to(a.device)) for a, c in zip(averaged, current, strict=True)]
    if n_averaged == 0:
        for a, c in pairs:
            a.copy_(c)
        return
    if avg_fn is not None:
        for a, c in pairs:
            a.copy_(avg_fn(a, c, torch.tensor(n_averaged, dtype=torch.long, device=a.device)))
        return
    grouped: dict[tuple[torch.device, torch.dtype], list[tuple[Tensor, Tensor]]] = defaultdict(list)
    for a, c in pairs:
        grouped[a.device, a.dtype].append((a, c))
    for (device, _), group in grouped.items():
        mine, theirs = [a for a, _ in group], [c for _, c in group]
        count = torch.tensor(n_averaged, dtype=torch.long, device=device)
        if multi_avg_fn is not None:
            multi_avg_fn(mine, theirs, count)
        elif device.type in _get_foreach_kernels_supported_devices():  # torch's own choice
            get_swa_multi_avg_fn()(mine, theirs, count)
        else:
            swa = get_swa_avg_fn()
            for a, c in group:
                a.copy_(swa(a, c, count))


class ShardAveraging:
    """The engine's weight average (the attributes :class:`ShardEngine` sets; a part of it)."""

    state: ShardState
    n_averaged: int
    """Updates of the average so far (``AveragedModel.n_averaged``); 0: the next update copies."""
    average_device: torch.device | None
    """Where the averages are kept as the user asked (``None``: beside the masters)."""
    average_loaded: bool
    """A checkpoint load restored the average (set by the sharded load; a standard file's average is
    restored by the integration)."""

    if TYPE_CHECKING:  # ParameterAccess's, through ShardEngine

        def publish_shards(self) -> None: ...
        def wait_for_params(self, root_only: bool = False) -> None: ...

    @property
    def averaging(self) -> bool:
        """Whether the records keep a weight average (:meth:`keep_weight_average`)."""
        return self.state.average_on is not None

    def keep_weight_average(self, device: torch.device | str | None = None) -> None:
        """Keep a weight average of this rank's shards from now on, starting from the current weights
        (``n_averaged`` 0), on ``device`` (``None``: the masters' device). Re-plans keep it."""
        self.average_device = None if device is None else torch.device(device)
        self.n_averaged = 0
        self.average_loaded = False
        self.state.keep_average(self.average_device or self.state.records[0].master.device)

    def update_weight_average(
        self, avg_fn: AvgFn | None = None, multi_avg_fn: MultiAvgFn | None = None
    ) -> None:
        """Average the current master shards in (:func:`average_into`). No communication.

        Raises:
            RuntimeError: if no average is kept.
        """
        records = self._averaged_records("update")
        averages = [r.average for r in records if r.average is not None]
        average_into(averages, [r.master for r in records], self.n_averaged, avg_fn, multi_avg_fn)
        self.n_averaged += 1

    @torch.no_grad()
    def swap_weight_average(self) -> None:
        """Exchange the weights and their average (call again to swap back). All ranks."""
        self.wait_for_params()  # a gather in flight reads the shards written here
        for record in self._averaged_records("swap"):
            assert record.average is not None
            held = record.master.clone()
            record.master.copy_(record.average)
            record.average.copy_(held)
            if record.separate_master:
                record.param.copy_(record.master)
        self.publish_shards()

    @torch.no_grad()
    def copy_weight_average(self) -> None:
        """Make the average the weights (the average is kept). All ranks."""
        self.wait_for_params()
        for record in self._averaged_records("copy"):
            assert record.average is not None
            record.master.copy_(record.average)
            if record.separate_master:
                record.param.copy_(record.master)
        self.publish_shards()

    def average_nbytes(self) -> int:
        """Bytes of weight average this rank holds (0 when none is kept)."""
        averages = [r.average for r in self.state.records if r.average is not None]
        return sum(a.numel() * a.element_size() for a in averages)

    def _averaged_records(self, what: str) -> list[ShardRecord]:
        if not self.averaging:
            raise RuntimeError(
                f"cannot {what} the weight average: none is kept; call keep_weight_average() first "
                "(the zero strategies do when a WeightAveraging callback is given)"
            )
        return self.state.records
