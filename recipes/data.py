"""Token data for pretraining: a memory-mapped cache of token ids and a LightningDataModule over it.

Pipeline: `corpus` (files) -> tokenizer -> one flat binary file of token ids (np.uint16 when the
vocabulary fits in 16 bits, else np.uint32) -> split: the first `1 - val_fraction` of the stream trains,
the tail validates -> fixed-length windows `(x, y)` with `y` = `x` shifted by one token.

Cache: `<cache_dir>/tokens/<key>.bin` plus a `<key>.json` that is written last (its presence marks a
complete file; writes go through a temporary name and `os.replace`). The key hashes the corpus contents
(not paths or mtimes) and the tokenizer identity, so editing a source file or switching tokenizer makes
a new entry, and a second run over the same text reuses the old one. Locally trained BPE tokenizers
live in `<cache_dir>/tokenizers/`.

Sampling: training windows start at offsets drawn once from `numpy.random.default_rng(data.seed)`;
their order is `recipes.sampling`'s: a permutation per epoch from `(data.seed, epoch)`, cut into global
batches of `devices x num_nodes x accumulate_grad_batches x batch_size` windows, each rank training its
part of every global batch; the position (the optimizer's step count) is saved in checkpoints and a
resume continues with the next unseen global batch, also on another world size with the same global
batch (`recipes.resume`). Validation uses consecutive non-overlapping windows, split over ranks by
Lightning's `DistributedSampler`. The cache is built in `prepare_data` (one process per node), then
every rank maps it in `setup`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from recipes.corpus import Corpus, CorpusError, resolve_corpus
from recipes.resume import TrainDataResume
from recipes.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, train_bpe

_CACHE_FORMAT = "tokens-v1"


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the text comes from, how it is tokenized and how it is batched."""

    path: str | None = None
    """Text file, directory, glob, or one pre-tokenized .bin; None: the built-in stdlib corpus."""
    tokenizer: str = "byte"
    """"byte" (vocabulary 256) or "bpe" (byte-level BPE trained on the corpus, or `tokenizer_path`)."""
    bpe_vocab_size: int = 4096
    """Vocabulary size when training BPE."""
    tokenizer_path: str | None = None
    """An existing tokenizer.json to use instead of training BPE (needed with .bin input and bpe)."""
    seq_len: int = 256
    """Tokens per training window; must be <= model.max_seq_len."""
    batch_size: int = 16
    """Windows per micro-batch on each device (global batch: devices x num_nodes x accumulate x this)."""
    val_fraction: float = 0.05
    """Tail fraction of the token stream held out for validation."""
    max_corpus_mb: float = 4.0
    """Size of the stdlib subset used when `path` is None."""
    cache_dir: str = "~/.cache/lightning-zero"
    """Directory of the token and tokenizer caches."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""
    seed: int = 1234
    """Seed of the training window offsets and of each epoch's sample order."""

    def __post_init__(self) -> None:
        if self.tokenizer not in ("byte", "bpe"):
            raise ValueError(f"data.tokenizer={self.tokenizer!r} is not valid; choose 'byte' or 'bpe'")
        if self.seq_len < 1 or self.batch_size < 1 or self.num_workers < 0:
            raise ValueError("data.seq_len and data.batch_size must be >= 1, data.num_workers >= 0")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.max_corpus_mb <= 0:
            raise ValueError(f"data.max_corpus_mb must be > 0, got {self.max_corpus_mb}")

    @property
    def vocab_size(self) -> int:
        """Vocabulary size the model must cover (known before any tokenizer is trained)."""
        return 256 if self.tokenizer == "byte" else self.bpe_vocab_size

    @property
    def cache_root(self) -> Path:
        return Path(self.cache_dir).expanduser()


@dataclass(frozen=True)
class TokenCache:
    """A cached token file and whether this call found it already built."""

    path: Path
    key: str
    n_tokens: int
    dtype: str
    hit: bool

    def load(self) -> np.ndarray:
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding every id of a `vocab_size` vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def cache_key(corpus_hash: str, tokenizer: Tokenizer) -> str:
    """Content-and-tokenizer key of a token file."""
    return hashlib.sha256(f"{_CACHE_FORMAT}\0{tokenizer.identity}\0{corpus_hash}".encode()).hexdigest()[:24]


def build_token_cache(corpus: Corpus, tokenizer: Tokenizer, cache_root: Path) -> TokenCache:
    """Tokenize `corpus` into `cache_root/tokens/<key>.bin` unless that entry already exists."""
    key = cache_key(corpus.content_hash(), tokenizer)
    directory = cache_root / "tokens"
    meta_path, bin_path = directory / f"{key}.json", directory / f"{key}.bin"
    dtype = token_dtype(tokenizer.vocab_size)
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if (
            bin_path.exists()
            and bin_path.stat().st_size == meta["n_tokens"] * np.dtype(meta["dtype"]).itemsize
        ):
            return TokenCache(bin_path, key, meta["n_tokens"], meta["dtype"], hit=True)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = bin_path.with_suffix(f".tmp{os.getpid()}")
    n_tokens = 0
    with tmp.open("wb") as handle:
        for document in corpus.documents():
            ids = tokenizer.encode_document(document)
            handle.write(ids.astype(dtype).tobytes())
            n_tokens += len(ids)
    os.replace(tmp, bin_path)
    meta = {
        "n_tokens": n_tokens,
        "dtype": dtype.name,
        "tokenizer": tokenizer.identity,
        "source": corpus.description,
    }
    tmp_meta = meta_path.with_suffix(f".tmp{os.getpid()}")
    tmp_meta.write_text(json.dumps(meta, indent=1))
    os.replace(tmp_meta, meta_path)
    return TokenCache(bin_path, key, n_tokens, dtype.name, hit=False)


