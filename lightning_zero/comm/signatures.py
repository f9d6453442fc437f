"""A hang named instead of waited out: before each collective, every rank compares what it is about to
issue (``LZ_CHECK_COLLECTIVES=1``, for debugging; off by default).

NCCL matches collectives by position: when one rank issues a reduce-scatter where another issues an
all-gather, both wait until the process group's timeout (or NCCL pairs them and mixes up tensors), and
the error, if any comes, says neither what each rank was doing nor why. With the check on, every
collective a :class:`~lightning_zero.comm.Comm` issues in program order (every group's: world, shard,
replicas) is first described by a :class:`Signature` (the group's role, the op, the element count,
the dtype, what it is for, and the line of code outside ``lightning_zero/comm`` that issued it), and
every rank of the world all-gathers the signatures over a gloo group of its own (on the host: it works
where the collectives themselves run on NCCL). The first time they differ, every rank raises the
same :class:`~lightning_zero.comm.handles.CommError`, naming the position, both sides and which ranks
issued which, within the time a gloo all-gather takes; the collective itself is never issued.

What it compares is what the collective-order recorder checks after a test
(:mod:`lightning_zero.comm.recorder`: every rank issues the same sequence of collectives, per group and
interleaved across groups), but live, on a real run, and before the collective that would hang. It
catches a program whose ranks take different paths through collectives (a unit that runs on some
ranks and not on others, a condition on rank-local data around a collective). torch's
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` checks, per process group, each collective's op and shapes against
the group's other ranks (through a gloo wrapper group, at a similar cost): it catches a mismatch inside
one group, but an interleaving that differs across groups (one rank in its shard group while another
is in its replica group) leaves each rank waiting in a different group's check until its timeout, and
neither names a line of code; ``NCCL_DEBUG=INFO`` logs what NCCL runs, per rank, after the fact. A rank
that issues no collective at all while the others wait in one is not a difference this check can see:
the others wait in the check until the side group's timeout (the strategy's ``timeout``), and fail
then.

Costs: one object all-gather over gloo per collective (milliseconds) and one host synchronisation
each; nothing when off (one attribute read per collective). Collectives that only some groups issue by
design (:meth:`~lightning_zero.comm.Comm.only_some_groups`) and those of background groups (the async
checkpoint writer's) are not compared.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_zero.comm.handles import CommError

ENV = "LZ_CHECK_COLLECTIVES"
"""Set to ``1`` to compare every collective's signature across ranks before issuing it."""

_COMM_DIR = str(Path(__file__).resolve().parent)
_PACKAGE_DIR = str(Path(__file__).resolve().parents[1])


def wanted() -> bool:
    """Whether ``LZ_CHECK_COLLECTIVES`` asks for the check (read when an engine is built)."""
    return os.environ.get(ENV, "").strip() not in ("", "0")


@dataclass(frozen=True)
class Signature:
    """What a rank is about to issue."""

    role: str
    op: str
    numel: int
    dtype: str
    what: str
    site: str

    def __str__(self) -> str:
        size = "a Python object" if self.numel < 0 else f"{self.numel} x {self.dtype}"
        return f"{self.op} of {size} on its {self.role} group ({self.what}; issued at {self.site})"


def call_site() -> str:
    """The first frame outside ``lightning_zero/comm`` and its caller: ``path:line (function) <-
    path:line (function)``, the paths relative to the package for its own files."""
    frame: Any = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_COMM_DIR):
        frame = frame.f_back
    sites: list[str] = []
    while frame is not None and len(sites) < 2:
        path = frame.f_code.co_filename
        if path.endswith("contextlib.py"):  # a decorator's wrapper (torch.no_grad): its caller says more
            frame = frame.f_back
            continue
        if path.startswith(_PACKAGE_DIR):
            path = "lightning_zero" + path[len(_PACKAGE_DIR) :]
        sites.append(f"{path}:{frame.f_lineno} ({frame.f_code.co_name})")
        frame = frame.f_back
    return " <- ".join(sites) or "?"


class SignatureCheck:
    """The side group every rank of the world compares its next collective over.

    Args:
        ranks: the world's global ranks (every rank of the default process group must call this,
            as :func:`torch.distributed.new_group` requires).
        timeout_s: how long a rank waits in the check for the others (the training group's timeout).
    """

    def __init__(self, ranks: list[int], timeout_s: float | None) -> None:
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        self._group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        self._size = len(ranks)
        self._ranks = ranks
        self.checked = 0
        """Collectives compared so far."""

    def check(self, role: str, op: str, numel: int, dtype: Any, what: str) -> None:
        """Compare this collective's signature with every rank's (blocking, on all ranks).

        Raises:
            CommError: on every rank alike, when some rank is about to issue another collective.
        """
        mine = Signature(role, op, numel, str(dtype).removeprefix("torch."), what, call_site())
        everyone: list[Any] = [None] * self._size
        dist.all_gather_object(everyone, mine, group=self._group)
        self.checked += 1
        if all(s == everyone[0] for s in everyone):
            return
        kinds: dict[Signature, list[int]] = {}
        for rank, signature in zip(self._ranks, everyone, strict=True):
            kinds.setdefault(signature, []).append(rank)
        lines = [
            f"{'rank' if len(ranks) == 1 else 'ranks'} {_ranges(ranks)}: {signature}"
            for signature, ranks in kinds.items()
        ]
        raise CommError(
            f"LZ_CHECK_COLLECTIVES: collective {self.checked} differs between ranks (NCCL would hang "
            "here, or mix up tensors):\n  " + "\n  ".join(lines)
        )


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    parts: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(parts)
