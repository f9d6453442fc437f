"""The other ranks of a simulated world at a checkpoint save (:mod:`lightning_zero.comm.simulated`).

A simulated rank writes only its own shard file; the commit on rank 0 then needs every rank's file in
the temporary directory and every rank's status in its gather. :class:`PeerFiles` stands in for the
other ``N - 1`` ranks: when the status gather asks what rank ``k`` sends, it gives rank ``k``'s shard
file, a hard link of this rank's (all ranks' shards have the same size; the bytes are this rank's),
and its status naming that file, from host ``node<k // ranks_per_node>``. So rank 0's commit runs
on ``N`` real files and ``N`` statuses (its listing, size checks, ``meta.pt`` of ``N`` entries and
the atomic rename), and a resume on another simulated world reads real shard files.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from lightning_zero.checkpoint.format import shard_name


class PeerFiles:
    """``peer`` for :meth:`~lightning_zero.comm.CommGroups.simulated` at a save into ``target``, in a
    world of ``world_size`` ranks, ``ranks_per_node`` on a host; ``shard_group_size``: hybrid
    sharding, where the first shard group writes the shard files (``shard_group_size`` of them)."""

    def __init__(
        self,
        target: str | os.PathLike[str],
        world_size: int,
        ranks_per_node: int = 8,
        shard_group_size: int | None = None,
    ) -> None:
        self.target, self.world_size, self.ranks_per_node = Path(target), world_size, ranks_per_node
        self.files = shard_group_size or world_size
        """Shard files a checkpoint has: one per rank of the first shard group."""
        self.seconds = 0.0
        """Time spent making them (the simulation's, not the save's)."""

    def __call__(self, obj: Any, rank: int) -> Any:
        began = time.perf_counter()
        try:
            return self._status(obj, rank)
        finally:
            self.seconds += time.perf_counter() - began

    def _status(self, obj: Any, rank: int) -> Any:
        if not _is_status(obj):
            return obj
        host = f"node{rank // self.ranks_per_node}"
        if rank >= self.files:
            return (host, [])  # another replica group: it holds the same shards and writes none
        [tmp] = self.target.parent.glob(f".{self.target.name}.tmp-*")
        written = []
        for name, size, digest in obj[1]:
            if name.startswith("shard-"):  # model_extra.pt: rank 0's alone
                theirs = shard_name(rank, self.files)
                os.link(tmp / name, tmp / theirs)
                written.append((theirs, size, digest))
        return (host, written)


def _is_status(obj: Any) -> bool:
    """A save's status: ``(host, [(file name, size, sha256), ...])``."""
    return (
        isinstance(obj, tuple)
        and len(obj) == 2
        and isinstance(obj[1], list)
        and all(isinstance(f, tuple) and len(f) == 3 for f in obj[1])
    )
