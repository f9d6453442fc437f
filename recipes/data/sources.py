"""Where the recipe's tokens come from: one `DataSource` class per kind of `data.path`, chosen in one place.

Kinds (`SOURCES`, asked in this order by `data_source`; the first whose `matches(config)` holds serves):

* `PreparedTokens` - a directory written by `python -m recipes.prepare` (it holds an `index.json`;
  `data=tokens`): read as it is; its tokenizer, vocabulary and validation split are the ones recorded
  in its index (`data.tokenizer` must be null);
* `BinTokens` - one `.bin` file of token ids (`data=pretokenized`): memory-mapped as it is, with the
  dtype its tokenizer's vocabulary implies; the last `data.val_fraction` of its tokens validate (kept
  for existing files; `recipes.prepare` is the path for new data);
* `TextTokens` - anything else: `null` (the embedded stdlib corpus, `data=stdlib`) or text / `.jsonl` /
  `.parquet` files, a directory or a glob (`data=text`): prepared on first use - by `prepare()`, which
  the data module calls on local rank 0 of each node - into `<cache_dir>/tokens/<key>/` with the same
  code as `recipes.prepare` (one process), then read like a prepared directory. The key hashes the
  files' paths, sizes and modification times (never their contents), the tokenizer and the split
  settings, so a second run reuses the shards after a `stat` per file and per shard; an edited file
  makes a new entry. `data.tokenizer=bpe` trains a BPE on the corpus into that directory.

What every source answers (`DataSource`): before any process starts (`recipes.config.validation`) and
when a checkpoint is checked against data (`recipes.evaluate`), `vocab_size()` (the tokenizer's, known
without tokenizing), `max_token_id(vocab_size)` (the largest id the run will read; -1 when the ids come
from the tokenizer itself), `check(vocab_size)` (files and sizes as far as they are known without
tokenizing: each split must hold a window) and `declared_tokenizer()`; when a rank reads
(`recipes.data.module`), `prepare()` (the work to do once per node), then `tokenizer()` and
`open(split)`: the token stream of "train" or "val", cut into windows by the data module. Every failure
is a `DataError` (or one of its subclasses) naming the setting. A new kind of source is one class here
and its place in `SOURCES`. Imports numpy only (see `recipes.data`).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from recipes.data.config import DataConfig, check_token_count
from recipes.data.corpus import Corpus, CorpusError, resolve_corpus
from recipes.data.errors import DataError
from recipes.data.preparation.documents import check_files, file_format, source_fingerprint
from recipes.data.preparation.pipeline import PrepareSummary, prepare
from recipes.data.preparation.plan import PrepareConfig, plan_key, plan_record
from recipes.data.shards import (
    TokenIndex,
    TokenStream,
    check_shard_sizes,
    is_token_dir,
    read_index,
    token_dtype,
    tokenizer_from_dir,
)
from recipes.data.tokenizer import Tokenizer, load_tokenizer_spec, resolve_tokenizer

Tokens = TokenStream | np.ndarray
"""One split's token ids, in order: the shards of a token directory, or a slice of a `.bin`."""


