"""Checks of a composed config that the schema cannot express, run before any process starts.

The schema (`recipes.schema`) already rejects unknown keys and wrong types at compose time, and Hydra
rejects unknown group options (`model=huge`) listing the valid ones. This module catches what needs
the values together or the machine: a data path that matches nothing or holds no text, a window
longer than the model's context, a vocabulary the model cannot cover, more devices than the machine
has, a `ckpt_path` with nothing to resume, a strategy whose package is missing, and the value checks
of the recipe dataclasses. Each failure is a `ConfigError` whose message names the setting and what
would be valid; the entry point prints it and exits non-zero without touching earlier runs.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from recipes.corpus import Corpus, CorpusError, resolve_corpus
from recipes.data import DataConfig, check_token_count, token_dtype
from recipes.model import GPTConfig
from recipes.module import OptimConfig
from recipes.tokenizer import BPETokenizer


class ConfigError(ValueError):
    """A setting that cannot work; the message says which and what is valid."""


@dataclass(frozen=True)
class RecipeConfigs:
    """The validated recipe dataclasses, ready to build the model, data and optimizer."""

    model: GPTConfig
    data: DataConfig
    optim: OptimConfig
    corpus: Corpus


def _build(node: DictConfig, **kwargs: Any) -> Any:
    """Instantiate one `_target_` node, turning its constructor's ValueError into a ConfigError."""
    try:
        return instantiate(node, _convert_="all", **kwargs)  # plain lists, not ListConfig, in dataclasses
    except InstantiationException as error:
        raise ConfigError(str(error.__cause__ or error)) from error


def tokenizer_vocab_size(data: DataConfig) -> int:
    """Vocabulary of the configured tokenizer; an existing `data.tokenizer_path` is read for it."""
    if data.tokenizer == "bpe" and data.tokenizer_path is not None:
        path = Path(data.tokenizer_path).expanduser()
        if not path.is_file():
            raise ConfigError(f"data.tokenizer_path={data.tokenizer_path!r} does not exist")
        return BPETokenizer(path).vocab_size
    return data.vocab_size


