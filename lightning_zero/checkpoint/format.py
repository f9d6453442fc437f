"""Sharded checkpoint directories: every rank writes its own shard; atomic commit; checksums.

Layout of a checkpoint directory ``CKPT/`` (format version :data:`FORMAT_VERSION`)::

    CKPT/shard-00000-of-00002.pt   rank 0's shards: per bucket, the parameters, Adam moments (and
    CKPT/shard-00001-of-00002.pt   fp32 master weights for 16-bit parameters, and a weight average
                                   if one is kept) — written by that rank
    CKPT/model_extra.pt            model tensors outside the buckets (buffers, frozen parameters)
    (tensor and pipeline parallelism: every rank's files, ``tensor_layout.py``, ``pipeline_layout.py``)
    CKPT/meta.pt                   format, world size, stage, bucket plan, per-parameter step counts,
                                   the names of the optimizer moments in the shard files,
                                   param-group hyper-parameters, Lightning's loop/callback/scheduler
                                   state, and the size and sha256 of every other file

Every file is written with ``torch.save`` of tensors and plain containers only, so it loads with
``torch.load(..., weights_only=True)`` (Lightning state is kept as it is; a hyper-parameter of a
custom class would need ``weights_only=False`` for ``meta.pt`` alone).

Commit protocol (all ranks): files go into a fresh hidden sibling ``.CKPT.tmp-<token>``; rank 0
gathers every rank's status and checksums and checks that it sees their files, writes ``meta.pt``
last, then swaps the temporary directory with any previous ``CKPT`` in one atomic
``renameat2(RENAME_EXCHANGE)`` (Linux; elsewhere the old one is moved aside first) and deletes the
old one; its verdict is broadcast. A crash before the rename leaves the previous checkpoint
untouched (the temporary directory is ignored by ``ckpt_path="last"``, which looks for ``*.ckpt``),
and nothing stale from an older world size survives a save over an existing path. A failure on any
rank raises on every rank. :mod:`lightning_zero.checkpoint.async_save` runs the same protocol on a
background thread.

The file names, ``meta.pt``'s reading and version check, the files' checksums and the keys are
:mod:`lightning_zero.checkpoint.directory`'s (re-exported here).
"""

from __future__ import annotations

import copy as copy_module
import os
import shutil
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_zero.checkpoint import pipeline_layout, tensor_layout
from lightning_zero.checkpoint.commit import IN_PLACE, commit_directory, save_outcome, unseen_files
from lightning_zero.checkpoint.directory import (
    AVERAGE,
    BUFFER_AVERAGE,
    EXTRA,
    FABRIC_KEYS,
    FORMAT_VERSION,
    META,
    WEIGHTS_ONLY,
    CheckpointError,
    all_shard_names,
    averaged_buffers,
    file_digest,
    is_sharded_checkpoint,
    moment_names,
    read_meta,
    saved_shard_name,
    shard_name,
    verify_files,
    weights_extras,
)
from lightning_zero.checkpoint.tensor_layout import checkpoint_comm
from lightning_zero.comm.communicator import Comm
from lightning_zero.comm.handles import CommError
from lightning_zero.comm.trace import span
from lightning_zero.engine.engine import ShardEngine
from lightning_zero.layout.local import is_dtensor

CopyFn = Callable[[torch.Tensor], torch.Tensor]

__all__ = [  # this module's, and the names of a directory (checkpoint/directory.py) readers import here
    "AVERAGE",
    "BUFFER_AVERAGE",
    "EXTRA",
    "FABRIC_KEYS",
    "FORMAT_VERSION",
    "META",
    "WEIGHTS_ONLY",
    "CheckpointError",
    "CopyFn",
    "StagedSave",
    "all_shard_names",
    "averaged_buffers",
    "file_digest",
    "is_sharded_checkpoint",
    "moment_names",
    "plan_meta",
    "read_meta",
    "save_sharded",
    "saved_shard_name",
    "shard_name",
    "stage_save",
    "verify_files",
    "weights_extras",
]