def load_tokenizer(config: DataConfig, corpus: Corpus, train_if_missing: bool) -> Tokenizer:
    """The tokenizer `config` asks for; BPE is trained on `corpus` (and cached) when allowed."""
    if config.tokenizer == "byte":
        return ByteTokenizer()
    if config.tokenizer_path is not None:
        return BPETokenizer(Path(config.tokenizer_path).expanduser())
    if corpus.pretokenized:
        raise CorpusError(
            "data.tokenizer=bpe with a .bin data.path needs data.tokenizer_path=<tokenizer.json>"
        )
    path = config.cache_root / "tokenizers" / f"bpe-{config.bpe_vocab_size}-{corpus.content_hash()[:16]}.json"
    if path.exists():
        return BPETokenizer(path)
    if not train_if_missing:
        raise FileNotFoundError(f"BPE tokenizer {path} missing; prepare_data should have trained it")
    return train_bpe(corpus.documents(), config.bpe_vocab_size, path)


def load_pretokenized(corpus: Corpus, tokenizer: Tokenizer) -> np.ndarray:
    """Map a user's `.bin` file of token ids with the dtype the tokenizer's vocabulary implies."""
    path = corpus.files[0]
    dtype = token_dtype(tokenizer.vocab_size)
    if path.stat().st_size % dtype.itemsize != 0:
        raise CorpusError(
            f"data.path={str(path)!r}: size is not a multiple of {dtype.itemsize} ({dtype.name})"
        )
    return np.memmap(path, dtype=dtype, mode="r")


def check_token_count(n_tokens: int, config: DataConfig) -> None:
    """Raise `CorpusError` unless both splits hold at least one full window of `seq_len + 1` tokens."""
    n_val = n_tokens - int(n_tokens * (1.0 - config.val_fraction))
    needed = config.seq_len + 1
    if n_tokens - n_val < needed or n_val < needed:
        minimum = int(needed / min(config.val_fraction, 1.0 - config.val_fraction)) + 1
        raise CorpusError(
            f"data.path={config.path!r}: the corpus has {n_tokens} tokens, too few for data.seq_len="
            f"{config.seq_len} with data.val_fraction={config.val_fraction} (need about {minimum}); "
            "add text or lower data.seq_len."
        )


class RandomWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows of `seq_len + 1` tokens at seeded random offsets; one epoch covers the stream about once."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        num_windows = max(1, (len(tokens) - 1) // seq_len)
        rng = np.random.default_rng(seed)
        self.offsets = rng.integers(0, len(tokens) - seq_len, size=num_windows)  # (num_windows,)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.offsets[index])
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))  # (T + 1,)
        return window[:-1], window[1:]


class SequentialWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Consecutive non-overlapping windows, for a validation loss that does not depend on a seed."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(1, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))  # (T + 1,)
        return window[:-1], window[1:]


class PretrainDataModule(pl.LightningDataModule):
    """Builds the token cache once per node, then serves train/val windows on every rank."""

    def __init__(self, config: DataConfig, corpus: Corpus | None = None) -> None:
        super().__init__()
        self.config = config
        self.corpus = corpus if corpus is not None else resolve_corpus(config.path, config.max_corpus_mb)
        self.tokenizer: Tokenizer | None = None
        self.cache: TokenCache | None = None
        self.train_set: RandomWindows | None = None
        self.val_set: SequentialWindows | None = None
        self.train_resume = TrainDataResume()

    def _tokens(self, prepare: bool) -> np.ndarray:
        self.tokenizer = load_tokenizer(self.config, self.corpus, train_if_missing=prepare)
        if self.corpus.pretokenized:
            return load_pretokenized(self.corpus, self.tokenizer)
        self.cache = build_token_cache(self.corpus, self.tokenizer, self.config.cache_root)
        return self.cache.load()

    def prepare_data(self) -> None:
        self._tokens(prepare=True)

    def setup(self, stage: str) -> None:
        tokens = self._tokens(prepare=False)
        check_token_count(len(tokens), self.config)
        n_train = int(len(tokens) * (1.0 - self.config.val_fraction))
        self.train_set = RandomWindows(tokens[:n_train], self.config.seq_len, self.config.seed)
        self.val_set = SequentialWindows(tokens[n_train:], self.config.seq_len)

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
        )
