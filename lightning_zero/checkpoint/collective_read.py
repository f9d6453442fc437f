"""What every rank of a load decides alike about a checkpoint (call these on all ranks).

A rank that decided alone could take another branch than its peers (one reads the sharded
directory, another hands the path to Lightning's single-file loader) and enter other collectives:
on NCCL the ranks would then hang until the timeout. So the decisions are collective, and their
cost does not grow with the number of ranks: one read of ``meta.pt`` broadcast from rank 0, one
small all-reduce for "is it sharded".
"""

from __future__ import annotations

import os
from typing import Any

from lightning_zero.checkpoint.format import META, CheckpointError, is_sharded_checkpoint, read_meta
from lightning_zero.comm.communicator import Comm

NAMED = 8
"""Ranks a problem names; the rest are counted."""


def read_meta_once(path: str | os.PathLike[str], comm: Comm) -> dict[str, Any]:
    """:func:`~lightning_zero.checkpoint.format.read_meta` on rank 0 of ``comm``, broadcast to the
    others: one read of ``meta.pt`` from the file system instead of one per rank (it lists every shard
    file, so it grows with the world size that wrote it, and thousands of ranks would each read it
    from the same metadata and storage servers at once).

    Raises:
        CheckpointError: on every rank, rank 0's (the file missing, unreadable or too new).
    """
    meta: dict[str, Any] | str | None = None
    if comm.rank == 0:
        try:
            meta = read_meta(path)
        except CheckpointError as err:
            meta = str(err)
    meta = comm.broadcast_object(meta, src=0) if comm.world_size > 1 else meta
    if isinstance(meta, str):
        raise CheckpointError(meta)
    assert meta is not None
    return meta


def sharded_everywhere(path: str | os.PathLike[str], comm: Comm) -> bool:
    """Whether ``path`` is a sharded checkpoint directory, the same answer on every rank: each rank
    looks for ``meta.pt`` (one ``stat``), one all-reduce compares the answers; only on a mismatch are
    the ranks that do not see it gathered, to be named.

    Raises:
        CheckpointError: on every rank, if some ranks see ``path/meta.pt`` and others do not (a
            path that is not on storage every node shares, or another path per rank), naming the
            ranks that do not.
    """
    here = is_sharded_checkpoint(path)
    if comm.same_everywhere([int(here)]):
        return here
    blind = comm.union_of([] if here else [str(comm.rank)])
    named = ", ".join(blind[:NAMED]) + (f" and {len(blind) - NAMED} more" if len(blind) > NAMED else "")
    who = f"rank {named} does" if len(blind) == 1 else f"ranks {named} do"
    raise CheckpointError(
        f"{path}: {who} not see {META} where the other ranks do: give every rank the same checkpoint "
        "path, on storage that every node shares"
    )
