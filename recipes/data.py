"""Token data for pretraining: every source goes through prepared token shards, read by every rank.

Sources (`data.path`):
* a directory prepared by `python -m recipes.prepare` (`data=tokens`): read as it is; its tokenizer and
  validation split are the ones recorded in its `index.json` (`data.tokenizer` must be null);
* `null` (the embedded stdlib corpus, `data=stdlib`) or text / `.jsonl` / `.parquet` files, a directory
  or a glob (`data=text`): prepared on first use - by `prepare_data`, i.e. local rank 0 of each node - into
  `<cache_dir>/tokens/<key>/` with the same code as `recipes.prepare` (one process), then read like a
  prepared directory. The key hashes the files' paths, sizes and modification times (never their
  contents), the tokenizer and the split settings, so a second run reuses the shards after a `stat` per
  file and per shard; an edited file makes a new entry. `data.tokenizer=bpe` trains a BPE on the corpus
  into that directory;
* one `.bin` of token ids (`data=pretokenized`): memory-mapped as it is, the last `data.val_fraction`
  of its tokens validate (kept for existing files; `recipes.prepare` is the path for new data).

Every rank opens the index and memory-maps lazily only the shards it reads (`recipes.shards`). Training
and validation samples are non-overlapping windows of `seq_len + 1` tokens of the split's token stream
(`TokenWindows`). The training order is `recipes.sampling`'s: a permutation per epoch from
`(data.seed, epoch)`, cut into global batches of `devices x num_nodes x accumulate_grad_batches x
batch_size` windows, each rank training its part of every global batch; the position (the optimizer's
step count) is saved in checkpoints and a resume continues with the next unseen global batch, also on
another world size with the same global batch (`recipes.resume`). Validation windows are split over
ranks by Lightning's `DistributedSampler`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from recipes.corpus import Corpus, CorpusError, resolve_corpus
from recipes.prepare import prepare, tokenizer_from_dir
from recipes.prepare_plan import PrepareConfig, plan_key, plan_record
from recipes.resume import TrainDataResume
from recipes.shards import (
    TokenIndex,
    TokenStream,
    check_shard_sizes,
    is_token_dir,
    read_index,
    token_dtype,
)
from recipes.sources import source_fingerprint
from recipes.tokenizer import Tokenizer, load_tokenizer_spec, resolve_tokenizer

__all__ = ["DataConfig", "PretrainDataModule", "TokenWindows", "check_token_count", "token_dtype"]


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the tokens come from, how text is tokenized and how windows are batched."""

    path: str | None = None
    """A prepared token directory, text / .jsonl / .parquet file(s) (file, directory, glob), one .bin
    of token ids, or None: the built-in stdlib corpus."""
    tokenizer: str | None = "byte"
    """"byte", "bpe" (trained on the corpus), a tokenizer.json / .model / .tiktoken file (or a directory
    holding one); null with a prepared directory, whose index names its tokenizer."""
    eos_token: str | None = None
    """End-of-document token overriding the tokenizer's own (text sources)."""
    text_field: str = "text"
    """Field holding the text in .jsonl and .parquet rows."""
    bpe_vocab_size: int = 4096
    """Vocabulary size when training BPE."""
    seq_len: int = 256
    """Tokens per training window; must be <= model.max_seq_len."""
    batch_size: int = 16
    """Windows per micro-batch on each device (global batch: devices x num_nodes x accumulate x this)."""
    val_fraction: float = 0.05
    """Text sources: fraction of documents held out; a .bin: tail fraction of its tokens. A prepared
    directory keeps the split it was prepared with."""
    max_corpus_mb: float = 4.0
    """Size of the stdlib subset used when `path` is None."""
    cache_dir: str = "~/.cache/lightning-zero"
    """Directory of the prepared-shards cache of text sources."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""
    seed: int = 1234
    """Seed of each epoch's training order (the same on every rank and world size)."""

    def __post_init__(self) -> None:
        if self.seq_len < 1 or self.batch_size < 1 or self.num_workers < 0:
            raise ValueError("data.seq_len and data.batch_size must be >= 1, data.num_workers >= 0")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.max_corpus_mb <= 0:
            raise ValueError(f"data.max_corpus_mb must be > 0, got {self.max_corpus_mb}")
        if self.tokenizer is not None and self.tokenizer == "":
            raise ValueError("data.tokenizer='' is not valid; choose byte, bpe, a tokenizer file, or null")

    @property
    def vocab_size(self) -> int | None:
        """Vocabulary size known without reading a file (byte, bpe); None otherwise."""
        return {"byte": 256, "bpe": self.bpe_vocab_size}.get(self.tokenizer or "")

    @property
    def cache_root(self) -> Path:
        return Path(self.cache_dir).expanduser()

    @property
    def prepared(self) -> bool:
        """True when `path` is a directory written by `recipes.prepare`."""
        return is_token_dir(self.path)

    @property
    def pretokenized(self) -> bool:
        return self.path is not None and Path(self.path).suffix == ".bin" and Path(self.path).is_file()


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows `(x, y)` of `seq_len` tokens at offsets `i * seq_len`, `y` = `x` shifted by one token.

    `tokens` is a `TokenStream` or a 1-D array; the order of the windows is the sampler's business.
    """

    def __init__(self, tokens: TokenStream | np.ndarray, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        start = index * self.seq_len
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))  # (T + 1,)
        return window[:-1], window[1:]


def prepare_config(config: DataConfig, corpus: Corpus) -> PrepareConfig:
    """The `recipes.prepare` settings for a text source, into its cache directory."""
    fields = dict(
        inputs=tuple(str(p) for p in corpus.files),
        tokenizer=config.tokenizer or "byte",
        eos_token=config.eos_token,
        text_field=config.text_field,
        bpe_vocab_size=config.bpe_vocab_size,
        val_fraction=config.val_fraction,
        verify=False,  # reuse after a size check: no rank re-reads the corpus or its shards at start-up
        progress=False,
    )
    spec = (
        None if config.tokenizer == "bpe" else resolve_tokenizer(config.tokenizer or "byte", config.eos_token)
    )
    probe = PrepareConfig(out="-", **fields)  # type: ignore[arg-type]
    key = plan_key(plan_record(probe, source_fingerprint(list(corpus.files), None), spec))
    return PrepareConfig(out=str(config.cache_root / "tokens" / key), **fields)  # type: ignore[arg-type]


def check_token_count(n_train: int, n_val: int, config: DataConfig) -> None:
    """Raise `CorpusError` unless both splits hold at least one full window of `seq_len + 1` tokens."""
    needed = config.seq_len + 1
    if n_train < needed or n_val < needed:
        raise CorpusError(
            f"data.path={config.path!r}: {n_train} training and {n_val} validation tokens, too few for "
            f"data.seq_len={config.seq_len} (each split needs {needed}); add text, raise "
            "data.val_fraction (validation is chosen by documents) or lower data.seq_len."
        )


def bin_split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """A `.bin`'s stream cut into training head and validation tail."""
    n_train = int(len(tokens) * (1.0 - val_fraction))
    return tokens[:n_train], tokens[n_train:]


