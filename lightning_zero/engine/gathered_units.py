"""Stage 3: which units hold full parameters, and the calls that gather, free and prefetch them.

:class:`GatheredUnits` keeps one :class:`~lightning_zero.engine.unit_state.UnitState` per unit and the
forward order the prefetches follow (the last forward's, and this one's so far), and which unit is
held from its forward to its backward; :class:`~lightning_zero.engine.unit_gather.UnitGather`, its
subclass, installs the forward and backward hooks that call these at the moments described there.
A gather is exact, or from int8 rows in a training forward or backward under ``gather_dtype="int8"``
(:mod:`lightning_zero.engine.unit_state` does the all-gathers). Every call here that gathers issues
collectives: all ranks call it for the same units in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_zero.comm.communicator import Comm
from lightning_zero.comm.trace import span
from lightning_zero.engine.unit_state import Pending, UnitState, complete, launch
from lightning_zero.layout.buckets import Bucket, BucketPlan
from lightning_zero.layout.flat import FlatParams
from lightning_zero.layout.units import UnitLayout


class GatheredUnits:
    """The units of one model and one plan, and which of them hold full parameters."""

    def __init__(
        self,
        plan: BucketPlan,
        flat: FlatParams,
        comm: Comm,
        layout: UnitLayout,
        reshard_after_forward: bool,
        prefetch_units: int,
        quantized: bool = False,
    ) -> None:
        self.plan, self.flat, self.comm, self.layout = plan, flat, comm, layout
        self.quantized = quantized
        """``gather_dtype="int8"``: the gathers of training forwards and backwards send int8 rows."""
        self.reshard_after_forward = reshard_after_forward
        self.hold_for_step = False
        """Pipeline parallelism: a unit gathered in the step stays gathered until the optimizer step
        frees it (the step's ``M`` micro-batches run forward and backward through it in turns): one
        all-gather per unit and step, not two per micro-batch, the stage's full parameters held
        through the step (torchtitan keeps FSDP2's parameters so under pipeline parallelism)."""
        self.prefetch_units = prefetch_units
        by_unit: dict[int, list[Bucket]] = {}
        for bucket in plan.buckets:
            by_unit.setdefault(bucket.unit, []).append(bucket)
        self.units = [
            UnitState(u, layout.names[u] or "<root>", by_unit.get(u, []), layout.params_of(u))
            for u in range(len(layout.modules))
        ]
        self._order: list[int] = [u for u in range(1, len(self.units))]  # forward order, last step's
        self._running: list[int] = []  # forward order of this step so far
        self._kept: int | None = None  # the last unit, held from its forward to its backward

    def gathered(self, unit: int) -> bool:
        """Whether ``unit``'s full parameters have storage (filled, or being filled)."""
        return all(self.flat.is_gathered(b) for b in self.units[unit].buckets)

    def gather(self, unit: int, wait: bool = True, quantized: bool = False, strict: bool = False) -> None:
        """Launch ``unit``'s all-gathers unless it is gathered; with ``wait``, complete them.
        ``quantized`` (a training forward or backward under ``gather_dtype="int8"``): int8 rows are
        enough. A unit gathered from int8 rows is gathered again, exactly, for any other request;
        ``strict`` (a backward, or a recomputation, that must see what its forward saw): a unit held
        exactly is gathered again from int8 rows too when ``quantized`` asks for them."""
        with span(f"unit {self.units[unit].name}: gather", self.flat.device):
            self._gather(unit, wait, quantized, strict)

    def _gather(self, unit: int, wait: bool, quantized: bool, strict: bool) -> None:
        state = self.units[unit]
        quantized = quantized and self.quantized
        if self.gathered(unit) and state.quantized != quantized and (strict or state.quantized):
            complete(self.comm, self.flat, state)
            state.pending = [self._launch(bucket, quantized) for bucket in state.buckets]
            state.quantized = quantized
        elif not self.gathered(unit):
            for bucket in state.buckets:
                self.flat.materialize(bucket)
            state.pending = [self._launch(bucket, quantized) for bucket in state.buckets]
            state.quantized = quantized
        if wait:
            complete(self.comm, self.flat, state)

    def _launch(self, bucket: Bucket, quantized: bool) -> Pending:
        return launch(self.comm, self.flat, bucket, quantized, self.units[bucket.unit].name)

    def free(self, unit: int) -> None:
        """Release ``unit``'s full parameters (after its gathers in flight complete)."""
        state = self.units[unit]
        with span(f"unit {state.name}: free", self.flat.device):
            complete(self.comm, self.flat, state)
            for bucket in state.buckets:
                self.flat.free(bucket)
        state.quantized = False
        if unit == self._kept:
            self._kept = None

    def refill(self, unit: int, quantized: bool) -> None:
        """Gather ``unit`` again from the shards, from int8 rows where ``quantized`` (as it was held
        before a block that read or wrote its full values); a unit held for its backward stays so."""
        kept = self._kept
        self.free(unit)
        self.gather(unit, quantized=quantized)
        self._kept = kept

    def _release_kept(self, running: int) -> None:
        """``running``'s forward starts (outside backward): a unit held for its backward since an earlier
        forward is freed, as the others were after theirs (it ran before ``running``, or that forward
        gets no backward); a later backward gathers it again."""
        if self._kept is not None and self._kept != running:
            self.free(self._kept)

    def free_all(self) -> None:
        """Release every unit (the state between optimizer steps)."""
        for unit in range(len(self.units)):
            self.free(unit)

    def gather_all(self) -> None:
        """Every unit gathered (to read or save full parameters); :meth:`free_all` releases them."""
        self.gather_units(range(len(self.units)))

    def gather_units(self, units: Sequence[int]) -> None:
        """``units`` gathered (their all-gathers launched together, then waited for)."""
        for unit in units:
            self.gather(unit, wait=False)
        for unit in units:
            self.gather(unit)

    def _prefetch(
        self, after: int, order: Sequence[int], quantized: bool | None, skip_ran: bool = False
    ) -> None:
        """Launch the gathers of the ``prefetch_units`` units that follow ``after`` in ``order`` (the
        first ones after the root); ``quantized=None`` (backward): each in the mode its forward ran.
        ``skip_ran`` (``after`` runs for the first time in this forward): not the units that already
        ran in it (``order`` was a wrong guess there); a repeated pass prefetches as the first did."""
        if after != 0 and after not in order:
            return
        start = 0 if after == 0 else order.index(after) + 1
        for unit in order[start : start + self.prefetch_units]:
            if skip_ran and unit in self._running:
                continue
            if quantized is None:
                if not self._finished(unit):
                    self.gather(unit, wait=False, quantized=self.units[unit].forward_quantized, strict=True)
            else:
                self.gather(unit, wait=False, quantized=quantized)

    def _record_mode(self, unit: int, training: bool) -> None:
        """A forward of ``unit`` runs on what it holds: a training forward's mode is what its backward,
        a recomputation and a backward prefetch gather; an evaluation's is nobody's."""
        if training:
            state = self.units[unit]
            state.forward_quantized = state.quantized
            state.trained = True

    def last_in_forward(self) -> int | None:
        """The unit that ran last in the last forward (registration order before the first), kept
        gathered after its forward with ``reshard_after_forward``: its backward comes first."""
        return self._order[-1] if self._order else None

    def held_through_backward(self, unit: int) -> bool:
        """Whether ``unit`` stays gathered from its forward to its backward (gathered once per
        micro-batch): the root, the last unit, and every unit without ``reshard_after_forward``."""
        return self.hold_for_step or not self.reshard_after_forward or unit in (0, self.last_in_forward())

    def _finished(self, unit: int) -> bool:
        """Every parameter of ``unit`` (not the root) delivered its gradient in this backward: no op
        of this backward reads them any more. It is freed then and never gathered again in this
        backward, also where a backward hook or prefetch asks for it: on a rank where one of its
        parameters got no gradient it is still gathered there, so that no rank issues a gather the
        others do not (a parent unit whose own parameters ran after its child's forward)."""
        state = self.units[unit]
        return unit != 0 and len(state.arrived) == len(state.params)
