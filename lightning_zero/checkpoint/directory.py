"""A sharded checkpoint directory as its readers see it: file names, ``meta.pt``, checksums, keys.

The layout and the commit protocol are :mod:`lightning_zero.checkpoint.format`'s, which writes the
directory and re-exports every name here (its importers find them there). This module names the
files (one shard file per data-parallel, tensor-parallel and pipeline rank), reads ``meta.pt`` and
checks its format version, checks the files against the sizes and sha256 digests ``meta.pt`` lists,
and holds the keys a checkpoint's Lightning state and shard files use: what loading and resharding,
consolidation, ``lightning-zero verify`` and the strategies' checkpoint hooks need to read a
checkpoint, apart from what writes one. No collectives: every function runs on the calling rank alone.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from lightning_zero.checkpoint import pipeline_layout, tensor_layout

FORMAT_VERSION = 1
META = "meta.pt"
EXTRA = "model_extra.pt"
WEIGHTS_ONLY = "lightning_zero_weights_only"
"""Key in the Lightning state of a checkpoint saved with ``save_weights_only``: it cannot resume."""
FABRIC_KEYS = "lightning_zero_fabric"
"""Key in the Lightning state of a checkpoint saved by ``fabric.save``: ``{"module": key, "optimizer":
key}``, the keys of the user's state that held the sharded model and optimizer (or ``None``)."""
AVERAGE = "average"
"""Key of the weight average (:mod:`lightning_zero.engine.averaging`) in the shard files (per bucket, like
the moments) and in ``meta.pt`` (``{"n_averaged": int}``). A checkpoint that holds one gives its
model weights as the average wherever weights are read (consolidation, ``load_from_checkpoint``,
export, a fit without averaging), as Lightning's ``WeightAveraging`` writes ``state_dict``; only a
fit that keeps an average again resumes the current weights and the average apart."""
BUFFER_AVERAGE = "lightning_zero_buffer_average"
"""Key, in a callback's saved state, of the averaged buffers ``{name: tensor}`` that go with the weight
average (buffers are not sharded: the averaging callback keeps and saves them whole)."""


def averaged_buffers(lightning_state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The averaged buffers a callback saved beside the weight average (:data:`BUFFER_AVERAGE`), or
    ``{}``."""
    for state in (lightning_state.get("callbacks") or {}).values():
        if isinstance(state, dict) and BUFFER_AVERAGE in state:
            return dict(state[BUFFER_AVERAGE])
    return {}


def weights_extras(meta: dict[str, Any], extras: dict[str, Any]) -> dict[str, Any]:
    """Buffers and frozen parameters as the checkpoint's weights hold them: the averaged buffers
    where a weight average was saved (:data:`AVERAGE`), else ``extras`` as they are."""
    if AVERAGE not in meta:
        return extras
    buffers = averaged_buffers(meta["lightning"])
    return {name: buffers.get(name, value) for name, value in extras.items()}


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, from the future, or does not fit the model."""


def shard_name(
    rank: int, world_size: int, tensor: tuple[int, int] | None = None, pipeline: tuple[int, int] | None = None
) -> str:
    """The shard file of data-parallel rank ``rank`` of ``world_size``; ``tensor``: ``(t, T)``, that of
    tensor-parallel rank ``t`` of ``T`` (:mod:`lightning_zero.checkpoint.tensor_layout`); ``pipeline``:
    ``(p, P)``, of pipeline rank ``p`` of ``P`` (:mod:`lightning_zero.checkpoint.pipeline_layout`)."""
    suffix = "" if pipeline is None else f"-pipeline-{pipeline[0]:02d}-of-{pipeline[1]:02d}"
    suffix += "" if tensor is None else f"-tensor-{tensor[0]:02d}-of-{tensor[1]:02d}"
    return f"shard-{rank:05d}-of-{world_size:05d}{suffix}.pt"


def saved_shard_name(meta: dict[str, Any], rank: int) -> str:
    """The file of saved data-parallel rank ``rank`` for ``meta``, a checkpoint's ``meta.pt`` or a
    pipeline rank's or tensor-parallel rank's view of it (``stage_view``, ``view``)."""
    world = int(meta["plan"]["world_size"])
    view, stage = tensor_layout.VIEW, pipeline_layout.STAGE
    tensor = (meta[view], tensor_layout.saved_size(meta)) if view in meta else None
    pipeline = (meta[stage], pipeline_layout.saved_size(meta)) if stage in meta else None
    return shard_name(rank, world, tensor, pipeline)


def all_shard_names(meta: dict[str, Any]) -> list[str]:
    """Every shard file a complete checkpoint holds (every data-parallel, tensor-parallel and pipeline
    rank)."""
    views = [v for stage in pipeline_layout.stage_views(meta) for v in tensor_layout.views(stage)]
    return [saved_shard_name(v, r) for v in views for r in range(int(v["plan"]["world_size"]))]


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    return Path(path, META).is_file()


def file_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of a file."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            sha.update(chunk)
    return path.stat().st_size, sha.hexdigest()


def moment_names(meta: dict[str, Any]) -> list[str]:
    """Names of the optimizer moments a checkpoint's shard files hold, in the optimizer's order.

    Recorded in ``meta.pt`` as ``"moments"``; a checkpoint written before that was recorded holds
    Adam's: ``exp_avg``, ``exp_avg_sq`` and, if a param group had ``amsgrad``, ``max_exp_avg_sq``.
    """
    if "moments" in meta:
        return list(meta["moments"])
    amsgrad = any(g.get("amsgrad") for g in meta["param_groups"])
    return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``meta.pt`` of a checkpoint directory, checked for presence and format version.

    Raises:
        CheckpointError: naming the file, if it is missing, unreadable or from a newer format.
    """
    file = Path(path, META)
    if not file.is_file():
        raise CheckpointError(f"{file} does not exist: {path} is not a complete lightning-zero checkpoint")
    try:
        meta = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(f"{file} cannot be read ({type(err).__name__}: {err})") from err
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{file} has format version {version!r}; this lightning-zero reads versions "
            f"<= {FORMAT_VERSION} (upgrade lightning-zero)"
        )
    return meta


def verify_files(
    path: str | os.PathLike[str],
    meta: dict[str, Any],
    names: list[str] | None = None,
    digests: bool = True,
) -> list[str]:
    """Problems (missing, truncated or altered files) among ``names`` (default: all files in meta).

    ``digests=False`` checks presence and size only (no file is read: a quick completeness check, e.g.
    to pick the newest complete checkpoint of a series); the sha256 check reads every byte.
    """
    problems = []
    for name in names if names is not None else sorted(meta["files"]):
        expected = meta["files"].get(name)
        file = Path(path, name)
        if expected is None:
            problems.append(f"{file}: not listed in {META}")
        elif not file.is_file():
            problems.append(f"{file}: missing")
        else:
            size = file.stat().st_size
            if size != expected["size"]:
                problems.append(f"{file}: {size} bytes, expected {expected['size']} (truncated or replaced)")
            elif digests and file_digest(file)[1] != expected["sha256"]:
                problems.append(f"{file}: sha256 mismatch (altered)")
    return problems
