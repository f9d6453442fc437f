"""Read a trained `PretrainModule` and its tokenizer back from a run, for export and generation.

A checkpoint is either an ordinary Lightning file (`strategy="auto"`/`"ddp"`, or one consolidated by
lightning-zero) or a lightning-zero sharded directory (`meta.pt` + shards), which lightning-zero's
loader assembles in memory. Both carry the module's hyper-parameters (plain dicts), so nothing but the
path is needed. Everything is read on the CPU with `weights_only=True`: a checkpoint cannot run code.

The tokenizer is not in the checkpoint. `find_tokenizer` looks beside it, as `recipes.pretrain` leaves
a run: `<run_dir>/tokenizer.json` (a trained BPE) or `<run_dir>/config.yaml` (which says `byte`), with the
checkpoint in `<run_dir>/checkpoints/`; `--tokenizer byte|PATH` overrides the search.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import lightning.pytorch.core.saving as saving

from recipes.module import PretrainModule
from recipes.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer


class LoadError(RuntimeError):
    """A checkpoint or tokenizer that cannot be used; the message names the path."""


def load_module(path: str | Path) -> PretrainModule:
    """The `PretrainModule` saved at `path` (a checkpoint file or sharded directory), on CPU, in eval mode.

    Raises:
        LoadError: if `path` is missing, unreadable, or lacks the saved hyper-parameters or weights.
    """
    path = Path(path)
    if not path.exists():
        raise LoadError(f"checkpoint not found: {path}")
    try:
        checkpoint: dict[str, Any] = saving.pl_load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch.load and lightning-zero raise many kinds for a damaged file
        raise LoadError(f"cannot read checkpoint {path}: {error}") from error
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise LoadError(f"{path} is not a Lightning checkpoint (no state_dict)")
    hparams = checkpoint.get("hyper_parameters") or {}
    if "model_config" not in hparams:
        raise LoadError(
            f"{path} has no saved model config (hyper_parameters.model_config): it was written before "
            "PretrainModule saved its hyper-parameters, or by another LightningModule"
        )
    # As Lightning's load_from_checkpoint does, drop what the module no longer takes (checkpoints written
    # before throughput moved to a callback saved `peak_flops_per_device`).
    accepted = inspect.signature(PretrainModule).parameters
    module = PretrainModule(**{k: v for k, v in hparams.items() if k in accepted})
    try:
        module.load_state_dict(checkpoint["state_dict"])
    except RuntimeError as error:
        raise LoadError(f"the weights in {path} do not fit its model config: {error}") from error
    return module.eval()


def find_tokenizer(checkpoint: str | Path, spec: str = "auto") -> Tokenizer:
    """The tokenizer a checkpoint was trained with.

    Args:
        checkpoint: the checkpoint path (its run directory is searched when `spec` is "auto").
        spec: "byte", a `tokenizer.json` path, or "auto" (see the module docstring).

    Raises:
        LoadError: if the tokenizer file is missing or "auto" finds nothing to go by.
    """
    if spec == "byte":
        return ByteTokenizer()
    if spec != "auto":
        if not Path(spec).is_file():
            raise LoadError(f"tokenizer file not found: {spec}")
        return BPETokenizer(spec)
    checkpoint = Path(checkpoint).resolve()
    for folder in (checkpoint.parent, checkpoint.parent.parent):
        if (folder / "tokenizer.json").is_file():
            return BPETokenizer(folder / "tokenizer.json")
        if (folder / "config.yaml").is_file():
            from omegaconf import DictConfig, OmegaConf

            run_config = OmegaConf.load(folder / "config.yaml")
            data = (run_config.get("data") if isinstance(run_config, DictConfig) else None) or {}
            if data.get("tokenizer") == "byte":
                return ByteTokenizer()
            if data.get("tokenizer_path") and Path(data["tokenizer_path"]).is_file():
                return BPETokenizer(data["tokenizer_path"])
    raise LoadError(
        f"cannot tell which tokenizer {checkpoint} was trained with (no tokenizer.json or config.yaml "
        "saying data.tokenizer=byte beside it or in its run directory): pass --tokenizer byte or "
        "--tokenizer PATH/tokenizer.json"
    )


def check_vocabulary(module: PretrainModule, tokenizer: Tokenizer) -> None:
    """Raise `LoadError` if the tokenizer has ids the model's embedding does not cover."""
    if tokenizer.vocab_size > module.model_config.vocab_size:
        raise LoadError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
            f"model.vocab_size={module.model_config.vocab_size}: not the tokenizer it was trained with"
        )