def plan_meta(engine: ShardEngine) -> dict[str, Any]:
    """The bucket plan as plain data (what loading on another world size needs)."""
    plan = engine.plan
    return {
        "world_size": plan.world_size,
        "params": [{"name": p.name, "shape": list(p.shape), "dtype": str(p.dtype)} for p in plan.params],
        "buckets": [
            {
                "dtype": str(b.dtype),
                "numel": b.numel,
                "padded_numel": b.padded_numel,
                "slots": [[s.param_index, s.bucket_offset, s.numel] for s in b.slots],
            }
            for b in plan.buckets
        ],
    }


def _shard_payload(
    engine: ShardEngine, copy_tensor: CopyFn | None, with_optimizer: bool = True
) -> dict[str, list[torch.Tensor]]:
    """This rank's tensors to save. Parameter shards are views of the flat buffer and are always
    copied (saving a view writes its whole storage); ``copy_tensor``, if given, copies every tensor
    (a snapshot that training going on cannot change). ``with_optimizer=False`` (a weights-only
    checkpoint) saves the parameter shards alone (no weight average: Lightning writes a weights-only
    checkpoint without its callbacks' state, so its weights are the current ones)."""
    records = engine.state.records

    def own(t: torch.Tensor, always: bool = False) -> torch.Tensor:
        if copy_tensor is not None:
            return copy_tensor(t)
        return t.detach().to("cpu", copy=True) if always else t

    payload = {"param": [own(r.param, always=True) for r in records]}
    if not with_optimizer:  # weights only: the current weights, no average (as Lightning's under "ddp")
        return payload
    if engine.averaging:  # the average is the model's weights in a checkpoint (WeightAveraging's rule)
        payload[AVERAGE] = [own(r.average) for r in records if r.average is not None]
    if any(r.separate_master for r in records):
        payload["master"] = [own(r.master) if r.separate_master else torch.empty(0) for r in records]
    for name in engine.state.moment_names:
        payload[name] = [own(r.moments[name]) for r in records]
    return payload


