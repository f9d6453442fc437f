"""Tokenizers for the recipes: raw bytes (default) or a byte-level BPE trained locally.

`ByteTokenizer` maps each UTF-8 byte to its value: vocabulary 256, no files, nothing to train, and any
text round-trips exactly. `BPETokenizer` wraps a Hugging Face `tokenizers` byte-level BPE model trained
on the run's own corpus; it is saved as a `tokenizer.json` in the cache (keyed by the corpus hash and the
vocabulary size) so a second run reuses it, and copied into the run directory for later sampling.

Every tokenizer has an `identity` string; it is part of the token-cache key, so changing the tokenizer
(or retraining BPE on other text) never reuses stale token ids.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import numpy as np

END_OF_TEXT = "<|endoftext|>"


class Tokenizer(Protocol):
    """What the data pipeline and the sampler need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def identity(self) -> str: ...

    def encode_document(self, data: bytes) -> np.ndarray: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens; documents are separated by a blank line."""

    vocab_size = 256
    identity = "byte-v1"

    def encode_document(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data + b"\n\n", dtype=np.uint8)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class BPETokenizer:
    """A Hugging Face byte-level BPE; documents end with the `<|endoftext|>` token."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.path = Path(path)
        self._tokenizer = HFTokenizer.from_file(str(self.path))
        self._eot = self._tokenizer.token_to_id(END_OF_TEXT)
        self.identity = "bpe-" + hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def encode_document(self, data: bytes) -> np.ndarray:
        ids = self._tokenizer.encode(data.decode("utf-8", errors="replace")).ids
        if self._eot is not None:
            ids.append(self._eot)
        return np.asarray(ids, dtype=np.int64)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)


def train_bpe(documents: Iterable[bytes], vocab_size: int, path: Path) -> BPETokenizer:
    """Train a byte-level BPE with `vocab_size` entries on `documents` and save it atomically to `path`.

    Raises:
        ValueError: if `vocab_size` cannot hold the 256 byte symbols plus the end-of-text token.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"data.bpe_vocab_size must be >= 257 (256 bytes + end-of-text), got {vocab_size}")
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts() -> Iterator[str]:
        for data in documents:
            yield data.decode("utf-8", errors="replace")

    tokenizer.train_from_iterator(texts(), trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tokenizer.save(str(tmp))
    os.replace(tmp, path)
    return BPETokenizer(path)
