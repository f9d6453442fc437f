"""Read a trained `PretrainModule` and its tokenizer back from a run, for export and generation.

A checkpoint is either an ordinary Lightning file (`strategy="auto"`/`"ddp"`, or one consolidated by
lightning-zero) or a lightning-zero sharded directory (`meta.pt` + shards), which lightning-zero's
loader assembles in memory. Both carry the module's hyper-parameters (plain dicts), so nothing but the
path is needed. Everything is read on the CPU with `weights_only=True`: a checkpoint cannot run code.

The tokenizer is not in the checkpoint. `find_tokenizer` looks beside it, as `recipes.pretrain` leaves
a run (checkpoint in `<run_dir>/checkpoints/`): a tokenizer file in `<run_dir>` (`tokenizer.json` of a
trained BPE, or the `tokenizer.json`/`*.model`/`*.tiktoken` file `TokenizerCopy` copied there), else
`<run_dir>/config.yaml`'s `data.tokenizer` (`byte`, or a file: its copy in `<run_dir>` under the same
name, else the original path), with its `data.eos_token`. `--tokenizer byte|PATH` overrides the search.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import lightning.pytorch.core.saving as saving

from recipes.data import ByteTokenizer, Tokenizer, TokenizerError, load_tokenizer_spec, resolve_tokenizer
from recipes.training import PretrainModule


class LoadError(RuntimeError):
    """A checkpoint or tokenizer that cannot be used; the message names the path."""


def require_checkpoint(path: str | Path) -> Path:
    """`path`, if something is there (a file or a sharded directory); else `LoadError` naming it."""
    path = Path(path)
    if not path.exists():
        raise LoadError(f"checkpoint not found: {path}")
    return path


def load_module(path: str | Path) -> PretrainModule:
    """The `PretrainModule` saved at `path` (a checkpoint file or sharded directory), on CPU, in eval mode.

    Raises:
        LoadError: if `path` is missing, unreadable, or lacks the saved hyper-parameters or weights.
    """
    path = require_checkpoint(path)
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
        spec: "byte", a tokenizer file (`tokenizer.json`, SentencePiece `.model`, `.tiktoken`) or a
            directory holding one, or "auto" (see the module docstring).

    Raises:
        LoadError: if the tokenizer file is missing or "auto" finds nothing to go by.
    """
    if spec not in ("auto", "byte") and not Path(spec).exists():
        raise LoadError(f"tokenizer file not found: {spec}")
    if spec != "auto":
        return _load(spec, None)
    checkpoint = Path(checkpoint).resolve()
    for folder in (checkpoint.parent, checkpoint.parent.parent):
        data = _run_data_config(folder)
        eos = data.get("eos_token")
        files = [folder / name for name in _FILES if (folder / name).is_file()]
        files += sorted(folder.glob("*.model")) + sorted(folder.glob("*.tiktoken"))
        if files:  # the trained BPE, or the copy `TokenizerCopy` left
            return _load(str(files[0]), eos)
        named = data.get("tokenizer")
        if named == "byte":
            return ByteTokenizer()
        if named and named != "bpe":  # a file: the run's copy of it, else the original
            copy = folder / Path(named).name
            return _load(str(copy if copy.is_file() else named), eos)
    raise LoadError(
        f"cannot tell which tokenizer {checkpoint} was trained with (no tokenizer file or config.yaml "
        "naming data.tokenizer beside it or in its run directory): pass --tokenizer byte or "
        "--tokenizer PATH (tokenizer.json, .model or .tiktoken)"
    )


_FILES = ("tokenizer.json", "tokenizer.model")
"""Tokenizer files `find_tokenizer` takes first in a run directory (then any `*.model`, `*.tiktoken`)."""


def _run_data_config(folder: Path) -> dict[str, Any]:
    """`data` of the run's `config.yaml` in `folder` (empty without one)."""
    if not (folder / "config.yaml").is_file():
        return {}
    from omegaconf import DictConfig, OmegaConf

    run_config = OmegaConf.load(folder / "config.yaml")
    data = run_config.get("data") if isinstance(run_config, DictConfig) else None
    return dict(OmegaConf.to_container(data)) if isinstance(data, DictConfig) else {}  # type: ignore[arg-type]


def _load(name: str, eos_token: str | None) -> Tokenizer:
    try:
        return load_tokenizer_spec(resolve_tokenizer(name, eos_token))
    except TokenizerError as err:
        raise LoadError(str(err)) from None


def check_vocabulary(module: PretrainModule, tokenizer: Tokenizer) -> None:
    """Raise `LoadError` if the tokenizer has ids the model's embedding does not cover."""
    if tokenizer.vocab_size > module.model_config.vocab_size:
        raise LoadError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
            f"model.vocab_size={module.model_config.vocab_size}: not the tokenizer it was trained with"
        )
