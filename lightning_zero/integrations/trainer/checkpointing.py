"""Sharded checkpoint hooks of ``ZeroStrategy``: Lightning's save/load/remove protocol mapped onto
:mod:`lightning_zero.checkpoint.format` (a directory of per-rank shard files),
:mod:`lightning_zero.checkpoint.reshard`
(loading onto any world size) and :mod:`lightning_zero.checkpoint.async_save` (background saves).

``ShardedCheckpointing`` is ``DDPStrategy`` plus these overrides; ``ZeroStrategy`` derives from it
and owns the state they read (the front end with the sharded optimizer, the writer, the settings).

  * ``save_checkpoint`` writes the directory (or, with ``sharded_checkpoint=False`` or when the
    parameters no longer are views of the flat buffers, one standard file); asynchronous saves
    return after a host snapshot, and the next save, a load and the end of ``fit`` wait for the
    commit, while ``remove_checkpoint`` (``ModelCheckpoint``'s top-k) deletes only after it;
  * ``load_checkpoint`` reads ``meta.pt`` and the model extras; ``load_model_state_dict`` and
    ``load_optimizer_state_dict`` then fill this rank's shards from the saved ones (during ``fit``)
    or whole parameters (``validate``/``test``/``predict``: the training buffers may be stale; a
    model this strategy's stage-3 fit left sharded gets its shards filled);
  * a ``save_weights_only`` checkpoint holds parameter shards alone and refuses to resume, as under
    ``"ddp"``.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_zero.checkpoint.async_save import AsyncCheckpointWriter
from lightning_zero.checkpoint.collective_read import read_meta_once, sharded_everywhere
from lightning_zero.checkpoint.format import (
    EXTRA,
    FABRIC_KEYS,
    WEIGHTS_ONLY,
    CheckpointError,
    save_sharded,
    weights_extras,
)
from lightning_zero.checkpoint.reshard import ShardFiles, load_sharded, read_full_param, weights_key
from lightning_zero.checkpoint.tensor_layout import copy_slices
from lightning_zero.comm import Comm
from lightning_zero.engine.parameters import sharded_engine
from lightning_zero.integrations.arguments import check_sharded_path, local_path
from lightning_zero.integrations.frontend import ZeroFrontEnd
from lightning_zero.layout.stages import other_stage_prefixes


class ShardedCheckpointing(DDPStrategy):
    """``DDPStrategy`` with sharded checkpoint hooks (the state is set up by ``ZeroStrategy``)."""

    _zero: ZeroFrontEnd
    _async_writer: AsyncCheckpointWriter | None
    _pending_load: tuple[Path, dict[str, Any]] | None
    _fit_running: bool
    _unwinding: bool

    def _fitting(self) -> bool:
        module = self.lightning_module
        return (
            module is not None
            and module._trainer is not None
            and module.trainer.state.fn == TrainerFn.FITTING
        )

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the sharded optimizer must exist to receive its state

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        self._zero.wait_for_params()
        in_shards = self._zero.writes_shards()
        module = self.lightning_module
        # (a model another Trainer left sharded: its state dict gathers one unit at a time)
        state = self._zero.state_for_shards(module) if in_shards else module.state_dict()
        # the shard files hold the trainable parameters; a standard file (sharded_checkpoint=False,
        # or parameters that left the flat buffers after a GPU teardown) holds what the module holds
        return self._zero.module_state(state, in_shards, aliases=self._zero.tied_aliases(module))

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self._zero.writes_shards():
            return {}  # written by save_checkpoint, shard by shard
        return super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        engine = self._zero.engine
        if not self._zero.writes_shards() or engine is None:
            self._refuse_whole_file("save")
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(
                "strategy 'zero' writes sharded checkpoint directories itself and takes no "
                f"storage_options (got {storage_options!r}); pass sharded_checkpoint=False for a CheckpointIO"
            )
        check_sharded_path(filepath)
        filepath = local_path(filepath)
        lightning_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        if "optimizer_states" not in checkpoint:  # save_weights_only: resuming must be refused as ddp does
            lightning_state[WEIGHTS_ONLY] = True
        args = (engine, filepath, lightning_state, checkpoint["state_dict"], self._zero.config.stage)
        assert self.lightning_module is not None
        aliases = self._zero.tied_aliases(self.lightning_module)
        writer = self._async_writer
        if writer is None or not self._saves_in_background(filepath):
            self.wait_for_checkpoint()  # commits stay in order
            save_sharded(*args, aliases=aliases)
        else:
            writer.save(*args, aliases=aliases)
            if self._linked_at_once(filepath):
                writer.wait()  # a link must never point at a checkpoint that may still fail
        return None

    def _saves_in_background(self, filepath: Any) -> bool:
        """Only while a fit runs normally (its next save, a load or its end reports a failure), and
        not for an HPC checkpoint, after which the job is requeued at once."""
        if not self._fit_running or Path(filepath).name.startswith("hpc_ckpt_"):
            return False
        assert self.lightning_module is not None
        return not self.lightning_module.trainer.interrupted  # e.g. save_on_exception: nothing reports after

    def _linked_at_once(self, filepath: Any) -> bool:
        """Whether a ``ModelCheckpoint(save_last="link")`` links its last checkpoint to ``filepath``
        right after the save returns (it does so for its every top-k save, with no hook in between)."""
        assert self.lightning_module is not None
        directory = os.path.realpath(Path(filepath).parent)
        return any(
            isinstance(cb, ModelCheckpoint)
            and cb.save_last == "link"
            and cb.save_top_k != 0
            and cb.dirpath is not None
            and os.path.realpath(cb.dirpath) == directory
            for cb in self.lightning_module.trainer.checkpoint_callbacks
        )

    @property
    def checkpoint_in_flight(self) -> bool:
        """Whether an asynchronous save (or a removal queued behind it) is still running on this rank."""
        return self._async_writer is not None and self._async_writer.pending

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous save is committed. Call on all ranks.

        Raises:
            CheckpointError: on every rank, if the save (or a removal behind it) failed on any rank.
        """
        if self._async_writer is not None:
            self._async_writer.wait()

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self._async_writer is None:
            return super().remove_checkpoint(filepath)
        # ModelCheckpoint removes the checkpoint a new one replaces right after issuing the new save:
        # deleting it once that save is committed never races the commit, and keeps it if the save fails
        self._async_writer.remove_after_commit(functools.partial(super().remove_checkpoint, filepath))
        return None

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self.wait_for_checkpoint()
        self._pending_load = None
        if not sharded_everywhere(checkpoint_path, Comm()):  # every rank takes the same branch
            self._refuse_whole_file("load")
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        path = Path(checkpoint_path)
        meta = read_meta_once(path, Comm())  # one read of meta.pt, not one per rank
        checkpoint = _as_trainer_checkpoint(meta["lightning"])
        checkpoint["state_dict"] = torch.load(path / EXTRA, map_location="cpu", weights_only=True)
        if not checkpoint.pop(WEIGHTS_ONLY, False):
            checkpoint["optimizer_states"] = [{}]  # filled from the shards by load_optimizer_state_dict
        self._pending_load = (path, meta)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        assert self.lightning_module is not None
        if self._pending_load is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        path, meta = self._pending_load
        module = self.lightning_module
        elsewhere = other_stage_prefixes(module)  # pipeline parallelism: the other stages' layers
        extras = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith(elsewhere)}
        engine = self._zero.engine
        if engine is not None and (self._fitting() or sharded_engine(module) is engine):
            # fit, or validate/test/predict of the model this strategy's stage-3 fit left sharded
            apart = self._fitting() and engine.averaging  # else the saved average is the weights
            extras = extras if apart else weights_extras(meta, extras)
            self._zero.restore_module(path, meta, module, extras, strict, average_apart=apart)
            return None
        # validate/test/predict: no optimizer, read whole parameters (a model another Trainer left
        # sharded takes them one unit at a time through its load_state_dict)
        extras = weights_extras(meta, extras)
        files = ShardFiles(path)
        for spec in meta["plan"]["params"]:
            name = spec["name"]
            if not name.startswith(elsewhere):
                extras[name] = read_full_param(path, meta, name, weights_key(meta), files=files)
        for alias, name in meta.get("aliases", {}).items():  # a tied weight's other key
            if name in extras:
                extras[alias] = extras[name]
        try:  # a tensor-parallel parameter takes its slice of the whole tensor
            extras, filled = copy_slices(module, extras)
        except ValueError as err:
            raise CheckpointError(f"{path}: {err}") from err
        missing, unexpected = module.load_state_dict(extras, strict=False)
        missing = [k for k in missing if k not in filled]
        if strict and (missing or unexpected):
            raise CheckpointError(
                f"{path}: model state does not match: missing keys {sorted(missing)}, "
                f"unexpected keys {sorted(unexpected)}"
            )
        return None

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if self._pending_load is None:
            return super().load_optimizer_state_dict(checkpoint)
        engine = self._zero.engine
        assert engine is not None
        path, meta = self._pending_load
        load_sharded(engine, path, meta, with_optimizer=True)
        self._pending_load = None
        return None

    def _refuse_whole_file(self, what: str) -> None:
        """A pipeline stage holds part of the model: one standard file cannot be written or read by it.

        Raises:
            ValueError: under ``pipeline_parallel_size > 1``, naming it.
        """
        size = self._zero.options.pipeline_parallel_size
        if size > 1:
            raise ValueError(
                f"pipeline_parallel_size={size} cannot {what} a single-file checkpoint (each stage holds "
                "only its layers): use sharded checkpoint directories (sharded_checkpoint=True, the "
                "default); `lightning-zero consolidate` turns one into a single file"
            )

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self._unwinding = True

    def _finish_saves(self) -> None:
        """Wait for an asynchronous save: on all ranks, raising its failure everywhere; or, unwinding
        from an error (other ranks may be elsewhere), on this rank alone, warning of its failure."""
        if self._async_writer is None:
            return
        if not self._unwinding:
            self._async_writer.wait()
            return
        try:
            self._async_writer.wait(agree=False)
        except Exception as err:  # noqa: BLE001 - another exception is already propagating
            warnings.warn(f"an asynchronous checkpoint save failed as well: {err}", stacklevel=2)


def _as_trainer_checkpoint(saved: dict[str, Any]) -> dict[str, Any]:
    """The Lightning state of a checkpoint as the Trainer reads it. One written by ``fabric.save``
    holds the Fabric loop's own entries instead: they are offered as ``checkpoint["fabric"]``
    (``on_load_checkpoint``), the loops and LR schedulers start afresh."""
    if FABRIC_KEYS not in saved:
        return dict(saved)
    keys = saved[FABRIC_KEYS]
    checkpoint: dict[str, Any] = {
        "pytorch-lightning_version": pl.__version__,
        "lr_schedulers": [],
        "fabric": {k: v for k, v in saved.items() if k not in (FABRIC_KEYS, WEIGHTS_ONLY)},
    }
    if WEIGHTS_ONLY in saved or keys.get("optimizer") is None:
        checkpoint[WEIGHTS_ONLY] = True
    return checkpoint