def load_pretokenized(path: str | Path, vocab_size: int) -> np.ndarray:
    """Map a user's `.bin` file of token ids with the dtype the vocabulary implies."""
    dtype = token_dtype(vocab_size)
    if Path(path).stat().st_size % dtype.itemsize != 0:
        raise CorpusError(
            f"data.path={str(path)!r}: size is not a multiple of {dtype.itemsize} ({dtype.name})"
        )
    return np.memmap(path, dtype=dtype, mode="r")


class PretrainDataModule(pl.LightningDataModule):
    """Prepares text sources once per node, then serves train/val windows of token shards on every rank."""

    def __init__(self, config: DataConfig, corpus: Corpus | None = None) -> None:
        super().__init__()
        self.config = config
        self.corpus = corpus
        self.tokenizer: Tokenizer | None = None
        self.index: TokenIndex | None = None
        self.directory: Path | None = None
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None
        self.train_resume = TrainDataResume()

    def _prepare_config(self) -> PrepareConfig:
        if self.corpus is None:
            self.corpus = resolve_corpus(self.config.path, self.config.max_corpus_mb)
        return prepare_config(self.config, self.corpus)

    def prepare_data(self) -> None:
        """Local rank 0 of each node: tokenize a text source into the cache (a no-op when it is there)."""
        if not (self.config.prepared or self.config.pretokenized):
            summary = prepare(self._prepare_config())
            if summary.new_tokens:  # first use: say where the shards went (once per node)
                print(summary.line(), flush=True)

    def setup(self, stage: str) -> None:
        if self.config.pretokenized:
            self.tokenizer = load_tokenizer_spec(resolve_tokenizer(self.config.tokenizer or "byte"))
            tokens = load_pretokenized(self.config.path, self.tokenizer.vocab_size)  # type: ignore[arg-type]
            train, val = bin_split(tokens, self.config.val_fraction)
        else:
            self.directory = Path(self.config.path if self.config.prepared else self._prepare_config().out)  # type: ignore[arg-type]
            self.index = read_index(self.directory)
            check_shard_sizes(self.directory, self.index)
            self.tokenizer = tokenizer_from_dir(self.directory, self.index)
            train = TokenStream(self.directory, self.index.split("train"), self.index.dtype)
            val = TokenStream(self.directory, self.index.split("val"), self.index.dtype)
        check_token_count(len(train), len(val), self.config)
        self.train_set = TokenWindows(train, self.config.seq_len)
        self.val_set = TokenWindows(val, self.config.seq_len)

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        assert self.train_set is not None, "setup() must run first"
        return self.train_resume.loader(
            self.trainer,
            self.train_set,
            micro_batch_size=self.config.batch_size,
            seed=self.config.seed,
            num_workers=self.config.num_workers,
        )

    def state_dict(self) -> dict[str, Any]:
        """The training data position, saved in every checkpoint (see `recipes.resume`)."""
        return self.train_resume.state_dict(self.trainer) if self.trainer is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.train_resume.load_state_dict(state_dict)

    def val_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        assert self.val_set is not None, "setup() must run first"
        return self._loader(self.val_set, shuffle=False)

    def _loader(self, dataset: Dataset[tuple[torch.Tensor, torch.Tensor]], shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.config.batch_size,
            shuffle=shuffle,
            drop_last=shuffle,
            num_workers=self.config.num_workers,
            persistent_workers=self.config.num_workers > 0,
            generator=torch.Generator().manual_seed(self.config.seed) if shuffle else None,
        )
