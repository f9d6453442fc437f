"""Loss and perplexity of a checkpoint on held-out tokens (`python -m recipes.evaluate`).

The data is the run's own (`data` of its `config.yaml`, `recipes.checkpoints.locate`) unless a
`conf/data/` group starts from another; `data.KEY=VALUE` overrides single keys, checked like the
recipe's (an unknown key or a wrong type is an error naming it). The split is the data module's
(`recipes.data.module`): `val` (the held-out documents, or a `.bin`'s tail) or `train`, read in order as
non-overlapping windows of `data.seq_len` tokens.

Refused before evaluating (`load_checked`), naming both sides: data whose tokenizer is not the one the
checkpoint was trained with (its identity - kind, file hash, end-of-document id - against the run's
tokenizer; a bare checkpoint file without a run directory can only get the vocabulary check), token ids
the model cannot embed (the data source's `max_token_id`), `data.seq_len` above the model's context. A
BPE trained on the fly (`data.tokenizer=bpe`) is only known after preparation, so it is compared then.

`evaluate_loss` gives the mean cross-entropy per token (nats) and `perplexity = exp(loss)`. Over the
whole validation split this is the `val/loss` and `val/ppl` a one-process `recipes.pretrain` logs
(Lightning averages its per-batch means weighted by batch size; every window has `seq_len` tokens, so
both are the per-token mean). One process, fp32.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch.utils.data import DataLoader
from tqdm import tqdm

from recipes.checkpoints.load import LoadError, check_vocabulary, find_tokenizer, load_module
from recipes.checkpoints.locate import resolve_checkpoint, run_config
from recipes.data import DataConfig, DataSource, Tokenizer
from recipes.data.module import PretrainDataModule
from recipes.training import GPT, PretrainModule

CONF_DATA = Path(__file__).resolve().parents[2] / "conf" / "data"


def data_config(checkpoint: Path, group: str | None, overrides: list[str]) -> DataConfig:
    """The data to evaluate on: the run's `data` or `conf/data/<group>.yaml`, plus `data.*` overrides.

    Raises:
        LoadError: naming the group, the key or the value that is not valid.
    """
    if group is not None:
        options = sorted(p.stem for p in CONF_DATA.glob("*.yaml"))
        if group not in options:
            raise LoadError(f"data={group} is not a data config; choose one of {', '.join(options)}")
        base = OmegaConf.load(CONF_DATA / f"{group}.yaml")
    else:
        config = run_config(checkpoint)
        if config is None or not isinstance(config.get("data"), DictConfig):
            raise LoadError(
                f"no run config.yaml beside {checkpoint} says which data it trained on: pass "
                f"data=<{'|'.join(sorted(p.stem for p in CONF_DATA.glob('*.yaml')))}> data.path=..."
            )
        base = config.data
    bad = [o for o in overrides if not o.startswith("data.") or "=" not in o]
    if bad:
        raise LoadError(f"unknown argument {bad[0]!r}: data settings are data.KEY=VALUE (e.g. data.path=DIR)")
    try:
        user = OmegaConf.merge(base, OmegaConf.from_dotlist([o.removeprefix("data.") for o in overrides]))
        user.pop("_target_", None)
        if missing := sorted(OmegaConf.missing_keys(user)):
            raise LoadError(
                f"data.{missing[0]} is required by data={group or 'the run'}: add data.{missing[0]}=..."
            )
        values = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(DataConfig), user), resolve=True)
        return DataConfig(**values)  # type: ignore[arg-type]
    except OmegaConfBaseException as error:
        raise LoadError(f"data.{error.full_key}: {str(error).splitlines()[0]}") from error
    except ValueError as error:
        raise LoadError(str(error)) from error


def check_same_tokenizer(trained: Tokenizer | None, data: Tokenizer | None, config: DataConfig) -> None:
    """Raise `LoadError` unless the data is tokenized by the checkpoint's tokenizer (when both are known)."""
    if trained is not None and data is not None and trained.identity != data.identity:
        raise LoadError(
            f"the checkpoint was trained with tokenizer {trained.identity} but data.path={config.path!r} "
            f"(data.tokenizer={config.tokenizer}) is tokenized with {data.identity}: evaluate on data "
            "made with the same tokenizer (e.g. the run's own data: no data= argument)"
        )


