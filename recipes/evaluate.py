"""Loss and perplexity of a checkpoint on held-out tokens: `python -m recipes.evaluate CKPT [data=NAME]
[data.KEY=VALUE ...] [key=value ...]`.

CKPT is a Lightning checkpoint file, a lightning-zero sharded checkpoint directory, or a run directory
(`outputs/<run_name>`: its newest checkpoint, `checkpoints/*.ckpt` or `*.ckpt`, by modification time).
The data is the run's own (`data` of `<run_dir>/config.yaml`, found beside the checkpoint as
`recipes.load` finds the tokenizer) unless `data=NAME` starts from `conf/data/NAME.yaml` instead; either
way `data.KEY=VALUE` overrides single keys, checked like the recipe's (an unknown key or a wrong type is
an error naming it). The split is the data module's: `split=val` (default; the held-out documents, or a
`.bin`'s tail) or `split=train`, read in order as non-overlapping windows of `data.seq_len` tokens,
`data.batch_size` windows per batch; `limit_batches=N` stops after N batches (0: all).

Refused before evaluating, naming both sides: data whose tokenizer is not the one the checkpoint was
trained with (its identity - kind, file hash, end-of-document id - against the run's tokenizer; a bare
checkpoint file without a run directory can only get the vocabulary check), token ids the model cannot
embed, `data.seq_len` above the model's context. A BPE trained on the fly (`data.tokenizer=bpe`) is
only known after preparation, so it is compared then.

Prints a progress bar on stderr, then one line on stdout: the mean cross-entropy per token (nats),
`perplexity = exp(loss)`, the tokens counted and the rate. Over the whole validation split this is the
`val/loss` and `val/ppl` a one-process `recipes.pretrain` logs (Lightning averages its per-batch means
weighted by batch size; every window has `seq_len` tokens, so both are the per-token mean). One process,
`device=cpu|cuda`, fp32.
"""

from __future__ import annotations

import argparse
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

from recipes.corpus import CorpusError
from recipes.data import DataConfig, PretrainDataModule
from recipes.generate import hydra_style
from recipes.lineage import is_complete
from recipes.load import LoadError, check_vocabulary, find_tokenizer, load_module, require_checkpoint
from recipes.model import GPT
from recipes.module import PretrainModule
from recipes.prepare import tokenizer_from_dir
from recipes.shards import ShardError
from recipes.tokenizer import Tokenizer, TokenizerError, load_tokenizer_spec, resolve_tokenizer
from recipes.validate import max_token_id

EXIT_ERROR = 1
CONF_DATA = Path(__file__).resolve().parents[1] / "conf" / "data"


def is_checkpoint(path: Path) -> bool:
    """A checkpoint file, or a committed lightning-zero checkpoint directory (`meta.pt` is written last)."""
    return path.is_file() or (path / "meta.pt").is_file()


def resolve_checkpoint(path: Path) -> Path:
    """`path` itself when it is a checkpoint, else the newest checkpoint of the run directory `path`.

    Raises:
        LoadError: if `path` does not exist, or is a directory holding no checkpoint.
    """
    require_checkpoint(path)
    if is_checkpoint(path):
        return path
    found = [*path.glob("checkpoints/*.ckpt"), *path.glob("*.ckpt")]
    candidates = [p for p in found if is_checkpoint(p) and is_complete(p)]  # not one cut off mid-write
    if not candidates:
        raise LoadError(
            f"{path} is neither a checkpoint (a file, or a directory with meta.pt) nor a run directory "
            "with checkpoints (checkpoints/*.ckpt or *.ckpt)"
        )

    def written(checkpoint: Path) -> float:
        return (checkpoint if checkpoint.is_file() else checkpoint / "meta.pt").stat().st_mtime

    return max(candidates, key=written)


def run_config(checkpoint: Path) -> DictConfig | None:
    """The `config.yaml` that `recipes.pretrain` left beside the checkpoint or in its run directory."""
    for folder in (checkpoint, checkpoint.parent, checkpoint.parent.parent):
        if (folder / "config.yaml").is_file():
            config = OmegaConf.load(folder / "config.yaml")
            return config if isinstance(config, DictConfig) else None
    return None


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


def declared_tokenizer(config: DataConfig) -> Tokenizer | None:
    """The data's tokenizer when it is known without preparing the data (not for a BPE trained on it)."""
    if config.prepared:
        return tokenizer_from_dir(config.path)  # type: ignore[arg-type]
    if config.tokenizer in (None, "bpe"):
        return None
    return load_tokenizer_spec(resolve_tokenizer(config.tokenizer, config.eos_token))


