"""``Model.load_from_checkpoint(DIR)`` for a lightning-zero checkpoint directory.

Lightning's ``LightningModule.load_from_checkpoint`` reads its file through
``lightning.pytorch.core.saving.pl_load``, which can only open a single file. ``import lightning_zero``
wraps that one function: a path that is a directory is a lightning-zero checkpoint, assembled in
memory (:func:`~lightning_zero.checkpoint.consolidate.load_module_checkpoint`; one without
``meta.pt`` is a ``CheckpointError`` naming it); every other path goes to Lightning's own loader
unchanged. No consolidation step for the user.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch.core.saving as saving

from lightning_zero.checkpoint.consolidate import load_module_checkpoint

_MARK = "_lightning_zero_loader"


def install() -> None:
    """Route sharded checkpoint directories through our loader (idempotent)."""
    original = saving.pl_load
    if getattr(original, _MARK, False):
        return

    def load(path_or_url: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        # a directory: ours (one without meta.pt, an interrupted save, is named as such instead of
        # Lightning's IsADirectoryError)
        if isinstance(path_or_url, str | os.PathLike) and os.path.isdir(path_or_url):
            return load_module_checkpoint(path_or_url, map_location)
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    setattr(load, _MARK, True)
    saving.pl_load = load
