"""Load a sharded checkpoint onto the current ranks, whatever world size or bucket plan wrote it.

Loading works parameter by parameter, never through a full state: for each piece of a parameter
this rank owns under its *current* plan (:class:`~lightning_zero.layout.partition.Segment`), it finds
the saved bucket and offset of the same parameter (matched by name) and copies the elements from
the saved shard files that hold them (one, or two where the piece straddles a saved shard
boundary). Shard files are opened memory-mapped, so a rank reads only the bytes it needs, and
unmapped after every :data:`_RELEASE_BYTES` read, so the file pages it touched do not pile up in its
resident memory. The
parameters are then completed by the usual per-bucket all-gather.

A checkpoint of a tensor-parallel model (:mod:`lightning_zero.checkpoint.tensor_layout`) is read the
same way by each tensor-parallel rank from its own files when the layout is unchanged; into another
tensor-parallel layout (``T=2`` saved, ``T=1`` loading, or the reverse), each parameter this rank
loads is made whole from the saved slices and this rank's slice of it cut out (:class:`_Whole`). A
checkpoint of a pipeline-parallel model (:mod:`lightning_zero.checkpoint.pipeline_layout`) likewise:
each pipeline rank reads its own files in the same pipeline layout, and whole parameters, each from the
pipeline rank that saved it, in another (``P=2`` into ``P=1`` or the reverse).

Before any collective, every rank checks the files it will read (presence, size, sha256) and the
parameter names and shapes; ranks exchange what they found and all raise the same
:class:`~lightning_zero.checkpoint.CheckpointError` if anything is wrong, so a bad checkpoint ends
every rank with a message instead of a hang, and nothing is modified.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_zero.checkpoint.format import (
    AVERAGE,
    CheckpointError,
    saved_shard_name,
    verify_files,
)
from lightning_zero.checkpoint.pipeline_layout import STAGE, held_elsewhere, holding, own_stage
from lightning_zero.checkpoint.tensor_layout import (
    VIEW,
    checkpoint_comm,
    engine_layout,
    join,
    same_layout,
    saved_placement,
    view,
    views,
)
from lightning_zero.comm.trace import span
from lightning_zero.engine.engine import ShardEngine
from lightning_zero.engine.tensor_parallel import cut
from lightning_zero.layout.partition import Segment

_RELEASE_BYTES = 64 * 2**20
"""A load unmaps the shard files after reading about this much (then maps them again as needed):
the pages it touched stay in the rank's resident memory only until then, and each file is parsed
again once per that many bytes, not once per bucket."""


class _SavedLayout:
    """Where each saved parameter's elements live: saved bucket, offset, and rank shard size (of a
    checkpoint, or of one tensor-parallel rank's :func:`~lightning_zero.checkpoint.tensor_layout.view`
    of it)."""

    def __init__(self, meta: dict[str, Any]) -> None:
        self.meta = meta
        plan = meta["plan"]
        self.world_size = int(plan["world_size"])
        self.params = plan["params"]
        self.by_name = {p["name"]: i for i, p in enumerate(self.params)}
        self.where: dict[int, tuple[int, int]] = {}
        self.shard_numel = []
        for b, bucket in enumerate(plan["buckets"]):
            self.shard_numel.append(bucket["padded_numel"] // self.world_size)
            for index, offset, _ in bucket["slots"]:
                self.where[index] = (b, offset)

    def pieces(self, name: str, start: int, end: int) -> list[tuple[int, int, int, int, int]]:
        """``(saved rank, saved bucket, offset in that shard, numel, offset in the request)`` covering
        elements ``[start, end)`` of parameter ``name``."""
        bucket, offset = self.where[self.by_name[name]]
        size = self.shard_numel[bucket]
        out, lo, hi = [], offset + start, offset + end
        while lo < hi:
            rank = lo // size
            stop = min(hi, (rank + 1) * size)
            out.append((rank, bucket, lo - rank * size, stop - lo, lo - offset - start))
            lo = stop
        return out

    def file(self, rank: int) -> str:
        """The shard file of saved data-parallel rank ``rank``."""
        return saved_shard_name(self.meta, rank)

    def numel(self, name: str) -> int:
        return math.prod(self.params[self.by_name[name]]["shape"])


def check_compatible(
    engine: ShardEngine,
    meta: dict[str, Any],
    path: Path,
    whole: bool = False,
    elsewhere: set[str] | None = None,
) -> list[str]:
    """Missing / unexpected / mis-shaped parameters between the checkpoint (or a tensor-parallel rank's
    view of it) and the optimizer; ``whole``: compare global shapes (``meta`` a whole checkpoint's);
    ``elsewhere``: names the other pipeline ranks hold (not unexpected here)."""
    saved = {p["name"]: tuple(p["shape"]) for p in meta["plan"]["params"]}
    sizes = engine_layout(engine)[3] if whole else [tuple(p.shape) for p in engine.plan.params]
    current = {p.name: sizes[i] for i, p in enumerate(engine.plan.params)}
    problems = []
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current) - (elsewhere or set()))
    if missing:
        problems.append(f"{path}: missing trainable parameters {missing}")
    if unexpected:
        problems.append(
            f"{path}: unexpected parameters {unexpected} (not trainable parameters of this model)"
        )
    shapes = [
        f"{n}: checkpoint {list(saved[n])} vs model {list(current[n])}"
        for n in sorted(set(saved) & set(current))
        if saved[n] != current[n]
    ]
    if shapes:
        problems.append(f"{path}: shape mismatch: " + "; ".join(shapes))
    if len(meta["param_groups"]) != len(engine.param_groups):
        problems.append(
            f"{path}: {len(meta['param_groups'])} optimizer param groups, the optimizer has "
            f"{len(engine.param_groups)}"
        )
    return problems


def files_per_bucket(engine: ShardEngine, meta: dict[str, Any]) -> list[set[int]]:
    """For each bucket of this rank's plan, the saved ranks whose shard files hold what this rank
    loads into it (a resume on ``M`` ranks of a checkpoint of ``N``: ``ceil(N/M) + 1`` at most,
    since a rank's part of a bucket is a contiguous range of the saved one, in the same order)."""
    layout = _SavedLayout(meta)
    out = []
    for bucket in engine.plan.buckets:
        ranks: set[int] = set()
        for seg in engine.plan.segments(bucket, engine.comm.rank):
            name = engine.plan.params[seg.param_index].name
            if name in layout.by_name:
                ranks.update(r for r, *_ in layout.pieces(name, seg.param_start, seg.param_end))
        out.append(ranks)
    return out


def _whole_files(engine: ShardEngine, path: Path, meta: dict[str, Any]) -> set[str]:
    """The shard files that make whole the parameters this rank loads (another tensor-parallel or
    pipeline layout): each parameter's, of the pipeline rank that saved it."""
    plan = engine.plan
    rank = engine.comm.rank
    wanted = {plan.params[seg.param_index].name for b in plan.buckets for seg in plan.segments(b, rank)}
    files = ShardFiles(path)  # its layouts only (nothing is opened), built once per saved view
    names: set[str] = set()
    for name in sorted(wanted):
        held = holding(meta, name)
        for layout in map(files.layout, views(held)):
            if VIEW not in layout.meta or layout.meta[VIEW] == 0 or saved_placement(held, name)[0] == "shard":
                names.update(layout.file(r) for r, *_ in layout.pieces(name, 0, layout.numel(name)))
    return names


def preflight(engine: ShardEngine, path: Path, meta: dict[str, Any]) -> None:
    """Check, on every rank, what this rank will read; raise the union of problems everywhere (over
    every rank that loads: with tensor or pipeline parallelism, all of them)."""
    elsewhere = held_elsewhere(engine)  # on every rank of a pipeline, whichever way it reads
    own = own_stage(engine, meta)
    if own is not None and same_layout(engine, own):
        mine = view(own, engine_layout(engine)[1])
        problems = check_compatible(engine, mine, path)
        layout = _SavedLayout(mine)
        names = {layout.file(r) for r in set().union(*files_per_bucket(engine, mine))}
    else:
        problems = check_compatible(engine, meta, path, whole=True, elsewhere=elsewhere)
        names = set() if problems else _whole_files(engine, path, meta)
    if not problems:
        problems = verify_files(path, meta, sorted(names))
    found = sorted(checkpoint_comm(engine).union_of(problems))
    if found:
        raise CheckpointError("cannot load checkpoint:\n  " + "\n  ".join(found))


class ShardFiles:
    """The shard files of one checkpoint, by name, memory-mapped on first use (``release`` unmaps
    them), and the saved layouts read from its ``meta.pt`` (kept)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._open: dict[str, dict[str, list[Tensor]]] = {}
        self._layouts: dict[tuple[int, int], _SavedLayout] = {}

    def __getitem__(self, name: str) -> dict[str, list[Tensor]]:
        if name not in self._open:
            self._open[name] = torch.load(self.path / name, map_location="cpu", weights_only=True, mmap=True)
        return self._open[name]

    def layout(self, meta: dict[str, Any]) -> _SavedLayout:
        """The saved layout of ``meta`` (a checkpoint's, or a pipeline or tensor-parallel rank's view),
        built once."""
        key = (int(meta.get(STAGE, -1)), int(meta.get(VIEW, -1)))
        if key not in self._layouts:
            self._layouts[key] = _SavedLayout(meta)
        return self._layouts[key]

    def release(self) -> None:
        self._open.clear()


@torch.no_grad()
def load_sharded(
    engine: ShardEngine,
    path: Path,
    meta: dict[str, Any],
    with_optimizer: bool = True,
    average_apart: bool | None = None,
) -> None:
    """Fill this rank's parameter shards (then all-gather) and, optionally, its optimizer state.

    Call :func:`preflight` first. Must be called on all ranks. Separate fp32 masters are read from
    the saved masters (or parameters), not from the rounded 16-bit shard. A ``max_exp_avg_sq`` that
    the checkpoint lacks (``amsgrad`` switched on since) starts at zero. A weight average: see
    :data:`~lightning_zero.checkpoint.format.AVERAGE` (an engine that keeps one and a checkpoint
    without one: it starts from the loaded weights, ``n_averaged`` 0, as ``WeightAveraging`` does).
    ``average_apart``: restore the current weights and the average each as saved (default: when the
    engine keeps an average, i.e. a resumed fit); otherwise the weights are the saved average.
    """
    with span("checkpoint: load", engine.world.device):
        _load(engine, path, meta, with_optimizer, average_apart)


def _load(
    engine: ShardEngine, path: Path, meta: dict[str, Any], with_optimizer: bool, average_apart: bool | None
) -> None:
    engine.wait_for_params()  # gathers left in flight would overwrite what is loaded here
    files = ShardFiles(path)
    reader: _Pieces | _Whole
    own = own_stage(engine, meta)
    if own is not None and same_layout(engine, own):
        reader = _Pieces(engine, files.layout(view(own, engine_layout(engine)[1])), files)
    else:
        reader = _Whole(engine, path, meta, files)
    shards = engine.state
    saved_average = AVERAGE in meta
    # which saved tensor fills what: the current weights resume as they were only when the average is
    # restored apart; otherwise the weights are the average (WeightAveraging's rule); a kept average
    # that the checkpoint lacks starts from the weights
    apart = engine.averaging if average_apart is None else average_apart
    sources = {"param": "param" if apart or not saved_average else AVERAGE}
    sources[AVERAGE] = AVERAGE if saved_average else "param"
    read = 0  # bytes copied out of the mapped files since they were last unmapped
    for bucket, record in zip(engine.plan.buckets, shards.records, strict=True):
        targets = {"param": [record.param] + ([record.master] if record.separate_master else [])}
        if record.average is not None:
            targets[AVERAGE] = [record.average]
        if with_optimizer:
            targets.update({name: [moment] for name, moment in record.moments.items()})
        for seg in engine.plan.segments(bucket, engine.comm.rank):
            for key, destinations in targets.items():
                read += reader.fill(seg, sources.get(key, key), destinations)
        if read >= _RELEASE_BYTES:  # unmap what was read: its pages leave this rank's resident memory
            read = 0
            reader.release()
    if with_optimizer:
        saved_params = meta["plan"]["params"]
        by_name = {saved_params[i]["name"]: int(s) for i, s in enumerate(meta["steps"].tolist())}
        shards.steps = [by_name[p.name] for p in engine.plan.params]
        _load_group_hyperparameters(engine, meta)
    if engine.averaging:
        engine.n_averaged = int(meta[AVERAGE]["n_averaged"]) if saved_average else 0
        engine.average_loaded = True  # from the saved average, or started from the loaded weights
    engine.publish_shards()


class _Pieces:
    """Fills this rank's shard from the saved shards of the same parameters (the same tensor-parallel
    layout; any data-parallel size): the pieces each saved rank's file holds."""

    def __init__(self, engine: ShardEngine, layout: _SavedLayout, files: ShardFiles) -> None:
        self.layout, self.files = layout, files
        self.names = [p.name for p in engine.plan.params]

    def fill(self, seg: Segment, key: str, destinations: list[Tensor]) -> int:
        """Copy saved state ``key`` of ``seg``'s elements into ``destinations``; the bytes read."""
        read = 0
        name = self.names[seg.param_index]
        for rank, saved_bucket, offset, numel, at in self.layout.pieces(name, seg.param_start, seg.param_end):
            window = slice(seg.shard_offset + at, seg.shard_offset + at + numel)
            source = _source(self.files[self.layout.file(rank)], key, saved_bucket)
            for dst in destinations:
                if source is None:
                    dst[window].zero_()
                else:
                    dst[window].copy_(source[offset : offset + numel])
                    read += numel * source.element_size()
        return read

    def release(self) -> None:
        self.files.release()


class _Whole:
    """Fills this rank's shard in another tensor-parallel layout than the saved one: each parameter made
    whole from every saved tensor-parallel rank's slices, then this rank's slice cut from it (one
    parameter's tensors held at a time)."""

    def __init__(self, engine: ShardEngine, path: Path, meta: dict[str, Any], files: ShardFiles) -> None:
        self.path, self.meta, self.files = path, meta, files
        self.size, self.rank, self.placements, _ = engine_layout(engine)
        self.names = [p.name for p in engine.plan.params]
        self._held: dict[tuple[int, str], Tensor | None] = {}

    def fill(self, seg: Segment, key: str, destinations: list[Tensor]) -> int:
        """Copy saved state ``key`` of ``seg``'s elements into ``destinations``; the bytes read."""
        index, read = seg.param_index, 0
        if (index, key) not in self._held:
            if any(i != index for i, _ in self._held):
                self._held.clear()  # the previous parameter's tensors
            whole = read_full_param(self.path, self.meta, self.names[index], key, self.files)
            mine = None if whole is None else cut(whole, self.placements[index], self.rank, self.size)
            self._held[(index, key)] = None if mine is None else mine.reshape(-1)
            read = 0 if whole is None else whole.numel() * whole.element_size()
        flat = self._held[(index, key)]
        window = slice(seg.shard_offset, seg.shard_offset + seg.numel)
        for dst in destinations:
            if flat is None:
                dst[window].zero_()
            else:
                dst[window].copy_(flat[seg.param_start : seg.param_end])
        return read

    def release(self) -> None:
        self.files.release()


def _source(data: dict[str, list[Tensor]], key: str, bucket: int) -> Tensor | None:
    if key == "param" and "master" in data and data["master"][bucket].numel():
        return data["master"][bucket]  # fp32 master is the precise value of a 16-bit parameter
    tensors = data.get(key)
    return None if tensors is None else tensors[bucket]


def _load_group_hyperparameters(engine: ShardEngine, meta: dict[str, Any]) -> None:
    for group, saved in zip(engine.param_groups, meta["param_groups"], strict=True):
        group.update({k: v for k, v in saved.items() if k != "param_indices"})


def weights_key(meta: dict[str, Any]) -> str:
    """The shard-file key of a checkpoint's model weights: its weight average if it holds one
    (:data:`~lightning_zero.checkpoint.format.AVERAGE`), else the parameters."""
    return AVERAGE if AVERAGE in meta else "param"


def read_full_param(
    path: Path, meta: dict[str, Any], name: str, key: str = "param", files: ShardFiles | None = None
) -> Tensor | None:
    """One full parameter (or its ``exp_avg``/``exp_avg_sq``/``average``/... state) assembled from the
    shard files (the model's weights: ``key=weights_key(meta)``); of a tensor-parallel model, joined
    from every tensor-parallel rank's slices (:mod:`~lightning_zero.checkpoint.tensor_layout`).

    ``files`` keeps shard files mapped across calls. Returns ``None`` for a state the checkpoint
    does not hold. No communication. Of a pipeline-parallel model, read from the files of the pipeline
    rank that saved it (:func:`~lightning_zero.checkpoint.pipeline_layout.holding`).
    """
    files = ShardFiles(path) if files is None else files
    meta = holding(meta, name)
    where = saved_placement(meta, name)
    slices = []
    for part in views(meta) if where[0] == "shard" else views(meta)[:1]:
        piece = _read_slice(files.layout(part), files, name, key)
        if piece is None:
            return None
        slices.append(piece)
    return join(slices, where)


def _read_slice(layout: _SavedLayout, files: ShardFiles, name: str, key: str) -> Tensor | None:
    """Parameter ``name``'s state ``key`` as ``layout`` (one tensor-parallel rank's) holds it."""
    shape = layout.params[layout.by_name[name]]["shape"]
    numel = math.prod(shape)
    out: Tensor | None = None
    for rank, bucket, offset, count, at in layout.pieces(name, 0, numel):
        source = _source(files[layout.file(rank)], key, bucket)
        if source is None:
            return None
        if out is None:
            out = torch.empty(numel, dtype=source.dtype)
        out[at : at + count] = source[offset : offset + count]
    assert out is not None
    return out.view(shape)