def _write(obj: Any, path: Path) -> tuple[str, int, str]:
    torch.save(obj, path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    size, digest = file_digest(path)
    return path.name, size, digest


@dataclass
class StagedSave:
    """Everything one rank writes for one checkpoint (a snapshot if staged with a ``copy_tensor``)."""

    target: Path
    tmp: Path
    rank: int
    """This rank's index in its shard group: the shard file it writes."""
    world_size: int
    """Ranks per shard group: the shard files of the checkpoint."""
    payload: dict[str, list[torch.Tensor]]
    extra: dict[str, torch.Tensor]
    meta: dict[str, Any]  # without "files" (added by rank 0 once every rank has written)
    before_write: Callable[[], None] | None = None  # e.g. wait for device-to-host copies
    device: torch.device | None = None
    """The training device (NVTX ranges of a write on the writer's own thread); None: the ``Comm``'s."""
    writes_shard: bool = True
    """Hybrid sharding: only the first replica group writes its shards (the others hold the same)."""
    tensor: tuple[int, int] | None = None
    """Tensor parallelism: ``(t, T)``, this rank's tensor-parallel rank and size (its files' names)."""
    pipeline: tuple[int, int] | None = None
    """Pipeline parallelism: ``(p, P)``, this rank's pipeline rank and size (its files' names)."""

    def write(self, comm: Comm) -> None:
        """Write, agree with the other ranks over ``comm`` (all ranks of
        :func:`~lightning_zero.checkpoint.tensor_layout.checkpoint_comm`, or a group of its own over
        them), commit on its rank 0. On all ranks.

        Before committing, rank 0 checks that it sees every rank's files at their sizes: on storage
        that is not shared by all nodes (a node-local disk) the other nodes' shards would be missing
        from the committed directory, and the error would only appear at the next load.

        Raises:
            CheckpointError: on every rank, if any rank failed or rank 0 cannot see a rank's files
                (the previous checkpoint is kept, and every rank removes its temporary files). If
                the collectives fail after rank 0 committed, the message says so (on rank 0) or
                that it may have (on the ranks whose word had reached it).
        """
        host = socket.gethostname()
        status: Any
        try:
            with span("checkpoint: write", self.device or comm.device):
                if self.before_write is not None:
                    self.before_write()
                self.tmp.mkdir(parents=True, exist_ok=True)
                name = shard_name(self.rank, self.world_size, self.tensor, self.pipeline)
                status = [_write(self.payload, self.tmp / name)] if self.writes_shard else []
                if comm.rank == 0:
                    status.append(_write(self.extra, self.tmp / EXTRA))
        except Exception as err:  # noqa: BLE001 - reported to every rank below
            status = f"rank {comm.rank}: {type(err).__name__}: {err} (host {host})"
        peer_failure: CommError | None = None
        progress = {"sent": False, "committed": False}
        try:
            with span("checkpoint: agree and commit", self.device or comm.device):
                errors = self._agree_and_commit(comm, host, status, progress)
        except CommError as err:  # a peer died or hung: no commit without every rank's word
            errors, peer_failure = [str(err)], err
        if errors:
            if not (peer_failure is not None and comm.rank != 0 and progress["sent"]):
                # every rank: node-local temporaries too; but not while rank 0 may still be committing
                # this (shared) directory: its verdict never arrived
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise CheckpointError(
                f"saving checkpoint {self.target} failed; "
                f"{save_outcome(comm.rank, progress, peer_failure, errors)}:\n"
                + "\n".join(sorted(set(errors), key=errors.index))
            ) from peer_failure  # the cause stays visible: a caller may resume or requeue on it

    def _agree_and_commit(self, comm: Comm, host: str, status: Any, progress: dict[str, bool]) -> list[str]:
        """Rank 0 gathers every rank's outcome, checks what it sees and commits; its verdict goes to
        every rank. The errors, on all ranks. Only rank 0 receives the ``N`` file lists (``meta.pt``
        lists every file); the others receive the errors alone, so nothing a rank other than 0
        receives grows with the world size. ``progress`` records how far it got (``sent``: the
        gather returned; ``committed``: rank 0 renamed the directory into place), for the message
        when the verdict's broadcast fails."""
        everyone = comm.gather_object((host, status), dst=0)  # a failed rank sends its error text
        progress["sent"] = True
        errors: list[str] = []
        if everyone is not None:  # rank 0
            errors = [s for _, s in everyone if isinstance(s, str)]
            if not errors:
                try:  # nothing may leave rank 0 before the broadcast the others wait in
                    errors = unseen_files(self.tmp, everyone, host)
                except OSError as err:
                    errors = [f"rank 0 (host {host}) cannot check {self.tmp}: {type(err).__name__}: {err}"]
            if not errors:
                try:
                    files = {
                        name: {"size": size, "sha256": digest}
                        for _, s in everyone
                        for name, size, digest in s
                    }
                    _write({**self.meta, "files": files}, self.tmp / META)
                    commit_directory(self.tmp, self.target, renamed=lambda: progress.update(committed=True))
                except Exception as err:  # noqa: BLE001
                    after = IN_PLACE if progress["committed"] else ""
                    errors.append(f"rank 0: {after}{type(err).__name__}: {err} (host {host})")
        if comm.world_size > 1:  # rank 0's verdict reaches everyone
            errors = comm.broadcast_object(errors, src=0)
        return errors


def stage_save(
    engine: ShardEngine,
    path: str | os.PathLike[str],
    lightning_state: dict[str, Any],
    extra_tensors: dict[str, torch.Tensor],
    stage: int,
    copy_tensor: CopyFn | None = None,
    aliases: dict[str, str] | None = None,
) -> StagedSave:
    """What this rank will write. Must be called on all ranks (one broadcast of a directory token).

    Args:
        engine: the sharded state (parameters, moments, masters) to save (``ShardedAdamW.engine``).
        path: the checkpoint directory to create or replace.
        lightning_state: written into ``meta.pt`` as it is (the caller snapshots it if needed).
        extra_tensors: model tensors outside the buckets, written by rank 0.
        stage: the ZeRO stage, recorded in ``meta.pt``.
        copy_tensor: copies every saved tensor (so that training may go on while it is written);
            without it, only the parameter shards are copied and the rest is referenced.
        aliases: other state-dict keys of planned parameters (a weight tied under two names) and the
            plan name each stands for, recorded in ``meta.pt``; readers give them the same tensor.

    Returns:
        The staged save; its ``write`` must then be called on all ranks.

    With tensor-parallel parameters, every tensor-parallel rank writes its slices' shards, and ``meta.pt``
    records the layout (:mod:`lightning_zero.checkpoint.tensor_layout`); under pipeline parallelism every
    pipeline rank writes its stages' shards, and ``meta.pt`` describes the joined model
    (:mod:`lightning_zero.checkpoint.pipeline_layout`); its ``write`` then takes every rank
    (:func:`~lightning_zero.checkpoint.tensor_layout.checkpoint_comm`).

    Raises:
        NotImplementedError: a tensor-parallel (``DTensor``) tensor outside the buckets (a frozen
            parameter or a buffer), or tensor-parallel ranks that are not the whole world (before
            anything is written).
    """
    sliced = sorted(name for name, value in extra_tensors.items() if is_dtensor(value))
    if sliced:
        raise NotImplementedError(
            f"a checkpoint holds tensor-parallel (DTensor) tensors outside the optimizer's parameters only "
            f"whole: {sliced} are frozen parameters or buffers of the tensor-parallel plan; keep them "
            "plain tensors (e.g. requires_grad=True, or leave them out of parallelize_module's plan)"
        )
    everyone = checkpoint_comm(engine)
    engine.wait_for_params()  # parameter gathers left in flight write the buffers saved here
    comm, target = engine.comm, Path(path)
    token = everyone.broadcast_object(uuid.uuid4().hex if everyone.rank == 0 else None, src=0)
    payload = _shard_payload(engine, copy_tensor, with_optimizer=not lightning_state.get(WEIGHTS_ONLY, False))
    meta = {
        "format_version": FORMAT_VERSION,
        "world_size": comm.world_size,
        "stage": stage,
        "plan": plan_meta(engine),
        "steps": torch.tensor(engine.state.steps, dtype=torch.int64),
        "moments": list(engine.state.moment_names),
        "param_groups": copy_module.deepcopy(engine.group_hyperparameters()),
        "lightning": lightning_state,
        "aliases": dict(aliases or {}),
    }
    if engine.averaging and AVERAGE in payload:
        meta[AVERAGE] = {"n_averaged": engine.n_averaged}
    tensor = engine.tensor
    if tensor is not None:  # every tensor-parallel rank's plan: their local shapes may differ
        tensor_layout.record(engine, tensor.comm.all_gather_object(plan_meta(engine)), meta)
    meta = pipeline_layout.record(engine, meta)  # every pipeline rank's plan, joined by name
    extra_tensors = pipeline_layout.gather_extras(engine, extra_tensors)  # every stage's buffers on rank 0
    copy_extra = copy_tensor or (lambda t: t.detach().cpu())
    return StagedSave(
        target,
        target.parent / f".{target.name}.tmp-{token}",
        comm.rank,
        comm.world_size,
        payload,
        {k: copy_extra(v) for k, v in extra_tensors.items()},
        meta,
        writes_shard=engine.groups.replicas.rank == 0,
        tensor=None if tensor is None else (tensor.rank, tensor.size),
        pipeline=None if engine.pipeline is None else (engine.pipeline.rank, engine.pipeline.world_size),
        device=engine.world.device,
    )


def save_sharded(
    engine: ShardEngine,
    path: str | os.PathLike[str],
    lightning_state: dict[str, Any],
    extra_tensors: dict[str, torch.Tensor],
    stage: int,
    aliases: dict[str, str] | None = None,
) -> None:
    """Write a checkpoint directory at ``path``, blocking. Must be called on all ranks (``aliases``:
    see :func:`stage_save`).

    Raises:
        CheckpointError: on every rank, if any rank failed to write (the previous ``path`` is kept).
    """
    with span("checkpoint: stage", engine.world.device):
        staged = stage_save(engine, path, lightning_state, extra_tensors, stage, aliases=aliases)
    staged.write(checkpoint_comm(engine))
