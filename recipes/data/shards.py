"""A directory of token shards: its index, the shard writer, and the memory-mapped reader.

Layout (written by `python -m recipes.prepare`, read by `data=tokens data.path=DIR`):

    DIR/index.json              written last: its presence marks a complete directory
    DIR/train-00000.bin ...     token ids of unit 0's training documents, raw little-endian `dtype`
    DIR/val-00000.bin ...       unit 0's validation documents (absent when a unit has none)
    DIR/tokenizer.json|.model|<name>.tiktoken   a copy of the tokenizer (none for `byte`)
    DIR/.plan.json, DIR/.units/ bookkeeping of `prepare` (what was asked; each finished unit)

`index.json` (`FORMAT`): `dtype` (`uint16` when the vocabulary fits in 16 bits, else `uint32`),
`tokenizer` (kind, file, eos_token, identity, vocab_size, eos_id), `max_token_id`, `documents` and
`tokens` per split, `val_fraction`, the inputs' `source` description and fingerprint, and `shards`: one
record per shard file (name, split, unit, tokens, documents, nbytes, sha256, max_token_id), in unit
order. Each document is its tokens followed by the tokenizer's end-of-document id(s).

Invariants: a shard file is written under a temporary name and renamed into place when complete; its
size is `tokens * itemsize`; the index lists shards in unit order, so a split's token stream - the
concatenation of its shards in that order - is the same whatever number of processes prepared it.

Reading: every rank opens `index.json` and, lazily, a `np.memmap` of each shard the first time it
reads from it; start-up costs one `stat` per shard (`check_shard_sizes`), never a read or hash of the
corpus (`verify_shards` hashes everything, for `prepare` and an explicit check). A split is read as one
`TokenStream`: its shards concatenated in index order, sliced through an offset table, so a training
window (`recipes.data.module.TokenWindows`) may span two or more shards and no token is lost at shard
ends. The tokenizer a directory holds is `tokenizer_from_dir`'s. This module imports numpy only (no
torch): preparation workers start fast.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recipes.data.errors import DataError
from recipes.data.tokenizer import Tokenizer, TokenizerSpec, load_tokenizer_spec

FORMAT = "lightning-zero-tokens-v1"
INDEX_NAME = "index.json"
SPLITS = ("train", "val")


class ShardError(DataError):
    """A token directory that cannot be used; the message names the file and how to fix it."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding every id of a `vocab_size` vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def temporary_name(name: str) -> str:
    """`.NAME.tmp<host>-<pid>`: hidden, and distinct for every process on every node of a shared disk."""
    return f".{name}.tmp{socket.gethostname()}-{os.getpid()}"


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON through a temporary file and `os.replace`, so readers see the old or the new file."""
    tmp = path.with_name(temporary_name(path.name))
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


@dataclass(frozen=True)
class ShardRecord:
    """One shard file of one split of one unit."""

    name: str
    split: str
    unit: int
    tokens: int
    documents: int
    nbytes: int
    sha256: str
    max_token_id: int


@dataclass(frozen=True)
class TokenIndex:
    """The contents of `index.json`."""

    dtype: str
    tokenizer: dict[str, Any]
    max_token_id: int
    documents: dict[str, int]
    tokens: dict[str, int]
    val_fraction: float
    source: dict[str, Any]
    shards: tuple[ShardRecord, ...]
    format: str = FORMAT

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer["vocab_size"])

    def split(self, name: str) -> tuple[ShardRecord, ...]:
        return tuple(s for s in self.shards if s.split == name)

    def to_json(self) -> dict[str, Any]:
        payload = dataclasses.asdict(self)
        payload["shards"] = [dataclasses.asdict(s) for s in self.shards]
        return payload

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> TokenIndex:
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in payload.items() if k in fields}
        values["shards"] = tuple(ShardRecord(**s) for s in payload["shards"])
        return cls(**values)


def is_token_dir(path: str | Path | None) -> bool:
    """True when `path` is a directory holding an `index.json` (a prepared token directory)."""
    return path is not None and str(path) != "" and (Path(path).expanduser() / INDEX_NAME).is_file()


def read_index(directory: str | Path) -> TokenIndex:
    """Load `directory/index.json`.

    Raises:
        ShardError: no index (not prepared, or preparation did not finish) or another format.
    """
    path = Path(directory).expanduser() / INDEX_NAME
    if not path.is_file():
        raise ShardError(
            f"{str(directory)!r} has no {INDEX_NAME}: prepare it with `python -m recipes.prepare INPUT... "
            f"--out {directory}` (an unfinished preparation is completed by running it again)"
        )
    payload = json.loads(path.read_text())
    if payload.get("format") != FORMAT:
        raise ShardError(f"{path}: format {payload.get('format')!r} is not {FORMAT!r}; prepare it again")
    return TokenIndex.from_json(payload)


def tokenizer_from_dir(directory: str | Path, index: TokenIndex | None = None) -> Tokenizer:
    """The tokenizer recorded in a prepared directory's index (its file is inside the directory)."""
    index = index if index is not None else read_index(directory)
    info = index.tokenizer
    path = None if info["file"] is None else str(Path(directory).expanduser() / info["file"])
    return load_tokenizer_spec(TokenizerSpec(info["kind"], path, info["eos_token"]))


