"""Where the training text comes from: the embedded default corpus, user files, or a pre-tokenized file.

Three kinds of source, chosen by `data.path` (a directory prepared by `recipes.prepare` is recognised
by its `index.json` before this module is asked, see `recipes.data.sources`):

* `null` (default): the Python standard library's own `.py` files, found through
  `sysconfig.get_paths()["stdlib"]` - always present, no download. Test suites, `site-packages` and
  caches are skipped; the files are ordered by a hash of their relative path (a stable shuffle that
  mixes modules) and taken until `data.max_corpus_mb` is reached, so the subset is deterministic for a
  given Python installation.
* user files: a file, a directory (every regular non-hidden file below it) or a glob (`**` allowed), in
  sorted path order; `recipes.data.preparation.documents` reads them by format (text: one document
  per file; `.jsonl`, `.parquet`: one per row).
* one pre-tokenized `.bin` file of token ids (uint16, or uint32 for vocabularies above 65,536).

A corpus is identified by `fingerprint()`: paths, sizes and modification times, one `stat` per file and
no reading. Relative paths are taken from the directory the command was started in (Hydra does not
change it). Every failure is a `CorpusError` whose message names `data.path` and says what is accepted.
"""

from __future__ import annotations

import glob
import hashlib
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from recipes.data.errors import DataError

_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_GLOB_CHARS = frozenset("*?[")


class CorpusError(DataError):
    """A data source that cannot be used; the message names the setting and what would be valid."""


@dataclass(frozen=True)
class Corpus:
    """Resolved input files; either text documents or exactly one pre-tokenized `.bin`."""

    files: tuple[Path, ...]
    """Text documents in reading order, or the single `.bin` file."""
    pretokenized: bool
    """True when `files` is one `.bin` of token ids."""
    description: str
    """Human-readable origin, for messages."""

    @property
    def nbytes(self) -> int:
        return sum(path.stat().st_size for path in self.files)

    def documents(self) -> Iterator[bytes]:
        """The raw bytes of each text document, in order."""
        for path in self.files:
            yield path.read_bytes()

    def fingerprint(self) -> str:
        """sha256 over each file's resolved path, size and modification time, in order.

        Cheap (one `stat` per file, no reading): an edited, added, removed or reordered file changes it.
        """
        return fingerprint_files(self.files)


def fingerprint_files(files: Iterable[Path]) -> str:
    """sha256 of (resolved path, size, mtime in ns) of `files`, in order."""
    digest = hashlib.sha256()
    for path in files:
        stat = path.stat()
        digest.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def stdlib_corpus(max_corpus_mb: float) -> Corpus:
    """A deterministic subset (about `max_corpus_mb` MB) of the standard library's `.py` files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    candidates = [
        path
        for path in root.rglob("*.py")
        if not _STDLIB_SKIP_DIRS.intersection(path.relative_to(root).parts[:-1]) and path.is_file()
    ]
    candidates.sort(key=lambda path: hashlib.sha1(path.relative_to(root).as_posix().encode()).hexdigest())
    budget = int(max_corpus_mb * 1024 * 1024)
    chosen: list[Path] = []
    total = 0
    for path in candidates:
        if total >= budget:
            break
        chosen.append(path)
        total += path.stat().st_size
    if not chosen:
        raise CorpusError(f"data.path=null: no .py files found in the standard library at {root}")
    return Corpus(
        tuple(chosen), pretokenized=False, description=f"Python stdlib ({root}), {len(chosen)} files"
    )


def expand_path(pattern: str) -> list[Path]:
    """The regular files a file name, directory (recursive, no hidden entries) or glob designates, sorted."""
    path = Path(pattern).expanduser()
    if _GLOB_CHARS.intersection(pattern):
        matches = [Path(p) for p in glob.glob(str(path), recursive=True)]
    elif path.is_dir():
        matches = list(path.rglob("*"))
        matches = [p for p in matches if not any(part.startswith(".") for part in p.relative_to(path).parts)]
    else:
        matches = [path] if path.exists() else []
    return sorted(p for p in matches if p.is_file())


def user_corpus(path_spec: str) -> Corpus:
    """Resolve `data.path` (file, directory or glob) into a text corpus or one `.bin` file.

    Raises:
        CorpusError: nothing matches, the files are all empty, or `.bin` files are mixed with others.
    """
    files = expand_path(path_spec)
    if not files:
        raise CorpusError(
            f"data.path={path_spec!r}: no file matches. Give a text file, a directory of text files, "
            "a glob such as 'data/**/*.txt' (quoted), a pre-tokenized .bin file, or null for the "
            "built-in stdlib corpus."
        )
    bins = [p for p in files if p.suffix == ".bin"]
    if bins and (len(bins) > 1 or len(files) > 1):
        raise CorpusError(
            f"data.path={path_spec!r}: matched {len(files)} files including {len(bins)} .bin; pre-tokenized "
            "input must be exactly one .bin file (text files and .bin cannot be mixed)."
        )
    corpus = Corpus(tuple(files), pretokenized=bool(bins), description=f"{path_spec} ({len(files)} files)")
    if corpus.nbytes == 0:
        raise CorpusError(f"data.path={path_spec!r}: the corpus is empty ({len(files)} files, 0 bytes).")
    return corpus


def resolve_corpus(path_spec: str | None, max_corpus_mb: float) -> Corpus:
    """The corpus that `data.path` designates (None: the stdlib subset)."""
    if path_spec is None or path_spec == "":
        return stdlib_corpus(max_corpus_mb)
    return user_corpus(path_spec)
