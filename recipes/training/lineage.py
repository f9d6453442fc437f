"""Which checkpoint of a run continues it: the newest complete one, whichever callback wrote it.

A run's checkpoints form one series in `<run_dir>/checkpoints`: the periodic step checkpoints of
`ModelCheckpoint`, its `last` (a copy, or a link with `save_last="link"`), the SLURM requeue save (which
goes through the same callback) and anything else written there as `*.ckpt`. Resuming (`ckpt_path=last`,
a requeued job) takes the newest *complete* one by modification time - the order they were written in,
which is also right after a resume from an older checkpoint, when an abandoned later branch may still
hold a higher step number. Ties (a `last` link and its target, or a copy written the same second) go
to a `last*` name: resuming from `last` leaves the step checkpoints to `ModelCheckpoint`'s pruning,
which never deletes the checkpoint a run resumed from.

Complete means, without reading tensors:

  * a lightning-zero sharded directory: `meta.pt` readable (rank 0 writes it last, then commits the
    directory with an atomic rename, so a crash mid-save leaves only a hidden `.NAME.tmp-*` sibling
    that is not a `*.ckpt`) and every file it lists present with its recorded size (the library's
    `verify_files(..., digests=False)`: a copied or truncated directory fails here;
    `lightning-zero verify` also checks the sha256 digests);
  * a file: a zip archive with its central directory (`torch.save`'s format; a file cut short has
    none);
  * a `last` link: its target is complete (a link left dangling by pruning is not).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

from lightning_zero.checkpoint import CheckpointError, is_sharded_checkpoint, read_meta, verify_files

LAST_PREFIX = "last"
"""`ModelCheckpoint.CHECKPOINT_NAME_LAST`: `last.ckpt`, `last-v1.ckpt`, ..."""


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a checkpoint whose write finished (see the module docstring)."""
    path = Path(path)
    if path.is_dir():
        if not is_sharded_checkpoint(path):
            return False
        try:
            meta = read_meta(path)
        except CheckpointError:
            return False
        return not verify_files(path, meta, digests=False)  # presence and sizes; no file is read
    return path.is_file() and zipfile.is_zipfile(path)


def newest_checkpoint(dirpath: str | os.PathLike[str] | None) -> Path | None:
    """The newest complete `*.ckpt` in `dirpath`, or None if there is none (or no such directory).

    Must give every rank the same answer: call it where all ranks see the same files (between saves).
    """
    if dirpath is None or not Path(dirpath).is_dir():
        return None
    candidates = [p for p in Path(dirpath).iterdir() if p.suffix == ".ckpt" and is_complete(p)]
    if not candidates:
        return None

    def order(path: Path) -> tuple[float, bool]:
        return path.stat().st_mtime, path.name.startswith(LAST_PREFIX)

    return max(candidates, key=order)
