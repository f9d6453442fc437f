"""Input documents for data preparation, cut into units of work that do not depend on the worker count.

Inputs: local files (text, `.jsonl`/`.ndjson`, `.parquet`, by file name, directory or glob; see
`recipes.data.corpus.expand_path`) or one Hugging Face `datasets` source (`load_dataset(name, config,
data_files=..., split=..., streaming=True)`: local builders such as `json`, `parquet`, `text` work
offline; hub names where the network allows).

What a document is:
* a text file is one document; a text file larger than the unit size is cut at line boundaries into
  pieces of about that size, each one document (so no document has to fit in memory whole);
* a `.jsonl` line and a `.parquet` or `datasets` row is one document: the string in `text_field`
  (`null` values are skipped; a row without the field is an error naming it).

Units: the pieces (a byte range of a text or `.jsonl` file, aligned to lines when read; a row group of
a `.parquet` file; one of the `n_shards` shards of a streaming `datasets` source) are packed, in input
order, into units of at most `unit_nbytes` input bytes. A unit is the grain of parallelism, of the
output shards (one train and one validation shard per unit) and of idempotence. The plan depends only
on the inputs and `unit_nbytes`, never on the number of processes, so the output does not either.
Memory while reading is one document (or one batch of rows), not a unit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from recipes.data.corpus import CorpusError, expand_path, fingerprint_files
from recipes.data.tokenizer import Document

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)


class SourceError(CorpusError):
    """An input that cannot be read as documents; the message names it and what would be valid."""


@dataclass(frozen=True)
class HFSource:
    """A Hugging Face `datasets` source: the arguments of `load_dataset(..., streaming=True)`."""

    name: str
    config: str | None = None
    data_files: tuple[str, ...] = ()
    split: str = "train"

    def load(self) -> object:
        from datasets import load_dataset

        files = list(self.data_files) or None
        return load_dataset(self.name, self.config, data_files=files, split=self.split, streaming=True)


@dataclass(frozen=True)
class Piece:
    """A part of one input: a byte range (text, jsonl), row groups (parquet) or one shard (datasets)."""

    path: str
    fmt: str  # "text" | "jsonl" | "parquet" | "hf"
    start: int
    stop: int
    nbytes: int


Unit = tuple[Piece, ...]


def file_format(path: Path) -> str:
    """ "jsonl", "parquet" or "text", from the file name."""
    if path.suffix in JSONL_SUFFIXES:
        return "jsonl"
    return "parquet" if path.suffix in PARQUET_SUFFIXES else "text"


def resolve_files(inputs: tuple[str, ...]) -> list[Path]:
    """Every file the inputs designate, in input order (each input's matches sorted).

    Raises:
        SourceError: an input matches nothing, or a `.bin` (already tokenized) is among them.
    """
    files: list[Path] = []
    for spec in inputs:
        matches = expand_path(spec)
        if not matches:
            raise SourceError(
                f"input {spec!r}: no file matches; give text files, .jsonl, .parquet, a directory or "
                "a quoted glob such as 'data/**/*.jsonl'"
            )
        bins = [p for p in matches if p.suffix == ".bin"]
        if bins:
            raise SourceError(
                f"input {spec!r}: {bins[0]} is already token ids; give text, .jsonl or .parquet"
            )
        files.extend(matches)
    return files


def _byte_pieces(path: Path, fmt: str, unit_nbytes: int) -> list[Piece]:
    size = path.stat().st_size
    if size == 0:
        return []
    step = max(1, unit_nbytes)
    return [Piece(str(path), fmt, a, min(a + step, size), min(step, size - a)) for a in range(0, size, step)]


def _parquet_pieces(path: Path) -> list[Piece]:
    import pyarrow.parquet as pq

    metadata = pq.ParquetFile(path).metadata
    return [
        Piece(str(path), "parquet", i, i + 1, metadata.row_group(i).total_byte_size)
        for i in range(metadata.num_row_groups)
    ]


def pack_units(pieces: list[Piece], unit_nbytes: int) -> list[Unit]:
    """Consecutive pieces grouped into units of at most `unit_nbytes` (a bigger piece is alone)."""
    units: list[Unit] = []
    current: list[Piece] = []
    for piece in pieces:
        if current and (piece.fmt == "hf" or sum(p.nbytes for p in current) + piece.nbytes > unit_nbytes):
            units.append(tuple(current))
            current = []
        current.append(piece)
    return units + ([tuple(current)] if current else [])


def plan_file_units(files: list[Path], unit_nbytes: int) -> list[Unit]:
    """Units over local files (see the module docstring)."""
    pieces: list[Piece] = []
    for path in files:
        fmt = file_format(path)
        pieces.extend(_parquet_pieces(path) if fmt == "parquet" else _byte_pieces(path, fmt, unit_nbytes))
    return pack_units(pieces, unit_nbytes)


def plan_hf_units(source: HFSource) -> list[Unit]:
    """One unit per shard of the streaming dataset (its data files)."""
    n_shards = int(source.load().n_shards)  # type: ignore[attr-defined]
    return [(Piece(source.name, "hf", i, n_shards, 0),) for i in range(n_shards)]


def _field_error(where: str, text_field: str, row: object) -> SourceError:
    keys = ", ".join(map(repr, row)) if isinstance(row, dict) else type(row).__name__
    return SourceError(
        f"{where}: no text field {text_field!r} (found: {keys}); set text_field / --text-field"
    )


def check_files(files: list[Path], text_field: str) -> None:
    """Before any work: every `.jsonl` file's first record and every `.parquet` schema has `text_field`."""
    for path in files:
        fmt = file_format(path)
        if fmt == "parquet":
            import pyarrow.parquet as pq

            names = pq.ParquetFile(path).schema_arrow.names
            if text_field not in names:
                raise _field_error(str(path), text_field, dict.fromkeys(names))
        elif fmt == "jsonl":
            with path.open("rb") as handle:
                first = next((line for line in handle if line.strip()), None)
            if first is not None:
                row = _json_row(first, str(path))
                if not isinstance(row, dict) or text_field not in row:
                    raise _field_error(f"{path} (first line)", text_field, row)


def check_hf(source: HFSource, text_field: str) -> None:
    """Before any work: the dataset loads and its first row has `text_field`."""
    dataset = source.load()
    row = next(iter(dataset), None)  # type: ignore[call-overload]
    if row is None:
        raise SourceError(f"dataset {source.name!r} split {source.split!r} is empty")
    if text_field not in row:
        raise _field_error(f"dataset {source.name!r}", text_field, row)


def source_fingerprint(files: list[Path], source: HFSource | None) -> str:
    """Stat-based identity of the inputs (a hub dataset is identified by its arguments only)."""
    if source is None:
        return fingerprint_files(files)
    local = [p for spec in source.data_files for p in expand_path(spec)]
    return f"{source.name}|{source.config}|{source.split}|{fingerprint_files(local)}"


def _json_row(line: bytes, where: str) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise SourceError(f"{where}: not a JSON line ({error})") from error


def _aligned_lines(path: str, start: int, stop: int) -> Iterator[bytes]:
    """The lines of `path` that begin at a byte offset in [start, stop)."""
    with open(path, "rb") as handle:
        if start > 0:
            handle.seek(start - 1)
            if handle.read(1) != b"\n":
                handle.readline()  # the rest of a line that the previous piece owns
        position = handle.tell()
        while position < stop:
            line = handle.readline()
            if not line:
                break
            yield line
            position += len(line)


def _rows_text(rows: Iterator[object], text_field: str, where: str) -> Iterator[str]:
    for row in rows:
        if not isinstance(row, dict) or text_field not in row:
            raise _field_error(where, text_field, row)
        text = row[text_field]
        if text is not None and text != "":
            yield str(text)


def read_piece(piece: Piece, text_field: str, hf_source: HFSource | None = None) -> Iterator[Document]:
    """The documents of one piece, in order."""
    if piece.fmt == "text":
        data = b"".join(_aligned_lines(piece.path, piece.start, piece.stop))
        if data:
            yield data
    elif piece.fmt == "jsonl":
        lines = _aligned_lines(piece.path, piece.start, piece.stop)
        rows = (_json_row(line, piece.path) for line in lines if line.strip())
        yield from _rows_text(rows, text_field, piece.path)
    elif piece.fmt == "parquet":
        import pyarrow.parquet as pq

        batches = pq.ParquetFile(piece.path).iter_batches(
            batch_size=1024, row_groups=list(range(piece.start, piece.stop)), columns=[text_field]
        )
        for batch in batches:
            yield from (t for t in batch.column(0).to_pylist() if t)
    elif piece.fmt == "hf":
        assert hf_source is not None, "a datasets piece needs its source"
        shard = hf_source.load().shard(num_shards=piece.stop, index=piece.start)  # type: ignore[attr-defined]
        yield from _rows_text(iter(shard), text_field, f"dataset {hf_source.name!r}")
    else:
        raise SourceError(f"unknown piece format {piece.fmt!r}")
