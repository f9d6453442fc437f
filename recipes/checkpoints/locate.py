"""Which checkpoint and which run config a path means, for the commands that read a trained run.

A path is a checkpoint - a Lightning checkpoint file, or a committed lightning-zero checkpoint
directory (its `meta.pt` is written last) - or a run directory (`outputs/<run_name>`): its newest
complete checkpoint (`checkpoints/*.ckpt` or `*.ckpt`, by modification time; one cut off mid-write is
skipped, `recipes.training.lineage`). The run's `config.yaml` (written by `recipes.pretrain`) is found
beside the checkpoint or in its run directory.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from recipes.checkpoints.load import LoadError, require_checkpoint
from recipes.training import is_complete


def is_checkpoint(path: Path) -> bool:
    """A checkpoint file, or a committed lightning-zero checkpoint directory (`meta.pt` is written last)."""
    return path.is_file() or (path / "meta.pt").is_file()


def resolve_checkpoint(path: Path) -> Path:
    """`path` itself when it is a checkpoint, else the newest checkpoint of the run directory `path`.

    Raises:
        LoadError: if `path` does not exist, or is a directory holding no checkpoint.
    """
    require_checkpoint(path)
    if is_checkpoint(path):
        return path
    found = [*path.glob("checkpoints/*.ckpt"), *path.glob("*.ckpt")]
    candidates = [p for p in found if is_checkpoint(p) and is_complete(p)]  # not one cut off mid-write
    if not candidates:
        raise LoadError(
            f"{path} is neither a checkpoint (a file, or a directory with meta.pt) nor a run directory "
            "with checkpoints (checkpoints/*.ckpt or *.ckpt)"
        )

    def written(checkpoint: Path) -> float:
        return (checkpoint if checkpoint.is_file() else checkpoint / "meta.pt").stat().st_mtime

    return max(candidates, key=written)


def run_config(checkpoint: Path) -> DictConfig | None:
    """The `config.yaml` that `recipes.pretrain` left beside the checkpoint or in its run directory."""
    for folder in (checkpoint, checkpoint.parent, checkpoint.parent.parent):
        if (folder / "config.yaml").is_file():
            config = OmegaConf.load(folder / "config.yaml")
            return config if isinstance(config, DictConfig) else None
    return None
