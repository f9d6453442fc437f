"""Weights from elsewhere (a Hugging Face ``safetensors`` directory) straight into the shards.

:func:`load_parameters` fills a model's trainable parameters by name from a *reader*,
``read(name, start, end)``: elements ``[start, end)`` of the flattened full tensor ``name``. Under a
sharded optimizer each rank asks only for the pieces of its own shards (a stage-3 model is never
gathered; at stages 1 and 2 the usual all-gather completes the parameters), so with a lazy reader
each rank reads only its bytes. :class:`SafetensorsReader` is such a reader over one
``.safetensors`` file or a directory with ``model.safetensors.index.json``: ``safe_open`` maps the
files and ``get_slice`` reads the rows a range needs; a parameter stored as several tensors (a fused
projection saved as its parts) is their concatenation along the first dimension, given by
``sources``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_zero.checkpoint.format import CheckpointError
from lightning_zero.engine.engine import ShardEngine
from lightning_zero.engine.parameters import sharded_engine

Reader = Callable[[str, int, int], Tensor]
"""``read(name, start, end)``: elements ``[start, end)`` of the flattened full tensor ``name``."""


@torch.no_grad()
def load_parameters(module: torch.nn.Module, read: Reader, engine: ShardEngine | None = None) -> list[str]:
    """Fill ``module``'s trainable parameters (by their names in ``module``) from ``read``.

    Args:
        engine: the sharded optimizer's engine (``optimizer.engine``; found by itself for a stage-3
            model); each rank reads only its shards' pieces. ``None`` and no stage-3 model: every
            parameter is read whole, on every rank.

    Returns:
        The names read.

    Raises:
        CheckpointError: a parameter the reader lacks or holds in another size (named).
    """
    if engine is None:
        engine = sharded_engine(module)  # type: ignore[assignment]  # a ShardEngine's part
    names = {id(p): n for n, p in module.named_parameters()}
    if engine is None:
        loaded = []
        for name, param in module.named_parameters():
            if param.requires_grad:
                param.copy_(_read(read, name, 0, param.numel()).view_as(param))
                loaded.append(name)
        return loaded
    engine.wait_for_params()
    rank = engine.comm.rank
    for bucket, record in zip(engine.plan.buckets, engine.state.records, strict=True):
        shard = engine.flat.shard(bucket)
        for seg in engine.plan.segments(bucket, rank):
            name = names.get(
                id(engine.params_in_order[seg.param_index]), engine.plan.params[seg.param_index].name
            )
            values = _read(read, name, seg.param_start, seg.param_end)
            shard[seg.shard_offset : seg.shard_offset + seg.numel].copy_(values)
            if record.separate_master:
                record.master[seg.shard_offset : seg.shard_offset + seg.numel].copy_(values)
    engine.publish_shards()
    return [names.get(id(p), s.name) for p, s in zip(engine.params_in_order, engine.plan.params, strict=True)]


def _read(read: Reader, name: str, start: int, end: int) -> Tensor:
    values = read(name, start, end).reshape(-1)
    if values.numel() != end - start:
        raise CheckpointError(f"{name}: read {values.numel()} elements for [{start}, {end})")
    return values


class SafetensorsReader:
    """A lazy :data:`Reader` over safetensors files.

    Args:
        path: one ``.safetensors`` file, or a directory holding ``model.safetensors`` or
            ``model.safetensors.index.json`` and the shards it lists.
        sources: the model's parameter name -> the stored tensors whose concatenation (first
            dimension) it is, in order; a name absent here is stored under its own name.
        dtype: the parameters' dtype (the stored one is cast).

    Raises:
        CheckpointError: no safetensors file there, or (when read) a tensor that is not stored.
    """

    def __init__(
        self,
        path: str | Path,
        sources: Mapping[str, Sequence[str]] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        from safetensors import safe_open

        path = Path(path)
        index = path / "model.safetensors.index.json"
        single = path if path.is_file() else path / "model.safetensors"
        if index.is_file() and not path.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: path / file for name, file in weight_map.items()}
        elif single.is_file():
            with safe_open(str(single), framework="pt") as handle:
                self._file_of = dict.fromkeys(handle.keys(), single)
        else:
            raise CheckpointError(
                f"{path}: no model.safetensors, model.safetensors.index.json or .safetensors file there"
            )
        self._open: dict[Path, Any] = {
            f: safe_open(str(f), framework="pt") for f in set(self._file_of.values())
        }
        self.sources = dict(sources or {})
        self.dtype = dtype

    def names(self) -> list[str]:
        """The stored tensors' names."""
        return sorted(self._file_of)

    def shape(self, stored: str) -> tuple[int, ...]:
        return tuple(self._slice(stored).get_shape())

    def _slice(self, stored: str) -> Any:
        if stored not in self._file_of:
            raise CheckpointError(f"{stored!r} is not stored here (stored: {len(self._file_of)} tensors)")
        return self._open[self._file_of[stored]].get_slice(stored)

    def __call__(self, name: str, start: int, end: int) -> Tensor:
        pieces, offset = [], 0
        for stored in self.sources.get(name, (name,)):
            shape = self.shape(stored)
            numel = math.prod(shape)
            lo, hi = max(start, offset), min(end, offset + numel)
            if lo < hi:
                pieces.append(self._flat(stored, shape, lo - offset, hi - offset))
            offset += numel
        out = torch.cat(pieces) if len(pieces) != 1 else pieces[0]
        return out if self.dtype is None else out.to(self.dtype)

    def _flat(self, stored: str, shape: tuple[int, ...], lo: int, hi: int) -> Tensor:
        """Elements ``[lo, hi)`` of the flattened stored tensor, reading only the rows that hold them."""
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        first, last = lo // row, -(-hi // row)
        rows = self._slice(stored)[first:last]
        return rows.reshape(-1)[lo - first * row : hi - first * row]