class DataSource(ABC):
    """One kind of `data.path` (see the module docstring): what it holds, its checks, its splits."""

    def __init__(self, config: DataConfig) -> None:
        self.config = config

    @classmethod
    @abstractmethod
    def matches(cls, config: DataConfig) -> bool:
        """Whether `config.path` is this kind of source (a `stat` or two, no reading)."""

    @abstractmethod
    def vocab_size(self) -> int:
        """The vocabulary of the tokenizer the data is (or will be) tokenized with, without tokenizing.

        Raises:
            DataError: the tokenizer setting does not fit this source; `TokenizerError`: a bad file.
        """

    @abstractmethod
    def max_token_id(self, vocab_size: int) -> int:
        """Largest token id the run will read (-1: the ids come from the tokenizer itself).

        `vocab_size` is the tokenizer's: it sets the dtype of a `.bin`.
        """

    @abstractmethod
    def check(self, vocab_size: int) -> None:
        """Files and sizes, as far as they are known without tokenizing (each split must hold a window).

        Raises:
            DataError: naming `data.path` and what would be valid.
        """

    @abstractmethod
    def tokenizer(self) -> Tokenizer:
        """The tokenizer of the tokens `open` reads (after `prepare`)."""

    @abstractmethod
    def open(self, split: str) -> Tokens:
        """The tokens of split "train" or "val" (after `prepare`), mapped lazily."""

    @property
    def corpus(self) -> Corpus | None:
        """The text to tokenize before reading; None when the data already is tokens."""
        return None

    @property
    def directory(self) -> Path | None:
        """The token directory `open` reads (a text source's once opened); None for a `.bin`."""
        return None

    def declared_tokenizer(self) -> Tokenizer | None:
        """The tokenizer when it is known without preparing anything (not a BPE still to be trained)."""
        if self.config.tokenizer in (None, "bpe"):
            return None
        return load_tokenizer_spec(resolve_tokenizer(self.config.tokenizer, self.config.eos_token))

    def prepare(self) -> PrepareSummary | None:
        """Work to do once per node before any rank reads (local rank 0); None: nothing to do."""
        return None


def named_tokenizer_vocab_size(config: DataConfig) -> int:
    """The vocabulary of `data.tokenizer` for sources that need one named (a `.bin`, text)."""
    if config.tokenizer is None:
        raise DataError(
            f"data.tokenizer=null needs data.path to be a directory written by `python -m recipes.prepare` "
            f"(one with index.json); data.path={config.path!r} is not. Prepare it first, or name a tokenizer."
        )
    if config.vocab_size is not None:
        return config.vocab_size
    return load_tokenizer_spec(resolve_tokenizer(config.tokenizer, config.eos_token)).vocab_size


class PreparedTokens(DataSource):
    """A directory of token shards written by `recipes.prepare` (or a text source's cache entry)."""

    def __init__(self, config: DataConfig, directory: Path | None = None) -> None:
        super().__init__(config)
        self._directory = Path(config.path) if directory is None else directory  # type: ignore[arg-type]

    @classmethod
    def matches(cls, config: DataConfig) -> bool:
        return is_token_dir(config.path)

    @property
    def directory(self) -> Path:
        return self._directory

    @functools.cached_property
    def index(self) -> TokenIndex:
        """Its `index.json` (read once)."""
        return read_index(self._directory)

    @functools.cached_property
    def _intact_index(self) -> TokenIndex:
        """The index, once every shard has been found with its recorded size (one `stat` each)."""
        check_shard_sizes(self._directory, self.index)
        return self.index

    def vocab_size(self) -> int:
        if self.config.tokenizer is not None:
            raise DataError(
                f"data.path={self.config.path!r} is a prepared token directory: use data=tokens "
                "(data.tokenizer=null); its tokenizer is the one recorded in its index.json"
            )
        return self.index.vocab_size

    def max_token_id(self, vocab_size: int) -> int:
        return self.index.max_token_id  # recorded at preparation: no pass over the shards

    def check(self, vocab_size: int) -> None:
        index = self._intact_index
        check_token_count(index.tokens["train"], index.tokens["val"], self.config)

    def declared_tokenizer(self) -> Tokenizer:
        return tokenizer_from_dir(self._directory, self.index)

    def tokenizer(self) -> Tokenizer:
        return tokenizer_from_dir(self._directory, self._intact_index)

    def open(self, split: str) -> TokenStream:
        index = self._intact_index
        return TokenStream(self._directory, index.split(split), index.dtype)


