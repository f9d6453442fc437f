"""Write a model ``state_dict`` as safetensors, in the Hugging Face layout.

Up to ``max_shard_bytes`` of tensor data the output is one ``model.safetensors``; above it, the
tensors go in order into ``model-00001-of-0000n.safetensors``, ... (a new file starts when the next
tensor would push the current one past the limit; a tensor larger than the limit has a file of its
own) and ``model.safetensors.index.json`` holds ``metadata.total_size`` (bytes of tensor data) and
``weight_map`` (tensor name -> file), which ``transformers`` and ``safetensors`` users read.

Tied weights: safetensors refuses two names for one storage. A name whose tensor is the very same
view as an earlier name's (same storage, offset, shape, strides and dtype; a weight tied under two
names, as :func:`~lightning_zero.checkpoint.load_full_state_dict` returns it) is not written; it is
recorded as ``{alias: written name}`` under ``"aliases"`` (a JSON string) in every file's header
metadata and in the index's ``metadata``, so a loader can tie it again (``transformers`` re-ties
from the model config and ignores both). Any other tensor whose storage it shares with another (a
slice of a flat buffer) is written as its own copy. Every file's header metadata has
``"format": "pt"``, which ``transformers`` checks.

Files are written under a temporary name and renamed when complete. ``safetensors`` is imported
only when called (it is not a dependency of the library).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def save_safetensors(
    state_dict: dict[str, torch.Tensor],
    out_dir: str | os.PathLike[str],
    *,
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = False,
) -> list[Path]:
    """Write ``state_dict`` into ``out_dir`` as ``model.safetensors``, or as numbered files plus
    ``model.safetensors.index.json`` when its tensors hold more than ``max_shard_bytes``.

    Args:
        state_dict: tensors by name (any device; they are copied to CPU file by file).
        out_dir: the folder to write (created if missing).
        max_shard_bytes: the most tensor bytes in one file (a larger single tensor gets its own).
        overwrite: replace the ``model*.safetensors`` files and index of a non-empty ``out_dir``.

    Returns:
        The files written: the safetensors files in order, then the index if there is one.

    Raises:
        FileExistsError: if ``out_dir`` is a file, or a non-empty folder and ``overwrite`` is False.
        ImportError: if the ``safetensors`` package is not installed.
        ValueError: if ``max_shard_bytes`` is not positive or a value is not a tensor.
    """
    try:
        from safetensors.torch import save_file
    except ImportError as err:
        raise ImportError("save_safetensors needs the safetensors package: pip install safetensors") from err
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out = _prepare(Path(out_dir), overwrite)
    tensors, aliases = _untie(state_dict)
    groups = _shards(tensors, max_shard_bytes)
    metadata = {"format": "pt", "aliases": json.dumps(aliases)}
    names = [SINGLE] if len(groups) == 1 else [_shard_name(i, len(groups)) for i in range(len(groups))]
    written = []
    for name, group in zip(names, groups, strict=True):
        with _replacing(out / name) as tmp:
            save_file(_owned(group), tmp, metadata=metadata)
        written.append(out / name)
    if len(groups) > 1:
        index = {
            "metadata": {"total_size": sum(_nbytes(t) for t in tensors.values()), "aliases": aliases},
            "weight_map": {key: name for name, group in zip(names, groups, strict=True) for key in group},
        }
        with _replacing(out / INDEX) as tmp:
            Path(tmp).write_text(json.dumps(index, indent=2) + "\n")
        written.append(out / INDEX)
    return written


def _prepare(out: Path, overwrite: bool) -> Path:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file; save_safetensors writes into a folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} is not empty; pass overwrite=True to replace its model files")
        for stale in [*out.glob("model*.safetensors"), out / INDEX]:  # no shard of an older split survives
            stale.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _untie(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors to write, and ``{alias: written name}`` for names that repeat an earlier view."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[object, ...], str] = {}
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"state_dict[{name!r}] is a {type(value).__name__}, not a tensor")
        view = (
            value.device,
            value.untyped_storage().data_ptr(),
            value.storage_offset(),
            tuple(value.shape),
            value.stride(),
            value.dtype,
        )
        if view in seen and value.numel():
            aliases[name] = seen[view]
        else:
            seen.setdefault(view, name)
            tensors[name] = value
    return tensors, aliases


def _shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, value in tensors.items():
        if groups[-1] and size + _nbytes(value) > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = value
        size += _nbytes(value)
    return groups


def _owned(group: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU tensors that each own their storage (safetensors refuses shared or strided ones)."""
    return {name: value.detach().to("cpu", copy=True).contiguous() for name, value in group.items()}


@contextmanager
def _replacing(path: Path) -> Iterator[str]:
    """A temporary name to write ``path`` under; renamed to ``path`` when the block succeeds."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield str(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"