def check_same_tokenizer(trained: Tokenizer | None, data: Tokenizer | None, config: DataConfig) -> None:
    """Raise `LoadError` unless the data is tokenized by the checkpoint's tokenizer (when both are known)."""
    if trained is not None and data is not None and trained.identity != data.identity:
        raise LoadError(
            f"the checkpoint was trained with tokenizer {trained.identity} but data.path={config.path!r} "
            f"(data.tokenizer={config.tokenizer}) is tokenized with {data.identity}: evaluate on data "
            "made with the same tokenizer (e.g. the run's own data: no data= argument)"
        )


def trained_tokenizer(checkpoint: Path, spec: str) -> Tokenizer | None:
    """The checkpoint's tokenizer (`recipes.load.find_tokenizer`); None, with a note, if "auto" finds none."""
    try:
        return find_tokenizer(checkpoint, spec)
    except LoadError as error:
        if spec != "auto":
            raise
        print(f"note: only the vocabulary size can be checked: {error}", file=sys.stderr)
        return None


def check_token_ids(module_vocab: int, config: DataConfig, tokenizer: Tokenizer) -> None:
    """Raise `LoadError` if the data holds ids the model cannot embed (a prepared index or a `.bin`)."""
    top = max_token_id(config, tokenizer.vocab_size)  # -1 for text: its ids come from the tokenizer
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


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m recipes.evaluate", description=__doc__.split("\n")[0])
    parser.add_argument(
        "checkpoint", help="checkpoint file, lightning-zero checkpoint directory or run directory"
    )
    parser.add_argument("overrides", nargs="*", metavar="data.KEY=VALUE", help="data settings")
    parser.add_argument("--data", help="a conf/data/ config to start from instead of the run's own data")
    parser.add_argument("--split", choices=("val", "train"), default="val")
    parser.add_argument("--limit-batches", type=int, default=0, help="evaluate the first N batches (0: all)")
    parser.add_argument("--tokenizer", default="auto", help="the checkpoint's: auto | byte | PATH")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_intermixed_args(hydra_style(argv))
    if args.limit_batches < 0:
        parser.error(f"limit_batches must be >= 0 (0: all batches), got {args.limit_batches}")
    return args


def load_checked(args: argparse.Namespace) -> tuple[Path, PretrainModule, PretrainDataModule]:
    """Resolve the checkpoint and the data and check them together; preparing the data (tokenizing a
    text source into the cache on first use) is the only step that may take long."""
    checkpoint = resolve_checkpoint(Path(args.checkpoint))
    config = data_config(checkpoint, args.data, args.overrides)
    module = load_module(checkpoint)
    context = module.model_config.max_seq_len
    if config.seq_len > context:
        raise LoadError(
            f"data.seq_len={config.seq_len} is longer than the model's context (max_seq_len={context}); "
            f"set data.seq_len<={context}"
        )
    trained = trained_tokenizer(checkpoint, args.tokenizer)
    check_same_tokenizer(trained, declared_tokenizer(config), config)
    datamodule = PretrainDataModule(config)
    datamodule.prepare_data()
    datamodule.setup("validate")
    assert datamodule.tokenizer is not None, "set by setup()"
    check_same_tokenizer(trained, datamodule.tokenizer, config)
    check_vocabulary(module, datamodule.tokenizer)
    check_token_ids(module.model_config.vocab_size, config, datamodule.tokenizer)
    return checkpoint, datamodule, module


def main(argv: list[str] | None = None) -> None:
    """Load, check, evaluate, print one line (errors: one line, exit status 1)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        checkpoint, datamodule, module = load_checked(args)
    except (LoadError, CorpusError, ShardError, TokenizerError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(EXIT_ERROR)
    dataset = datamodule.val_set if args.split == "val" else datamodule.train_set
    assert dataset is not None, "set by setup()"
    config = datamodule.config
    print(
        f"evaluating {checkpoint} on the {args.split} split of {config.path or 'the stdlib corpus'}: "
        f"{len(dataset):,} windows of {config.seq_len} tokens",
        file=sys.stderr,
    )
    loader = DataLoader(dataset, batch_size=config.batch_size, num_workers=config.num_workers)
    device = torch.device(args.device)
    result = evaluate_loss(module.model.to(device), loader, device, args.limit_batches)
    print(
        f"{args.split}: loss {result.loss:.6f} nats/token, perplexity {result.perplexity:.6g} over "
        f"{result.tokens:,} tokens ({result.windows:,} windows of {config.seq_len}) "
        f"in {result.seconds:.2f} s ({result.tokens / result.seconds:,.0f} tokens/s)"
    )


if __name__ == "__main__":
    main()
