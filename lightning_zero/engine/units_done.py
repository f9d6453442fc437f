"""Stage 3: which units' backward is done, read off the order of their forwards alone.

At stage 3 a unit's gradient buckets launch once its backward is done, at the backward hook of a
later unit (before that unit's gather), never from the gradient hooks
(:mod:`lightning_zero.engine.reducer`): the units' backward gathers are collectives too, and where a
launch goes among them must be the same on every rank, whatever parameters each rank's data used.

The rule. A forward clock ticks at the start and at the end of every unit forward (outside backward).
When the backward hook of a forward that ended at tick ``t`` fires, its output gradient is ready; the
autograd engine runs a device's backward nodes in reverse order of their creation, so every node made
after tick ``t`` has run by then, and with it the gradient accumulation of every parameter of a
forward that started after ``t``. A unit is therefore done at that hook when each of its forwards with
a backward hook since the last backward started after ``t``. This depends on which units ran and in
what order (the program, the same on every rank, as FSDP requires), never on which parameters got a
gradient. Nested forwards work out: the root, around every unit, is done only at the end of the
backward, as is a unit whose forwards registered no hook (a reentrant checkpoint's forward runs
without gradients), and a unit called twice is done after the backward of its first call.

Limits: the backward nodes of one device run on one thread in that order (autograd's per-device
ready queue); nodes on another device's thread (a CPU op inside a CUDA model) are not ordered with
them. A gradient that arrives after its bucket launched closes the round where it arrives (every
bucket left launches there, and the used-parameter agreement runs) and opens a second one: the sums
are right, but that place follows the timing of the other thread, not the program.
"""

from __future__ import annotations


class UnitsDone:
    """The forward clock and, per unit, its first forward with a backward hook since the last backward."""

    def __init__(self, units: int) -> None:
        self._clock = 0
        self._starts: list[list[int]] = [[] for _ in range(units)]  # forwards running now, innermost last
        self._first: list[int | None] = [None] * units
        self._reduced = [False] * units  # handed to the reducer in this backward

    def forward_starts(self, unit: int) -> None:
        """``unit``'s forward begins (outside backward)."""
        self._clock += 1
        self._starts[unit].append(self._clock)

    def forward_ends(self, unit: int, hooked: bool) -> int:
        """``unit``'s forward ends; ``hooked``: its outputs carry a backward hook. Returns its tick."""
        start = self._starts[unit].pop() if self._starts[unit] else self._clock
        self._clock += 1
        if hooked:
            first = self._first[unit]
            self._first[unit] = start if first is None else min(first, start)
        return self._clock

    def done_at(self, ended: int) -> list[int]:
        """At the backward hook of a forward that ended at tick ``ended``: the units whose backward is
        done and not yet reported in this backward, in the order their backward ran (the root never:
        it is done at the end of the backward)."""
        done = [
            u
            for u, first in enumerate(self._first)
            if u != 0 and not self._reduced[u] and first is not None and first > ended
        ]
        done.sort(key=lambda u: -(self._first[u] or 0))
        for u in done:
            self._reduced[u] = True
        return done

    def backward_ends(self) -> None:
        """The end of a backward: the forwards before it are gone through."""
        self._first = [None] * len(self._first)
        self.backward_abandoned()

    def backward_abandoned(self) -> None:
        """A backward raised: the next one reports every unit anew (the forwards stay recorded)."""
        self._reduced = [False] * len(self._reduced)

    def forget(self) -> None:
        """An optimizer step: nothing of the forwards before it is expected any more."""
        self._starts = [[] for _ in self._starts]
        self._first = [None] * len(self._first)
        self.backward_abandoned()