class BinTokens(DataSource):
    """One `.bin` of token ids, memory-mapped; its last `val_fraction` of tokens validate."""

    def __init__(self, config: DataConfig) -> None:
        super().__init__(config)
        self.path = Path(config.path)  # type: ignore[arg-type]  # a file: `matches` checked it

    @classmethod
    def matches(cls, config: DataConfig) -> bool:
        return config.path is not None and Path(config.path).suffix == ".bin" and Path(config.path).is_file()

    def vocab_size(self) -> int:
        if self.config.tokenizer == "bpe":
            raise DataError(
                f"data.path={self.config.path!r} is pre-tokenized: data.tokenizer=bpe would train a new BPE; "
                "give the tokenizer that made it (byte or its tokenizer.json / .model / .tiktoken file)"
            )
        return named_tokenizer_vocab_size(self.config)

    def _tokens(self, vocab_size: int) -> np.ndarray:
        """The whole file, mapped with the dtype the vocabulary implies."""
        dtype = token_dtype(vocab_size)
        if self.path.stat().st_size % dtype.itemsize != 0:
            raise CorpusError(
                f"data.path={self.config.path!r}: size is not a multiple of {dtype.itemsize} ({dtype.name})"
            )
        return np.memmap(self.path, dtype=dtype, mode="r")

    def _splits(self, tokens: np.ndarray) -> dict[str, np.ndarray]:
        n_train = int(len(tokens) * (1.0 - self.config.val_fraction))
        return {"train": tokens[:n_train], "val": tokens[n_train:]}

    def max_token_id(self, vocab_size: int) -> int:
        tokens = self._tokens(vocab_size)  # its only record is itself: one pass, in chunks
        step = 1 << 24
        return max((int(tokens[i : i + step].max()) for i in range(0, len(tokens), step)), default=-1)

    def check(self, vocab_size: int) -> None:
        splits = self._splits(self._tokens(vocab_size))
        check_token_count(len(splits["train"]), len(splits["val"]), self.config)

    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @functools.cached_property
    def _tokenizer(self) -> Tokenizer:
        return load_tokenizer_spec(resolve_tokenizer(self.config.tokenizer or "byte"))

    def open(self, split: str) -> np.ndarray:
        return self._splits(self._tokens(self.tokenizer().vocab_size))[split]


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


class TextTokens(DataSource):
    """Text documents, tokenized once per node into the cache, then read as a prepared directory."""

    def __init__(self, config: DataConfig) -> None:
        super().__init__(config)
        self._prepared: PreparedTokens | None = None

    @classmethod
    def matches(cls, config: DataConfig) -> bool:
        return True  # the last kind asked: whatever else `data.path` names is text to tokenize

    @functools.cached_property
    def corpus(self) -> Corpus:  # type: ignore[override]  # resolved once (the stdlib subset is a walk)
        return resolve_corpus(self.config.path, self.config.max_corpus_mb)

    @property
    def directory(self) -> Path | None:
        return None if self._prepared is None else self._prepared.directory

    def vocab_size(self) -> int:
        return named_tokenizer_vocab_size(self.config)

    def max_token_id(self, vocab_size: int) -> int:
        return -1  # the ids come from the tokenizer itself

    def check(self, vocab_size: int) -> None:
        corpus = self.corpus
        check_files(list(corpus.files), self.config.text_field)
        if self.config.tokenizer == "byte" and all(file_format(p) == "text" for p in corpus.files):
            n_tokens = corpus.nbytes + 2 * len(corpus.files)
            n_train = int(n_tokens * (1.0 - self.config.val_fraction))  # about: validation is by documents
            check_token_count(n_train, n_tokens - n_train, self.config)

    def prepare(self) -> PrepareSummary:
        return prepare(prepare_config(self.config, self.corpus))

    def _tokens(self) -> PreparedTokens:
        """The cache entry of this corpus (prepared by `prepare`, on this node's local rank 0)."""
        if self._prepared is None:
            out = Path(prepare_config(self.config, self.corpus).out)
            self._prepared = PreparedTokens(self.config, directory=out)
        return self._prepared

    def tokenizer(self) -> Tokenizer:
        return self._tokens().tokenizer()

    def open(self, split: str) -> TokenStream:
        return self._tokens().open(split)


SOURCES: tuple[type[DataSource], ...] = (PreparedTokens, BinTokens, TextTokens)
"""The kinds of source, in the order `data_source` asks them (the last one takes whatever is left)."""


def data_source(config: DataConfig) -> DataSource:
    """The source `config.path` designates: the first of `SOURCES` that matches it."""
    kind = next(kind for kind in SOURCES if kind.matches(config))
    return kind(config)
