"""Stream a sharded checkpoint directory into one standard Lightning checkpoint file.

The output is what ``torch.save`` would write for a checkpoint of Lightning ``"ddp"`` with
``torch.optim.AdamW``: ``state_dict`` (full parameters and buffers), ``optimizer_states[0]`` in
AdamW's own per-parameter format (``step``, ``exp_avg``, ``exp_avg_sq``), and Lightning's loop,
callback and scheduler state. It loads with ``torch.load(..., weights_only=True)``,
``Model.load_from_checkpoint`` and ``Trainer(strategy="ddp").fit(ckpt_path=...)``, with
lightning-zero not imported. A directory written by ``fabric.save`` becomes what Fabric's ``"ddp"``
saves: the model's ``state_dict`` and the AdamW state under the keys the loop used (``"model"``,
``"optimizer"``), next to its other entries, for ``fabric.load`` under any strategy. A checkpoint
holding a weight average is written as Lightning's ``WeightAveraging`` writes one: ``state_dict``
the average (parameters and buffers), ``current_model_state`` the current weights,
``averaging_state`` the number of updates.

Memory: the file is written record by record, in torch's own zip layout. The pickled structure
refers to tensors through placeholders; each tensor is then assembled from the shard files
(memory-mapped, released after every saved bucket), written, and freed. Peak memory is one
parameter's tensors plus one saved bucket's mapped pages, never the whole state. The output
goes to a temporary name first and is renamed when complete.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import sys
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, SupportsIndex

import torch

from lightning_zero.checkpoint.format import (
    AVERAGE,
    EXTRA,
    FABRIC_KEYS,
    META,
    WEIGHTS_ONLY,
    CheckpointError,
    averaged_buffers,
    moment_names,
    read_meta,
    verify_files,
    weights_extras,
)
from lightning_zero.checkpoint.reshard import ShardFiles, read_full_param, weights_key


class _Storage:
    """Stands for a storage whose bytes are written later under ``key``."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _Tensor:
    """Pickles exactly like a contiguous CPU tensor of ``shape``/``dtype`` (torch's own reduce)."""

    def __init__(self, storage: _Storage, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        stride: list[int] = []
        step = 1
        for d in reversed(self.shape):
            stride.insert(0, step)
            step *= max(d, 1)
        args: tuple[Any, ...] = (self.storage, 0, torch.Size(self.shape), tuple(stride), False, OrderedDict())
        return torch._utils._rebuild_tensor_v2, args


def _storage_type(dtype: torch.dtype) -> Any:
    """The legacy storage class torch.save names for ``dtype`` (e.g. ``torch.FloatStorage``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated, but it is what the format records
        return getattr(torch, torch.storage.TypedStorage(dtype=dtype, device="cpu")._pickle_storage_type())


class _StreamingWriter:
    """Records of a torch zip checkpoint, written one at a time."""

    def __init__(self, path: Path) -> None:
        self.writer = torch._C.PyTorchFileWriter(str(path))
        self.pending: dict[str, tuple[str, str | None]] = {}  # key -> (param name, state key or None)
        self.count = 0

    def placeholder(
        self, shape: list[int] | tuple[int, ...], dtype: torch.dtype, source: tuple[str, str | None]
    ) -> _Tensor:
        key = str(self.count)
        self.count += 1
        numel = math.prod(shape)
        self.pending[key] = source
        return _Tensor(_Storage(key, dtype, numel), tuple(shape))

    def write_tensor(self, key: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().contiguous().cpu()
        storage = tensor.untyped_storage()
        self.writer.write_record(f"data/{key}", storage, storage.nbytes())  # type: ignore[arg-type]  # stub omits UntypedStorage

    def pickle(self, obj: Any) -> bytes:
        writer = self
        real: list[tuple[str, torch.UntypedStorage]] = []

        class Pickler(pickle.Pickler):
            def persistent_id(self, o: Any) -> Any:
                if isinstance(o, _Storage):
                    return ("storage", _storage_type(o.dtype), o.key, "cpu", o.numel)
                if isinstance(o, torch.storage.TypedStorage):  # a small real tensor in Lightning's state
                    key = str(writer.count)
                    writer.count += 1
                    real.append((key, o._untyped_storage.cpu()))
                    return ("storage", getattr(torch, o._pickle_storage_type()), key, "cpu", o._size())
                return None

        buffer = io.BytesIO()
        Pickler(buffer, protocol=2).dump(obj)
        for key, storage in real:
            self.writer.write_record(f"data/{key}", storage, storage.nbytes())  # type: ignore[arg-type]
        return buffer.getvalue()

    def finish(self, data_pkl: bytes) -> None:
        self.writer.write_record("data.pkl", data_pkl, len(data_pkl))
        self.writer.write_record(".format_version", b"1", 1)
        self.writer.write_record("byteorder", sys.byteorder.encode(), len(sys.byteorder))
        self.writer.write_end_of_file()


def consolidate(src: str | os.PathLike[str], dst: str | os.PathLike[str], weights_only: bool = False) -> None:
    """Write ``dst``, a standard Lightning checkpoint file, from the checkpoint directory ``src``.

    Raises:
        CheckpointError: if ``src`` is incomplete or corrupt (``dst`` is then not created).
    """
    src, dst = Path(src), Path(dst)
    meta = read_meta(src)
    problems = verify_files(src, meta)
    if problems:
        raise CheckpointError(f"{src} cannot be consolidated:\n  " + "\n  ".join(problems))
    extras = torch.load(src / EXTRA, map_location="cpu", weights_only=True, mmap=True)
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    out = _StreamingWriter(tmp)
    try:
        structure = _structure(meta, extras, out, weights_only)
        data_pkl = out.pickle(structure)
        _write_tensors(src, meta, extras, out)
        out.finish(data_pkl)
        del out
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_full_state_dict(
    src: str | os.PathLike[str], *, map_location: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """The full model ``state_dict`` of the sharded checkpoint directory ``src`` (any stage, layout
    and world size), assembled in memory with no process group: every trainable parameter from the
    shard files (a 16-bit one in its saved dtype, rounded from its fp32 master), buffers and frozen
    parameters from ``model_extra.pt``, and a tied weight as one tensor under all its names.

    Args:
        src: a checkpoint directory (``meta.pt`` and ``shard-*-of-*.pt`` files).
        map_location: the device to put the tensors on.

    Returns:
        ``{name: tensor}``, as the model's own ``state_dict()`` holds it (no optimizer state).

    Raises:
        CheckpointError: if ``src`` is not a sharded checkpoint directory, or is incomplete or corrupt.
    """
    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(
            f"{src} is not a sharded checkpoint directory: pass a directory holding {META} and "
            "shard-*-of-*.pt files (a single-file checkpoint loads with torch.load(path)['state_dict'])"
        )
    return _full_state_dict(src, _checked_meta(src), torch.device(map_location))


def load_module_checkpoint(
    src: str | os.PathLike[str], map_location: str | torch.device | None = None
) -> dict[str, Any]:
    """The checkpoint dict that ``LightningModule.load_from_checkpoint`` reads, assembled in memory
    from a checkpoint directory: Lightning's state and the full ``state_dict`` (no optimizer state).

    ``map_location``: a device (or its name) to put the tensors on; anything else leaves them on CPU.

    Raises:
        CheckpointError: if ``src`` is incomplete or corrupt.
    """
    src = Path(src)
    meta = _checked_meta(src)
    device = torch.device(map_location if isinstance(map_location, str | torch.device) else "cpu")
    state_dict = _full_state_dict(src, meta, device)
    lightning = {k: v for k, v in meta["lightning"].items() if k not in (WEIGHTS_ONLY, FABRIC_KEYS)}
    return {**lightning, "state_dict": state_dict}


def _checked_meta(src: Path) -> dict[str, Any]:
    meta = read_meta(src)
    problems = verify_files(src, meta)
    if problems:
        raise CheckpointError(f"{src} cannot be loaded:\n  " + "\n  ".join(problems))
    return meta


def _full_state_dict(src: Path, meta: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    extras = weights_extras(meta, torch.load(src / EXTRA, map_location="cpu", weights_only=True))
    state_dict: dict[str, torch.Tensor] = {k: v.to(device) for k, v in extras.items()}
    files = ShardFiles(src)
    for spec in meta["plan"]["params"]:
        tensor = read_full_param(src, meta, spec["name"], weights_key(meta), files=files)
        assert tensor is not None, spec["name"]
        state_dict[spec["name"]] = tensor.to(device=device, dtype=_dtype(spec["dtype"]))
    files.release()
    for alias, name in meta.get("aliases", {}).items():  # a tied weight: one tensor under both keys
        state_dict[alias] = state_dict[name]
    return state_dict


def _structure(
    meta: dict[str, Any], extras: dict[str, torch.Tensor], out: _StreamingWriter, weights_only: bool
) -> dict[str, Any]:
    plan_params = meta["plan"]["params"]
    saved_weights_only = bool(meta["lightning"].get(WEIGHTS_ONLY))  # as Lightning wrote it: no optimizer
    keys = meta["lightning"].get(FABRIC_KEYS) or {}  # fabric.save: the model and optimizer's own keys
    checkpoint = {
        k: v
        for k, v in meta["lightning"].items()
        if k not in (WEIGHTS_ONLY, FABRIC_KEYS)
        and not (weights_only and k in ("loops", "lr_schedulers", "callbacks"))
    }
    state_dict: dict[str, Any] = {}
    for spec in plan_params:
        state_dict[spec["name"]] = out.placeholder(spec["shape"], _dtype(spec["dtype"]), (spec["name"], None))
    for name, value in extras.items():
        state_dict[name] = out.placeholder(tuple(value.shape), value.dtype, (name, "extra"))
    if AVERAGE in meta:  # WeightAveraging's layout: the average is the state_dict
        checkpoint["current_model_state"] = _with_aliases(meta, state_dict)
        checkpoint["averaging_state"] = {"n_averaged": torch.tensor(meta[AVERAGE]["n_averaged"])}
        buffers = averaged_buffers(meta["lightning"])
        averaged = {
            spec["name"]: out.placeholder(spec["shape"], _dtype(spec["dtype"]), (spec["name"], AVERAGE))
            for spec in plan_params
        }
        state_dict = {**averaged, **{n: buffers.get(n, v) for n, v in state_dict.items() if n in extras}}
    checkpoint[keys.get("module") or "state_dict"] = _with_aliases(meta, state_dict)
    if not (weights_only or saved_weights_only):
        optimizer = _optimizer_structure(meta, out)
        if FABRIC_KEYS in meta["lightning"]:
            checkpoint[keys.get("optimizer") or "optimizer"] = optimizer
        else:
            checkpoint["optimizer_states"] = [optimizer]
    return checkpoint


def _with_aliases(meta: dict[str, Any], state_dict: dict[str, Any]) -> dict[str, Any]:
    """A tied weight: one storage under both keys."""
    for alias, name in meta.get("aliases", {}).items():
        state_dict[alias] = state_dict[name]
    return state_dict


def _optimizer_structure(meta: dict[str, Any], out: _StreamingWriter) -> dict[str, Any]:
    plan_params = meta["plan"]["params"]
    steps = meta["steps"].tolist()
    state: dict[int, Any] = {}
    groups = []
    torch_index = 0
    for group in meta["param_groups"]:
        indices = []
        for plan_index in group["param_indices"]:
            if plan_index >= 0 and steps[plan_index] > 0:
                spec = plan_params[plan_index]
                entry: dict[str, Any] = {"step": torch.tensor(float(steps[plan_index]), dtype=torch.float32)}
                for key in moment_names(meta):
                    entry[key] = out.placeholder(
                        spec["shape"],
                        torch.float32 if _dtype(spec["dtype"]).itemsize < 4 else _dtype(spec["dtype"]),
                        (spec["name"], key),
                    )
                state[torch_index] = entry
            indices.append(torch_index)
            torch_index += 1
        saved = {k: v for k, v in group.items() if k != "param_indices"}
        saved.update(params=indices, foreach=None, fused=None, capturable=False, differentiable=False)
        groups.append(saved)
    return {"state": state, "param_groups": groups}


def _write_tensors(
    src: Path, meta: dict[str, Any], extras: dict[str, torch.Tensor], out: _StreamingWriter
) -> None:
    by_source = {source: key for key, source in out.pending.items()}
    layout_bucket = {
        slot[0]: b for b, bucket in enumerate(meta["plan"]["buckets"]) for slot in bucket["slots"]
    }
    order = sorted(range(len(meta["plan"]["params"])), key=lambda i: layout_bucket[i])
    files = ShardFiles(src)
    current_bucket = None
    for plan_index in order:
        if layout_bucket[plan_index] != current_bucket:
            files.release()  # unmap the previous bucket's pages
            current_bucket = layout_bucket[plan_index]
        name = meta["plan"]["params"][plan_index]["name"]
        for state_key in (None, AVERAGE, *moment_names(meta)):
            key = by_source.get((name, state_key))
            if key is None:
                continue
            tensor = read_full_param(src, meta, name, state_key or "param", files=files)
            assert tensor is not None, (name, state_key)
            if state_key in (None, AVERAGE):  # fp32 masters and averages: store in the parameter's dtype
                tensor = tensor.to(_dtype(meta["plan"]["params"][plan_index]["dtype"]))
            out.write_tensor(key, tensor)
    for name, value in extras.items():
        out.write_tensor(by_source[(name, "extra")], value)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))
