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

Every rank decides together, before the collective that completes the parameters, and before any
parameter changes: first each parameter's stored shape against its own (a reader with ``shape_of``,
as :class:`SafetensorsReader`: every rank checks every parameter), then each rank reads its pieces
into buffers, each failure a line; the lines of every rank are joined (``union_of``: gathered on rank
0, broadcast) and, if there are any, every rank raises the same :class:`CheckpointError`, naming each
tensor and both shapes. Only then are the pieces copied into the shards. A plain callable reader has
no shapes to compare: a stored tensor shorter than the parameter, or missing, is found as its pieces
are read; a longer one is not.
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
            model); each rank reads only its shards' pieces, and every rank decides together whether
            the load goes ahead (call it on all ranks). ``None`` and no stage-3 model: every parameter
            is read whole, on every rank, with no communication.

    Returns:
        The names read.

    Raises:
        CheckpointError: on every rank alike, before any parameter changes: a parameter the reader
            lacks, or stores in another shape (both named) or size, or whose read failed on some rank.
    """
    if engine is None:
        engine = sharded_engine(module)  # type: ignore[assignment]  # a ShardEngine's part
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if engine is None:
        problems = _shape_problems(read, trainable)
        whole = [] if problems else [_read_into(read, n, 0, p.numel(), problems) for n, p in trainable]
        _raise_if(problems)
        for (_, param), value in zip(trainable, whole, strict=True):
            param.copy_(value.view_as(param))
        return [n for n, _ in trainable]
    names = {id(p): n for n, p in module.named_parameters()}
    engine.wait_for_params()
    problems = _shape_problems(read, [(names.get(id(p), s.name), p) for p, s in _planned(engine)])
    pieces = [] if problems else _read_shards(engine, read, names, problems)
    _raise_if(engine.world.union_of(problems))
    for bucket_index, start, piece in pieces:
        bucket, record = engine.plan.buckets[bucket_index], engine.state.records[bucket_index]
        engine.flat.shard(bucket)[start : start + piece.numel()].copy_(piece)
        if record.separate_master:
            record.master[start : start + piece.numel()].copy_(piece)
    engine.publish_shards()
    return [names.get(id(p), s.name) for p, s in _planned(engine)]


def _planned(engine: ShardEngine) -> list[tuple[torch.nn.Parameter, Any]]:
    return list(zip(engine.params_in_order, engine.plan.params, strict=True))


def _read_shards(
    engine: ShardEngine, read: Reader, names: dict[int, str], problems: list[str]
) -> list[tuple[int, int, Tensor]]:
    """This rank's pieces, as ``(bucket index, offset in its shard, values)``; failures go to ``problems``."""
    pieces = []
    for b, bucket in enumerate(engine.plan.buckets):
        for seg in engine.plan.segments(bucket, engine.comm.rank):
            param, spec = engine.params_in_order[seg.param_index], engine.plan.params[seg.param_index]
            values = _read_into(
                read, names.get(id(param), spec.name), seg.param_start, seg.param_end, problems
            )
            pieces.append((b, seg.shard_offset, values))
    return pieces


def _read_into(read: Reader, name: str, start: int, end: int, problems: list[str]) -> Tensor:
    """Elements ``[start, end)`` of ``name``; a failure is a line in ``problems`` (and no values): every
    rank must reach the agreement, whatever its reads did."""
    try:
        values = read(name, start, end).reshape(-1)
    except Exception as error:  # noqa: BLE001 - any failure of a reader is reported on every rank
        problems.append(f"{name}: elements [{start}, {end}) could not be read: {error}")
        return torch.empty(0)
    if values.numel() != end - start:
        problems.append(
            f"{name}: elements [{start}, {end}) read as {values.numel()} elements (the stored tensor is "
            "smaller than the parameter)"
        )
    return values


def _shape_problems(read: Reader, params: Sequence[tuple[str, torch.nn.Parameter]]) -> list[str]:
    """Each parameter whose stored shape is not its own, or that is not stored (a reader with
    ``shape_of`` only)."""
    shape_of = getattr(read, "shape_of", None)
    if shape_of is None:
        return []
    problems = []
    for name, param in params:
        try:
            stored = tuple(shape_of(name))
        except Exception as error:  # noqa: BLE001 - every rank must reach the agreement
            problems.append(f"{name}: {error}")
            continue
        if stored != tuple(param.shape):
            problems.append(
                f"{name}: stored as shape {list(stored)}, the parameter has shape {list(param.shape)}"
            )
    return problems


def _raise_if(problems: list[str]) -> None:
    if problems:
        raise CheckpointError("cannot load the pretrained weights:\n  " + "\n  ".join(problems))


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
        """The shape of the stored tensor ``stored``."""
        return tuple(self._slice(stored).get_shape())

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The shape parameter ``name`` is stored in: its stored tensor's, or the concatenation of its
        ``sources`` along the first dimension.

        Raises:
            CheckpointError: a tensor that is not stored, or sources that do not concatenate.
        """
        shapes = [self.shape(stored) for stored in self.sources.get(name, (name,))]
        if len(shapes) == 1:
            return shapes[0]
        if any(len(s) == 0 or s[1:] != shapes[0][1:] for s in shapes):
            raise CheckpointError(
                f"its sources {list(self.sources[name])} have shapes {shapes}: not one tensor"
            )
        return (sum(s[0] for s in shapes), *shapes[0][1:])

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
