"""The two steps of a checkpoint's commit that touch the file system on rank 0
(:class:`~lightning_zero.checkpoint.format.StagedSave`): checking that it sees every rank's files,
with a bounded number of metadata calls, and putting the temporary directory in place atomically;
and what a failed commit tells each rank about what it left at the target."""

from __future__ import annotations

import ctypes
import errno
import math
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_zero.comm.handles import CommError

SIZE_CHECKS = 256
"""Files whose size rank 0 checks before a commit: all of them up to this many, else the first file
of each host (evenly spread over the hosts, this many at most). The presence of every file is
checked by one listing of the directory whatever their number."""


def size_checked(everyone: list[tuple[str, Any]]) -> list[tuple[int, str, int]]:
    """``(rank, file name, size)`` of the files whose size rank 0 checks at a commit (see
    :data:`SIZE_CHECKS`), from every rank's ``(host, [(name, size, sha256), ...])``."""
    files = [(rank, name, size) for rank, (_, written) in enumerate(everyone) for name, size, _ in written]
    if len(files) <= SIZE_CHECKS:
        return files
    first_of_host: dict[str, tuple[int, str, int]] = {}
    for rank, (host, written) in enumerate(everyone):
        if written and host not in first_of_host:
            first_of_host[host] = (rank, written[0][0], written[0][1])
    hosts = list(first_of_host.values())
    return hosts[:: max(1, math.ceil(len(hosts) / SIZE_CHECKS))]


def unseen_files(tmp: Path, everyone: list[tuple[str, Any]], host: str) -> list[str]:
    """Rank 0's check that it sees the other ranks' files: what it cannot see, as errors.

    Every file is looked for in one listing of ``tmp`` (a node-local disk on any node leaves that
    node's files out of it); sizes are compared for the files :func:`size_checked` picks (all of
    them up to :data:`SIZE_CHECKS`). So rank 0 makes a bounded number of metadata calls whatever
    the number of ranks: on a parallel file system a ``stat`` per file costs it ~1 ms each (seconds
    at thousands of ranks), while a listing returns many names per call. Every byte of a file is
    checked (size and sha256) when it is loaded.
    """
    listed = {entry.name for entry in os.scandir(tmp)}  # an OSError: the caller reports it
    unseen = [
        f"rank {rank} (host {rank_host}) wrote {name}, rank 0 (host {host}) sees it missing"
        for rank, (rank_host, files) in enumerate(everyone)
        for name, _, _ in files
        if name not in listed
    ]
    for rank, name, size in size_checked(everyone):
        found = (tmp / name).stat().st_size if name in listed else size
        if found != size:
            unseen.append(
                f"rank {rank} (host {everyone[rank][0]}) wrote {name}, rank 0 (host {host}) sees it "
                f"{found} bytes instead of {size}"
            )
    if unseen:
        unseen.append(
            f"rank 0 cannot see the other ranks' files in {tmp.parent}: the checkpoint directory must be "
            "on storage shared by all nodes (every rank writes its own shard file into it; a disk local "
            "to each node cannot hold a sharded checkpoint)"
        )
    return unseen


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False  # kernel or file system without RENAME_EXCHANGE
    raise OSError(ctypes.get_errno(), f"renameat2({a}, {b}, RENAME_EXCHANGE) failed")


def commit_directory(tmp: Path, target: Path, renamed: Callable[[], None] | None = None) -> None:
    """Put ``tmp`` at ``target``, atomically where the OS allows; ``renamed()`` is called once the
    new directory is in place (a failure after that, syncing the parent or deleting the old one,
    leaves the new checkpoint committed: the caller must not report the old one as kept).

    A new path is a rename. An existing one (directory, file or symlink) is swapped with ``tmp`` in
    one ``renameat2(RENAME_EXCHANGE)`` and then deleted, so ``target`` is never missing; without
    that call the old one is moved aside first (a short window with neither under ``target``; if
    the second rename fails, the old one is moved back).
    """
    if not (target.exists() or target.is_symlink()):
        tmp.rename(target)
        old = None
    elif _exchange(tmp, target):
        old = tmp
    else:
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex}"
        target.rename(old)
        try:
            tmp.rename(target)
        except OSError:
            old.rename(target)  # the previous checkpoint back in place
            raise
    if renamed is not None:
        renamed()
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


IN_PLACE = "the new checkpoint is in place, but "
"""How rank 0's error begins when it failed after putting the new directory at its target."""


def save_outcome(
    rank: int, progress: dict[str, bool], peer_failure: CommError | None, errors: list[str]
) -> str:
    """What a failed save left at its target, as far as this rank knows: the new checkpoint when rank 0
    had put it in place (its verdict then failed to reach the others, or syncing or deleting the old
    one failed); unknown to another rank whose word had reached rank 0 when the collectives failed;
    otherwise the previous one."""
    if progress["committed"] or any(IN_PLACE in e for e in errors):
        if peer_failure is not None:
            return "rank 0 committed the new one, but its verdict did not reach every rank"
        return "rank 0 put the new one in place, then failed"
    if peer_failure is not None and rank != 0 and progress["sent"]:
        return "rank 0 may have committed the new one before the verdict failed (its meta.pt tells)"
    return "the previous one (if any) is kept"