def check_corpus(data: DataConfig, vocab_size: int) -> Corpus:
    """Resolve `data.path` and, where the token count is known without tokenizing, check its size."""
    try:
        corpus = resolve_corpus(data.path, data.max_corpus_mb)
        if corpus.pretokenized:
            if data.tokenizer == "bpe" and data.tokenizer_path is None:
                raise CorpusError(
                    f"data.path={data.path!r} is pre-tokenized: with data.tokenizer=bpe also give "
                    "data.tokenizer_path=<the tokenizer.json that produced it>"
                )
            itemsize = token_dtype(vocab_size).itemsize
            if corpus.nbytes % itemsize != 0:
                raise CorpusError(f"data.path={data.path!r}: size is not a multiple of {itemsize} bytes")
            check_token_count(corpus.nbytes // itemsize, data)
        elif data.tokenizer == "byte":
            check_token_count(corpus.nbytes + 2 * len(corpus.files), data)
    except CorpusError as error:
        raise ConfigError(str(error)) from error
    return corpus


def check_devices(accelerator: str, devices: Any) -> None:
    """Refuse a `trainer.devices` count above what this machine offers for `trainer.accelerator`."""
    if accelerator in ("gpu", "cuda"):
        import torch

        available, kind = torch.cuda.device_count(), "CUDA GPUs"
        if available == 0:
            raise ConfigError(
                f"trainer.accelerator={accelerator} but no CUDA GPU is visible; use trainer=cpu"
            )
    elif accelerator == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        available, kind = cores or 1, "CPU cores"
    else:
        return
    requested = len(devices) if isinstance(devices, list | tuple) else devices
    if isinstance(requested, int) and requested > available:
        raise ConfigError(
            f"trainer.devices={requested} but this machine has {available} {kind}; "
            f"use trainer.devices=1..{available} (or 'auto')"
        )


def check_slurm_launch(env: Mapping[str, str] | None = None) -> None:
    """Inside an sbatch allocation of several tasks, refuse to start outside `srun`.

    Lightning would take SLURM's task count as the world size and wait forever for ranks that were
    never started. (Under `srun`, Lightning itself checks tasks per node against `trainer.devices`.)
    """
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" not in env or env.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return
    ntasks = int(env.get("SLURM_NTASKS", "1"))
    if ntasks > 1 and "SLURM_STEP_ID" not in env:
        raise ConfigError(
            f"running inside SLURM job {env['SLURM_JOB_ID']} with {ntasks} tasks but not through srun: "
            "start the recipe with `srun python -m recipes.pretrain ...` (python -m recipes.sbatch writes "
            "such a script)"
        )


def check_ckpt_path(ckpt_path: str | None, run_dir: Path, run_name: str) -> None:
    """`last` needs a checkpoint in this run's directory; any other value must be an existing path."""
    if ckpt_path is None:
        return
    if ckpt_path == "last":
        found = list((run_dir / "checkpoints").glob("last*.ckpt")) + list(run_dir.glob("hpc_ckpt_*.ckpt"))
        if not found:
            raise ConfigError(
                f"ckpt_path=last: no checkpoint in {run_dir / 'checkpoints'} (run_name={run_name}). "
                "Run once without ckpt_path, or set run_name to an earlier run's name."
            )
    elif not Path(ckpt_path).expanduser().exists():
        raise ConfigError(f"ckpt_path={ckpt_path!r} does not exist; give a checkpoint path, 'last' or null")


def check_strategy(strategy: DictConfig) -> None:
    """The strategy's `_target_` must be importable (the ZeRO configs need `lightning_zero`)."""
    target = str(strategy.get("_target_", ""))
    module_name = target.rpartition(".")[0]
    try:
        importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(
            f"strategy._target_={target} cannot be imported ({error}); "
            "install the library with `pip install -e .` or choose strategy=ddp"
        ) from error


def unknown_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Keys added with Hydra's `+key=value` to a schema-typed node (the schema rejects them otherwise)."""
    found: list[str] = []
    node_type = OmegaConf.get_type(node)
    allowed = {f.name for f in dataclasses.fields(node_type)} if dataclasses.is_dataclass(node_type) else None
    for key in node.keys():
        full_key = f"{prefix}{key}"
        if allowed is not None and key not in allowed:
            found.append(full_key)
        if OmegaConf.is_missing(node, key):
            continue
        child = node[key]
        if isinstance(child, DictConfig):
            found.extend(unknown_keys(child, prefix=f"{full_key}."))
    return found


def validate(cfg: DictConfig) -> RecipeConfigs:
    """Check the composed config; return the recipe dataclasses it describes.

    Raises:
        ConfigError: with a message naming the offending setting.
    """
    extra = unknown_keys(cfg)
    if extra:
        raise ConfigError(f"unknown key(s): {', '.join(extra)}; see `python -m recipes.pretrain --cfg job`")
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(
            f"missing mandatory value(s): {', '.join(missing)}; set them as key=value overrides"
        )
    data: DataConfig = _build(cfg.data)
    data_vocab = tokenizer_vocab_size(data)
    model_vocab = cfg.model.vocab_size if cfg.model.vocab_size is not None else data_vocab
    model: GPTConfig = _build(cfg.model, vocab_size=model_vocab)
    optim: OptimConfig = _build(cfg.optim)
    if model.vocab_size < data_vocab:
        raise ConfigError(
            f"model.vocab_size={model.vocab_size} is smaller than the tokenizer's {data_vocab} "
            f"(data.tokenizer={data.tokenizer}); set model.vocab_size>={data_vocab} or null"
        )
    if data.seq_len > model.max_seq_len:
        raise ConfigError(
            f"data.seq_len={data.seq_len} exceeds model.max_seq_len={model.max_seq_len}; "
            f"use data.seq_len<={model.max_seq_len} or a larger model.max_seq_len"
        )
    corpus = check_corpus(data, data_vocab)
    check_devices(str(cfg.trainer.accelerator), cfg.trainer.devices)
    check_slurm_launch()
    check_ckpt_path(cfg.ckpt_path, Path(cfg.run_dir), cfg.run_name)
    check_strategy(cfg.strategy)
    return RecipeConfigs(model=model, data=data, optim=optim, corpus=corpus)
