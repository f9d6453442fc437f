"""The last collectives each process group issued on this rank: what a failure or timeout names.

A collective that fails (a dead peer) or never completes (a hung one, past the process group's timeout)
ends in a :class:`~lightning_zero.comm.CommError` whose message closes with this rank's recent
collectives, per group, oldest first::

    last collectives on this rank: world group (2 ranks): #14 parameter all-gather bucket 1 (104 x
    float32), #15 gradient reduce-scatter bucket 0 (6 x float32); background group (2 ranks): #3 gather
    of Python objects to rank 0 (an object)

The failed collective's group comes first, then the others, the most recently used first. ``#n`` is the
n-th collective this rank issued on that group (through any :class:`~lightning_zero.comm.Comm` over
it), so the ranks' messages side by side show where their sequences parted: the rank whose group
stopped at a lower number is the one that did not arrive (NCCL matches collectives by that position;
torch's flight recorder numbers them the same way, ``collective_seq_id``). The label (``bucket 3``,
``unit 'blocks.0'``) says which of the engine's buckets or units it was.

Kept in production, at a bounded cost: one :class:`GroupHistory` per process group and role on this
rank, a ``deque`` of the last :data:`SIZE` entries, each a tuple appended before the collective is
issued (no formatting, no device access; ``benchmarks/history_overhead.py`` measured about 0.2 us
per collective and 0.4 us per labelled bucket, 0.015 % of a tiny GPT's step on 2 CPU ranks). A ring
lives while a ``Comm`` over its group does (the registry holds it weakly), so a message does not name
groups of an earlier fit. Groups of one rank are not kept: their collectives are local copies.
Every rank of a simulated world (:mod:`lightning_zero.comm.simulated`) has rings of its own.

On NCCL the message adds where torch's flight recorder keeps every rank's record of the same
collectives (:func:`~lightning_zero.comm.backends.failure_hint`).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import deque
from typing import Any

SIZE = 16
"""Collectives kept per group (all of them named for the failed collective's group)."""
OTHERS_SHOWN = 4
"""Collectives named per other group."""
GROUPS_SHOWN = 4
"""Groups named besides the failed one (the most recently used)."""

_CLOCK = itertools.count(1)
"""Orders the groups of this process by their last use."""


class GroupHistory:
    """The ring of one process group on this rank (see the module docstring)."""

    def __init__(self, role: str, world_size: int, hint: str = "") -> None:
        self.role, self.world_size, self.hint = role, world_size, hint
        self.ring: deque[tuple[int, str, str, int, Any]] = deque(maxlen=SIZE)
        """``(number, what, label, numel, dtype)``, oldest first."""
        self.issued = 0
        """Collectives issued on the group so far (the number of the last one)."""
        self.used = 0
        """When it was last used, on this process's clock of notes (orders the groups named)."""
        self.label = ""
        """Which bucket the group's collectives are for now (:meth:`labelled`)."""

    def note(self, what: str, numel: int, dtype: Any) -> None:
        """A collective is about to be issued (the caller's thread; a group is used by one thread)."""
        self.issued += 1
        self.used = next(_CLOCK)
        self.ring.append((self.issued, what, self.label, numel, dtype))

    def labelled(self, label: str) -> GroupHistory:
        """``with ring.labelled("bucket 3"):`` the collectives noted inside carry the label (a context
        of its own, not a generator's: one per bucket launch, kept cheap)."""
        self.label = label
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self.label = ""

    def describe(self, last: int = SIZE) -> str:
        """``ROLE group (N ranks): #n what label (numel x dtype), ...``: the last ``last`` entries."""
        entries = list(self.ring)[-last:] if last < SIZE else list(self.ring)
        issued = ", ".join(_entry(*entry) for entry in entries) or "none"
        return f"{self.role} group ({self.world_size} ranks): {issued}"


def _entry(number: int, what: str, label: str, numel: int, dtype: Any) -> str:
    size = "an object" if numel < 0 else f"{numel} x {str(dtype).removeprefix('torch.')}"
    return f"#{number} {what}{f' {label}' if label else ''} ({size})"


class _Registry:
    """Every live ring of this process, by ``(global rank, role, group's global ranks, group name)``."""

    def __init__(self) -> None:
        self._rings: weakref.WeakValueDictionary[tuple[Any, ...], GroupHistory] = (
            weakref.WeakValueDictionary()
        )
        self._lock = threading.Lock()  # a background thread builds its group's Comm too

    def ring(self, key: tuple[Any, ...], role: str, world_size: int, hint: str) -> GroupHistory:
        with self._lock:
            found = self._rings.get(key)
            if found is None:
                found = self._rings[key] = GroupHistory(role, world_size, hint)
            return found

    def of_rank(self, global_rank: int | None) -> list[GroupHistory]:
        with self._lock:
            return [ring for key, ring in self._rings.items() if global_rank is None or key[0] == global_rank]

    def forget(self) -> None:
        with self._lock:
            self._rings.clear()


_REGISTRY = _Registry()


def group_history(
    global_rank: int, role: str, world_size: int, global_ranks: list[int], name: str, hint: str = ""
) -> GroupHistory:
    """The ring of the group of ``world_size`` ranks ``global_ranks`` (its ``name``) on
    ``global_rank``, shared by every ``Comm`` over it, which keeps it alive; a group of one rank gets a
    ring of its own, never named. ``hint``: what a failure message adds for the group's backend."""
    if world_size < 2:
        return GroupHistory(role, world_size, hint)
    return _REGISTRY.ring((global_rank, role, tuple(global_ranks), name), role, world_size, hint)


def last_collectives(failed: GroupHistory | None = None, global_rank: int | None = None) -> str:
    """What a failure message ends with: ``last collectives on this rank: ...``, ``failed``'s group
    first with all it keeps, then up to :data:`GROUPS_SHOWN` other groups of ``global_rank`` (``None``:
    every rank of this process), the most recently used first, :data:`OTHERS_SHOWN` entries each;
    then the backend's hint (torch's flight recorder on NCCL), once."""
    others = [r for r in _REGISTRY.of_rank(global_rank) if r is not failed and r.ring]
    others.sort(key=lambda r: r.used, reverse=True)
    parts = [failed.describe()] if failed is not None else []
    parts += [r.describe(OTHERS_SHOWN) for r in others[:GROUPS_SHOWN]]
    hints = dict.fromkeys(r.hint for r in ([failed] if failed is not None else []) + others if r.hint)
    text = f"last collectives on this rank: {'; '.join(parts) or 'none'}"
    return text + "".join(f"; {hint}" for hint in hints)


def forget() -> None:
    """Drop every ring of this process (tests that build several worlds in one process)."""
    _REGISTRY.forget()