def check_shard_sizes(directory: str | Path, index: TokenIndex) -> None:
    """Every shard exists with the size its record says (one `stat` each, no reading)."""
    itemsize = np.dtype(index.dtype).itemsize
    for shard in index.shards:
        path = Path(directory).expanduser() / shard.name
        size = path.stat().st_size if path.is_file() else None
        if size != shard.tokens * itemsize:
            found = "is missing" if size is None else f"has {size} bytes, not {shard.tokens * itemsize}"
            raise ShardError(f"shard {path} {found}; run python -m recipes.prepare again to rebuild it")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def shard_is_intact(directory: Path, shard: ShardRecord, verify_sha: bool) -> bool:
    """The shard file exists with its recorded size (and, with `verify_sha`, its sha256)."""
    path = directory / shard.name
    if not path.is_file() or path.stat().st_size != shard.nbytes:
        return False
    return not verify_sha or file_sha256(path) == shard.sha256


def verify_shards(directory: str | Path) -> list[str]:
    """Names of the shards whose size or sha256 differs from the index (reads every shard)."""
    index = read_index(directory)
    return [s.name for s in index.shards if not shard_is_intact(Path(directory), s, verify_sha=True)]


class ShardWriter:
    """Appends token ids to `DIR/.NAME.tmp<host>-<pid>`, hashing as it goes; `commit` renames it to `NAME`."""

    def __init__(self, directory: Path, name: str, split: str, unit: int, dtype: np.dtype) -> None:
        self.directory, self.name, self.split, self.unit, self.dtype = directory, name, split, unit, dtype
        self.tmp = directory / temporary_name(name)
        self._handle = self.tmp.open("wb")
        self._digest = hashlib.sha256()
        self.tokens = self.documents = 0
        self.max_token_id = -1

    def write(self, ids: np.ndarray) -> None:
        """Append one document's ids (already ending with the end-of-document ids)."""
        if len(ids) == 0:
            return
        top = int(ids.max())
        if top > np.iinfo(self.dtype).max:
            raise ShardError(
                f"token id {top} does not fit {self.dtype.name}; the tokenizer's vocab_size is wrong"
            )
        data = ids.astype(self.dtype).tobytes()
        self._handle.write(data)
        self._digest.update(data)
        self.tokens += len(ids)
        self.documents += 1
        self.max_token_id = max(self.max_token_id, top)

    def commit(self) -> ShardRecord | None:
        """Close and rename into place; None (and no file) when nothing was written."""
        self._handle.close()
        if self.tokens == 0:
            self.tmp.unlink()
            return None
        os.replace(self.tmp, self.directory / self.name)
        return ShardRecord(
            name=self.name,
            split=self.split,
            unit=self.unit,
            tokens=self.tokens,
            documents=self.documents,
            nbytes=self.tokens * self.dtype.itemsize,
            sha256=self._digest.hexdigest(),
            max_token_id=self.max_token_id,
        )

    def abort(self) -> None:
        self._handle.close()
        self.tmp.unlink(missing_ok=True)


class TokenStream:
    """One split's shards as one sequence of tokens; each shard is memory-mapped on first access."""

    def __init__(self, directory: str | Path, shards: tuple[ShardRecord, ...], dtype: str) -> None:
        self.directory = Path(directory).expanduser()
        self.names = [s.name for s in shards]
        self.dtype = np.dtype(dtype)
        self.offsets = np.cumsum([0, *(s.tokens for s in shards)], dtype=np.int64)  # (n_shards + 1,)
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers map the shards themselves
        return {**self.__dict__, "_maps": {}}

    def _shard(self, i: int) -> np.memmap:
        if i not in self._maps:
            self._maps[i] = np.memmap(self.directory / self.names[i], dtype=self.dtype, mode="r")
        return self._maps[i]

    def __getitem__(self, key: slice) -> np.ndarray:
        """Tokens `[start, stop)` of the stream (a slice with step 1), copied out of the shards."""
        start, stop, step = key.indices(len(self))
        assert step == 1, "TokenStream supports contiguous slices only"
        parts = []
        shard = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while start < stop:
            base, end = int(self.offsets[shard]), int(self.offsets[shard + 1])
            take = min(stop, end) - start
            parts.append(self._shard(shard)[start - base : start - base + take])
            start += take
            shard += 1
        if not parts:
            return np.empty(0, dtype=self.dtype)
        return np.concatenate(parts) if len(parts) > 1 else np.array(parts[0])
