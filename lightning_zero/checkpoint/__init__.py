"""Layer 4, checkpoints: the sharded directory format and its commit protocol, asynchronous saves,
loading onto any world size (resharding), consolidation into one standard file, and weights from
elsewhere (safetensors) read straight into the shards.

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
from lightning_zero.checkpoint.pretrained import SafetensorsReader, load_parameters

__all__ = [
    "EXTRA",
    "FORMAT_VERSION",
    "META",
    "CheckpointError",
    "SafetensorsReader",
    "is_sharded_checkpoint",
    "load_full_state_dict",
    "load_parameters",
    "read_meta",
    "save_safetensors",
    "save_sharded",
    "shard_name",
    "verify_files",
]
