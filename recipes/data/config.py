"""The `data` settings of the recipe (`DataConfig`, the target of `conf/data/*.yaml`) and the one size
check every source shares (`check_token_count`).

Settings only: which kind of source `data.path` designates, and everything that reads the file
system, is `recipes.data.sources`'s business. Imports no torch (see `recipes.data`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from recipes.data.corpus import CorpusError
from recipes.data.tokenizer import MIN_BPE_VOCAB_SIZE


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
        if self.tokenizer == "bpe" and self.bpe_vocab_size < MIN_BPE_VOCAB_SIZE:  # else: in prepare_data
            raise ValueError(
                f"data.bpe_vocab_size must be >= {MIN_BPE_VOCAB_SIZE} (256 bytes + end-of-text), "
                f"got {self.bpe_vocab_size}"
            )

    @property
    def vocab_size(self) -> int | None:
        """Vocabulary size known without reading a file (byte, bpe); None otherwise."""
        return {"byte": 256, "bpe": self.bpe_vocab_size}.get(self.tokenizer or "")

    @property
    def cache_root(self) -> Path:
        return Path(self.cache_dir).expanduser()


def check_token_count(n_train: int, n_val: int, config: DataConfig) -> None:
    """Raise `CorpusError` unless both splits hold at least one full window of `seq_len + 1` tokens."""
    needed = config.seq_len + 1
    if n_train < needed or n_val < needed:
        raise CorpusError(
            f"data.path={config.path!r}: {n_train} training and {n_val} validation tokens, too few for "
            f"data.seq_len={config.seq_len} (each split needs {needed}); add text, raise "
            "data.val_fraction (validation is chosen by documents) or lower data.seq_len."
        )