def trained_tokenizer(checkpoint: Path, spec: str) -> Tokenizer | None:
    """The checkpoint's tokenizer (`load.find_tokenizer`); None, with a note, if "auto" finds none."""
    try:
        return find_tokenizer(checkpoint, spec)
    except LoadError as error:
        if spec != "auto":
            raise
        print(f"note: only the vocabulary size can be checked: {error}", file=sys.stderr)
        return None


def check_token_ids(module_vocab: int, source: DataSource, tokenizer: Tokenizer) -> None:
    """Raise `LoadError` if the data holds ids the model cannot embed (a prepared index or a `.bin`)."""
    config = source.config
    top = source.max_token_id(tokenizer.vocab_size)  # -1 for text: its ids come from the tokenizer
    if top >= module_vocab:
        raise LoadError(
            f"data.path={config.path!r} holds token id {top}, outside the model's vocabulary of "
            f"{module_vocab}: it was tokenized for another model"
        )


@dataclass(frozen=True)
class Evaluation:
    """What `evaluate_loss` counted."""

    loss_sum: float
    """Cross-entropy summed over every target token, in nats."""
    tokens: int
    windows: int
    seconds: float

    @property
    def loss(self) -> float:
        return self.loss_sum / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


@torch.inference_mode()
def evaluate_loss(model: GPT, loader: DataLoader, device: torch.device, limit_batches: int = 0) -> Evaluation:
    """Per-token cross-entropy of `model` over the first `limit_batches` batches of `loader` (0: all).

    The sum accumulates on the device in float64; the progress bar reads it every 10 batches only.
    """
    total = len(loader) if limit_batches == 0 else min(limit_batches, len(loader))
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = windows = 0
    started = time.perf_counter()
    with tqdm(total=total, desc="evaluate", unit="batch", file=sys.stderr, mininterval=1.0) as bar:
        for inputs, targets in loader:  # each (B, T)
            if bar.n == total:
                break
            logits = model(inputs.to(device))  # (B, T, V)
            targets = targets.to(device).flatten()  # (B * T,)
            loss_sum += F.cross_entropy(logits.flatten(0, 1).float(), targets, reduction="sum")
            tokens, windows = tokens + targets.numel(), windows + inputs.shape[0]
            bar.update()
            if bar.n % 10 == 0 or bar.n == total:
                bar.set_postfix(loss=f"{float(loss_sum) / tokens:.4f}", refresh=False)
    return Evaluation(float(loss_sum), tokens, windows, time.perf_counter() - started)


def load_checked(
    path: str | Path, group: str | None, overrides: list[str], tokenizer: str = "auto"
) -> tuple[Path, PretrainDataModule, PretrainModule]:
    """The checkpoint `path` means, its data (set up) and its module, checked together.

    Args:
        path: a checkpoint file, a lightning-zero checkpoint directory or a run directory.
        group: a `conf/data/` config to start from instead of the run's own data (None: the run's).
        overrides: `data.KEY=VALUE` settings.
        tokenizer: the checkpoint's tokenizer, "auto" (searched beside it), "byte" or a file.

    Preparing the data (tokenizing a text source into the cache on first use) is the only step that
    may take long.

    Raises:
        LoadError, DataError: naming the checkpoint, the setting or the file that does not fit.
    """
    checkpoint = resolve_checkpoint(Path(path))
    config = data_config(checkpoint, group, overrides)
    module = load_module(checkpoint)
    context = module.model_config.max_seq_len
    if config.seq_len > context:
        raise LoadError(
            f"data.seq_len={config.seq_len} is longer than the model's context (max_seq_len={context}); "
            f"set data.seq_len<={context}"
        )
    trained = trained_tokenizer(checkpoint, tokenizer)
    datamodule = PretrainDataModule(config)
    check_same_tokenizer(trained, datamodule.source.declared_tokenizer(), config)
    datamodule.prepare_data()
    datamodule.setup("validate")
    assert datamodule.tokenizer is not None, "set by setup()"
    check_same_tokenizer(trained, datamodule.tokenizer, config)
    check_vocabulary(module, datamodule.tokenizer)
    check_token_ids(module.model_config.vocab_size, datamodule.source, datamodule.tokenizer)
    return checkpoint, datamodule, module
