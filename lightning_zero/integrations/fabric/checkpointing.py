"""Checkpoints of ``ZeroFabricStrategy``: ``fabric.save``/``fabric.load``/``fabric.load_raw`` on the
Trainer strategy's sharded directory format (:mod:`lightning_zero.checkpoint.format`).

``fabric.save(path, {"model": model, "optimizer": optimizer, "step": n, ...})`` (all ranks) writes a
directory: the sharded model and optimizer go into the per-rank shard files and ``model_extra.pt``
(buffers, frozen parameters), everything else (ints, LR scheduler and other stateful objects, other
modules) into ``meta.pt``'s Lightning state, as Fabric's ``"ddp"`` would convert it, together with
the keys that named the model and the optimizer. Saving writes checksums and commits atomically;
``lightning-zero verify``/``consolidate`` read it (a consolidated Fabric directory has ``"ddp"``'s
layout: ``{"model": state_dict, "optimizer": AdamW state, "step": n, ...}``).

``fabric.load(path, state)`` (all ranks) fills, on any world size and stage:
  * the model set up by ``fabric.setup`` (recognised by identity, whatever its key) from the shard
    files (this rank reads only the pieces it owns) and ``model_extra.pt``;
  * the sharded optimizer likewise (moments, step counts, param-group hyper-parameters; loading it
    also restores the parameters, which are its master weights);
  * every other key from the saved state, Fabric's way (stateful objects by ``load_state_dict``,
    the rest by assignment into ``state``); with ``strict=True`` a key the checkpoint lacks raises.
A directory written by the Trainer strategy loads the same way (its loop, callback and scheduler
state is returned as the remainder), and one written here resumes a Trainer fit (model and optimizer
state; the Fabric loop's own entries are offered to the LightningModule as ``checkpoint["fabric"]``).

Single files (``sharded_checkpoint=False``, a consolidated checkpoint, ``fabric.load_raw`` of a
module or optimizer state dict) go through Fabric's own path; loading a full state into the sharded
model or optimizer writes the flat buffers and the master weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _Stateful
from typing_extensions import override

from lightning_zero.checkpoint.collective_read import read_meta_once, sharded_everywhere
from lightning_zero.checkpoint.consolidate import load_module_checkpoint
from lightning_zero.checkpoint.format import (
    EXTRA,
    FABRIC_KEYS,
    WEIGHTS_ONLY,
    CheckpointError,
    is_sharded_checkpoint,
    read_meta,
    save_sharded,
)
from lightning_zero.checkpoint.reshard import load_sharded, preflight
from lightning_zero.comm import Comm
from lightning_zero.integrations.arguments import check_sharded_path, local_path
from lightning_zero.integrations.frontend import ZeroFrontEnd


class FabricCheckpointing(DDPStrategy):
    """Fabric ``DDPStrategy`` with sharded checkpoints (the state is set up by ``ZeroFabricStrategy``)."""

    _zero: ZeroFrontEnd
    _module: torch.nn.Module | None

    def wait_for_params(self) -> None:
        """Complete the parameter all-gathers left in flight by ``overlap_param_gather`` (needed
        before reading parameters outside the model's forward)."""
        self._zero.wait_for_params()

    @override
    def get_module_state_dict(self, module: torch.nn.Module) -> dict[str, Any]:
        self.wait_for_params()
        return self._zero.module_state(super().get_module_state_dict(module), trainable_in_shards=False)

    @override
    def load_module_state_dict(
        self, module: torch.nn.Module, state_dict: dict[str, Any], strict: bool = True
    ) -> None:
        self.wait_for_params()
        super().load_module_state_dict(module, state_dict, strict=strict)
        engine = self._zero.engine
        if module is self._module and engine is not None:
            engine.refresh_master()  # 16-bit parameters: their fp32 masters follow

    @override
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any = None, filter: Any = None
    ) -> None:
        engine = self._zero.engine
        if not self._zero.writes_shards() or engine is None:
            return super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
        if storage_options is not None:
            raise TypeError(
                "strategy 'zero' writes sharded checkpoint directories itself and takes no "
                f"storage_options (got {storage_options!r}); pass sharded_checkpoint=False for a CheckpointIO"
            )
        check_sharded_path(path)
        path = local_path(path)
        module_key, optimizer_key = self._sharded_keys(state)
        filtered = sorted(k for k in (filter or {}) if k in (module_key, optimizer_key))
        if filtered:
            raise ValueError(
                f"fabric.save(filter=...) on the sharded model/optimizer ({filtered}) is not supported "
                "by sharded checkpoints; pass sharded_checkpoint=False to save a filtered single file"
            )
        rest = {k: v for k, v in state.items() if k not in (module_key, optimizer_key)}
        lightning_state = self._convert_stateful_objects_in_state(rest, filter=filter or {})
        lightning_state[FABRIC_KEYS] = {"module": module_key, "optimizer": optimizer_key}
        if optimizer_key is None:
            lightning_state[WEIGHTS_ONLY] = True  # parameters alone: it cannot restore an optimizer
        extras: dict[str, torch.Tensor] = {}
        aliases: dict[str, str] = {}
        if module_key is not None:
            module_state = self._zero.state_for_shards(state[module_key])  # stage 3: nothing gathered
            aliases = self._zero.tied_aliases(state[module_key])
            extras = self._zero.module_state(module_state, trainable_in_shards=True, aliases=aliases)
        save_sharded(engine, path, lightning_state, extras, self._zero.config.stage, aliases=aliases)
        return None

    def _sharded_keys(self, state: dict[str, Any]) -> tuple[str | None, str | None]:
        """The keys under which ``state`` holds the sharded model and optimizer (by identity)."""
        module_key = next((k for k, v in state.items() if v is self._module), None)
        optimizer_key = next((k for k, v in state.items() if v is self._zero.optimizer), None)
        return module_key, optimizer_key

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: torch.nn.Module | torch.optim.Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        # a load into the sharded model or optimizer is collective anyway: every rank takes the same
        # branch and meta.pt is read once, not once per rank; any other (e.g. fabric.load_raw into a
        # plain module, maybe on one rank) makes no collective
        collective = self._into_shards(state)
        if not (sharded_everywhere(path, Comm()) if collective else _sharded_here(path)):
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        path = Path(path)
        meta = read_meta_once(path, Comm()) if collective else read_meta(path)
        saved = dict(meta["lightning"])
        keys = saved.pop(FABRIC_KEYS, None) or {}
        params_only = bool(saved.pop(WEIGHTS_ONLY, False))
        if not state:
            return {**saved, keys.get("module") or "state_dict": load_module_checkpoint(path)["state_dict"]}
        if isinstance(state, torch.nn.Module):
            self._load_module(path, meta, state, strict, with_optimizer=False)
            return {}
        if isinstance(state, torch.optim.Optimizer):
            self._load_optimizer_only(path, meta, state, params_only)
            return {}
        module_key, optimizer_key = self._sharded_keys(state)
        if module_key is None and keys.get("module") in state:
            module_key = keys["module"]  # e.g. loading for inference, no sharded optimizer set up
        requested = [k for k in state if k not in (module_key, optimizer_key)]
        if keys.get("optimizer") in requested:
            raise CheckpointError(
                f"{path}: its optimizer state (saved under {keys['optimizer']!r}) loads only into the "
                "sharded optimizer returned by fabric.setup(model, optimizer); call fabric.load after it"
            )
        missing = [k for k in requested if k not in saved]
        if strict and missing:
            raise KeyError(
                f"The requested state contains a key '{missing[0]}' that does not exist in the loaded "
                f"checkpoint {path}. To disable strict loading, set `strict=False`."
            )
        if optimizer_key is not None and params_only:
            raise CheckpointError(f"{path} holds model weights only; it cannot restore the optimizer")
        if module_key is not None:
            self._load_module(path, meta, state[module_key], strict, with_optimizer=optimizer_key is not None)
        elif optimizer_key is not None:
            self._load_optimizer_only(path, meta, state[optimizer_key], params_only)
        for key in requested:
            if key not in saved:
                continue
            obj = state[key]
            if isinstance(obj, torch.nn.Module):
                self.load_module_state_dict(obj, saved.pop(key), strict=strict)
            elif isinstance(obj, _Stateful):
                obj.load_state_dict(saved.pop(key))
            else:
                state[key] = saved.pop(key)
        return saved

    def _into_shards(self, state: Any) -> bool:
        """Whether ``state`` holds the sharded model or optimizer (loading it is a collective)."""
        if not self._zero.bound():
            return False
        held = state.values() if isinstance(state, dict) else [state]
        return any(obj is self._module or obj is self._zero.optimizer for obj in held)

    def _load_module(
        self, path: Path, meta: dict[str, Any], module: torch.nn.Module, strict: bool, with_optimizer: bool
    ) -> None:
        """The sharded model from its shards (and the optimizer with it), or any other module from
        whole parameters assembled from the files."""
        extras = dict(torch.load(path / EXTRA, map_location="cpu", weights_only=True))
        if module is self._module and self._zero.bound():
            self._zero.restore_module(path, meta, module, extras, strict, with_optimizer=with_optimizer)
            return
        if with_optimizer:
            raise CheckpointError(
                f"{path}: the optimizer state can only be loaded into the sharded optimizer returned by "
                "fabric.setup(model, optimizer), together with its model"
            )
        self.load_module_state_dict(module, load_module_checkpoint(path)["state_dict"], strict=strict)

    def _load_optimizer_only(
        self, path: Path, meta: dict[str, Any], optimizer: torch.optim.Optimizer, params_only: bool
    ) -> None:
        engine = self._zero.engine
        if optimizer is not self._zero.optimizer or not self._zero.bound() or engine is None:
            raise CheckpointError(
                f"{path}: a sharded optimizer state loads only into the sharded optimizer returned by "
                "fabric.setup(model, optimizer); consolidate the checkpoint for any other optimizer"
            )
        if params_only:
            raise CheckpointError(f"{path} holds model weights only; it cannot restore the optimizer")
        preflight(engine, path, meta)
        load_sharded(engine, path, meta, with_optimizer=True)


def _sharded_here(path: Any) -> bool:
    """Whether ``path`` is a sharded checkpoint, on this rank alone (a load that makes no collective).

    Raises:
        CheckpointError: ``path`` is a directory without ``meta.pt`` (an interrupted save).
    """
    if os.path.isdir(path) and not is_sharded_checkpoint(path):
        read_meta(path)  # raises, naming the missing meta.pt
    return is_sharded_checkpoint(path)
