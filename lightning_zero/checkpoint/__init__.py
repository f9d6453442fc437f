"""Layer 4, checkpoints: the sharded directory format and its commit protocol, asynchronous saves,
loading onto any world size (resharding), and consolidation into one standard file.

The names below are the public API (``lightning_zero.checkpoint``); the modules are internal.
"""

from lightning_zero.checkpoint.consolidate import load_full_state_dict
from lightning_zero.checkpoint.export import save_safetensors
from lightning_zero.checkpoint.format import (
    EXTRA,
    FORMAT_VERSION,
    META,
    CheckpointError,
    is_sharded_checkpoint,
    read_meta,
    save_sharded,
    shard_name,
    verify_files,
)

__all__ = [
    "EXTRA",
    "FORMAT_VERSION",
    "META",
    "CheckpointError",
    "is_sharded_checkpoint",
    "load_full_state_dict",
    "read_meta",
    "save_safetensors",
    "save_sharded",
    "shard_name",
    "verify_files",
]
