"""One unit of data preparation: read its documents, tokenize them, write its train and val shards.

Runs in the `prepare` process or in a worker of its pool (`run_unit` and `UnitTask` are picklable).
A unit's output depends only on the task (never on the worker or the order units finish): document
`j` of unit `i` goes to validation by `is_val_document(j, i, f)`, every other document to training,
in reading order. A unit is reused when its manifest `.units/NNNNN.json` has the same key and its
shards are intact; otherwise its shards are rewritten (temporary name, then rename) and the manifest
is written last. Memory: one batch of documents (`BATCH_NBYTES` of text) and its token ids.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recipes.data.preparation.documents import HFSource, Unit, read_piece
from recipes.data.shards import ShardRecord, ShardWriter, shard_is_intact, write_json_atomic
from recipes.data.tokenizer import Document, Tokenizer, TokenizerSpec, load_tokenizer_spec

BATCH_NBYTES = 1 << 20
"""Documents are tokenized in batches of about this much text (the tokenizers parallelize a batch)."""


@dataclass(frozen=True)
class UnitTask:
    """Everything a worker needs to produce one unit's shards."""

    index: int
    pieces: Unit
    out: str
    tokenizer: TokenizerSpec
    dtype: str
    val_fraction: float
    text_field: str
    hf_source: HFSource | None
    verify: bool
    key: str


@dataclass(frozen=True)
class UnitResult:
    index: int
    shards: tuple[ShardRecord, ...]
    documents: dict[str, int]
    nbytes: int
    reused: bool


def is_val_document(document: int, unit: int, fraction: float) -> bool:
    """Whether document `document` of unit `unit` is held out (independent of the worker count).

    Every `1/fraction`-th document of a unit, from a phase in [0, 1) hashed from the unit index, so
    that the expected fraction is exact; unit 0's phase makes its first document a validation one,
    so any corpus with `fraction > 0` has a validation split.
    """
    if unit == 0:
        phase = 1.0 - fraction
    else:
        phase = int.from_bytes(hashlib.sha256(f"val-phase-{unit}".encode()).digest()[:8], "little") / 2**64
    return math.floor((document + 1) * fraction + phase) > math.floor(document * fraction + phase)


_TOKENIZERS: dict[TokenizerSpec, Tokenizer] = {}


def _tokenizer(spec: TokenizerSpec) -> Tokenizer:
    if spec not in _TOKENIZERS:  # one load per process, not per unit
        _TOKENIZERS[spec] = load_tokenizer_spec(spec)
    return _TOKENIZERS[spec]


def _batches(documents: Iterator[Document]) -> Iterator[list[Document]]:
    batch: list[Document] = []
    nbytes = 0
    for document in documents:
        batch.append(document)
        nbytes += len(document)
        if nbytes >= BATCH_NBYTES:
            yield batch
            batch, nbytes = [], 0
    if batch:
        yield batch


def manifest_path(task: UnitTask) -> Path:
    return Path(task.out) / ".units" / f"{task.index:05d}.json"


def reusable_result(task: UnitTask) -> UnitResult | None:
    """The unit's recorded result if its manifest matches the task and its shards are intact."""
    manifest = manifest_path(task)
    if not manifest.is_file():
        return None
    record = json.loads(manifest.read_text())
    shards = tuple(ShardRecord(**s) for s in record["shards"])
    out = Path(task.out)
    if record.get("key") != task.key or not all(shard_is_intact(out, s, task.verify) for s in shards):
        return None
    return UnitResult(task.index, shards, record["documents"], sum(p.nbytes for p in task.pieces), True)


def run_unit(task: UnitTask) -> UnitResult:
    """Tokenize one unit into `train-NNNNN.bin` / `val-NNNNN.bin`; any process."""
    out = Path(task.out)
    manifest = manifest_path(task)
    tokenizer = _tokenizer(task.tokenizer)
    dtype = np.dtype(task.dtype)
    writers = {
        s: ShardWriter(out, f"{s}-{task.index:05d}.bin", s, task.index, dtype) for s in ("train", "val")
    }
    counter = 0
    try:
        documents = (d for piece in task.pieces for d in read_piece(piece, task.text_field, task.hf_source))
        for batch in _batches(documents):
            for ids in tokenizer.encode_documents(batch):
                split = "val" if is_val_document(counter, task.index, task.val_fraction) else "train"
                writers[split].write(ids)
                counter += 1
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    documents_per_split = {s: w.documents for s, w in writers.items()}
    shards = tuple(r for r in (w.commit() for w in writers.values()) if r is not None)
    manifest.parent.mkdir(exist_ok=True)
    write_json_atomic(
        manifest,
        {
            "key": task.key,
            "shards": [dataclasses.asdict(s) for s in shards],
            "documents": documents_per_split,
        },
    )
    return UnitResult(task.index, shards, documents_per_split, sum(p.nbytes for p in task.pieces), False)


def limit_threads() -> None:
    os.environ["RAYON_NUM_THREADS"] = "1"  # one core per worker: the pool is the parallelism
