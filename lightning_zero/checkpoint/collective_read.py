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

    It catches a rank given a path without ``meta.pt`` while the others have one, or a checkpoint
    on storage some nodes do not share; not two ranks given two different complete checkpoints. A
    directory without ``meta.pt`` on every rank (an interrupted save, an empty directory) is no
    checkpoint any loader can read: the documented error, not Lightning's ``IsADirectoryError``.

    Raises:
        CheckpointError: on every rank, if some ranks see ``path/meta.pt`` and others do not, or a
            rank could not look (an ``OSError`` other than "not found", named with its rank), or
            ``path`` is a directory without ``meta.pt``.
    """
    try:  # never raise before the collective the other ranks enter
        here, folder, why = is_sharded_checkpoint(path), os.path.isdir(path), ""
    except OSError as err:  # EACCES, EIO, ESTALE: this rank cannot tell
        here, folder, why = False, False, f" ({type(err).__name__}: {err})"
    if comm.same_everywhere([int(here), int(bool(why)), int(folder)]) and not why:  # alike on every rank
        if folder and not here:
            read_meta(path)  # raises: naming the missing meta.pt
        return here
    blind = comm.union_of([] if here else [f"{comm.rank}{why}"])
    named = ", ".join(blind[:NAMED]) + (f" and {len(blind) - NAMED} more" if len(blind) > NAMED else "")
    who = f"rank {named} does" if len(blind) == 1 else f"ranks {named} do"
    others = " where the other ranks do" if len(blind) < comm.world_size else ""
    raise CheckpointError(
        f"{path}: {who} not see {META}{others}: give every rank the same checkpoint path, on storage "
        "that every node shares"
    )
