"""Tokenizers for the recipes: raw bytes, a locally trained BPE, or one the user brings.

Kinds (`TokenizerSpec.kind`), chosen from what the user names (`resolve_tokenizer`):

* `byte` - each UTF-8 byte is its own id: vocabulary 256, no files, any text round-trips. Documents
  end with a blank line (`\\n\\n`), not a special token (there is no id left for one).
* `hf` - any Hugging Face `tokenizer.json` (the `tokenizers` library), including the byte-level BPE
  that `train_bpe` trains on the run's own corpus. Text is encoded without the tokenizer's own
  special tokens (no BOS), then the end-of-document id is appended.
* `sentencepiece` - a SentencePiece `.model` file; its `eos_id()` ends documents.
* `tiktoken` - a local tiktoken encoding file (`*.tiktoken`, the format of `load_tiktoken_bpe`; the
  encodings cannot be downloaded here). A file named after an OpenAI encoding (`cl100k_base.tiktoken`,
  `o200k_base.tiktoken`, ...) gets that encoding's split pattern and special tokens, and must have its
  published sha256; any other file gets cl100k's pattern and one special token, `<|endoftext|>`, at
  the id after the last rank.

End of document: an explicit `eos_token` wins; otherwise the tokenizer's own (Hugging Face: the
`eos_token` of a `tokenizer_config.json` beside the file, else the first of `EOS_CANDIDATES` in the
vocabulary; SentencePiece: `eos_id()`; tiktoken: `<|endoftext|>`). None found is an error naming the
file and the option to set - never a silent run without separators.

Every tokenizer has an `identity` (kind, sha256 of its file, end-of-document id): prepared shards
record it, so tokens made by one tokenizer are never mixed with or reused for another.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from recipes.data.errors import DataError

END_OF_TEXT = "<|endoftext|>"
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|end|>")
"""End-of-document tokens looked up, in order, in a Hugging Face vocabulary without a config."""
TOKENIZER_KINDS = ("byte", "hf", "sentencepiece", "tiktoken")
_SUFFIX_KIND = {".json": "hf", ".model": "sentencepiece", ".tiktoken": "tiktoken"}
_DIR_FILES = ("tokenizer.json", "tokenizer.model")

Document = str | bytes


MIN_BPE_VOCAB_SIZE = 257
"""A byte-level BPE holds the 256 bytes and the end-of-text token (`train_bpe`)."""


class TokenizerError(DataError):
    """A tokenizer that cannot be used; the message names the file or setting and what is valid."""


class Tokenizer(Protocol):
    """What data preparation, the data module and the sampler need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def identity(self) -> str: ...

    @property
    def eos_id(self) -> int | None: ...

    def encode_documents(self, documents: Sequence[Document]) -> list[np.ndarray]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`; ids outside `0 .. vocab_size - 1` are left out. A model's vocabulary may be
        larger than its tokenizer's (`model.vocab_size` only has to cover it), so a sample can hold
        ids no token has."""
        ...


@dataclass(frozen=True)
class TokenizerSpec:
    """How to load a tokenizer: picklable, so worker processes rebuild the same one."""

    kind: str
    """One of `TOKENIZER_KINDS`."""
    path: str | None = None
    """Its file (None for `byte`)."""
    eos_token: str | None = None
    """End-of-document token overriding the tokenizer's own."""


def _text(document: Document) -> str:
    return document.decode("utf-8", errors="replace") if isinstance(document, bytes) else document


def _sha16(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _append_eos(batches: Iterable[list[int]], eos_id: int) -> list[np.ndarray]:
    return [np.asarray([*ids, eos_id], dtype=np.int64) for ids in batches]


class ByteTokenizer:
    """UTF-8 bytes as tokens; documents are separated by a blank line."""

    vocab_size = 256
    identity = "byte-v1"
    eos_id = None

    def encode_documents(self, documents: Sequence[Document]) -> list[np.ndarray]:
        return [
            np.frombuffer(d if isinstance(d, bytes) else d.encode("utf-8"), dtype=np.uint8)
            for d in (d + (b"\n\n" if isinstance(d, bytes) else "\n\n") for d in documents)
        ]

    def encode_document(self, data: bytes) -> np.ndarray:
        return self.encode_documents([data])[0]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def _config_eos(path: Path) -> str | None:
    """`eos_token` of a `tokenizer_config.json` next to a `tokenizer.json`, if there is one."""
    config = path.parent / "tokenizer_config.json"
    if not config.is_file():
        return None
    eos = json.loads(config.read_text()).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


class HFTokenizer:
    """A Hugging Face `tokenizer.json`; documents end with its end-of-document token."""

    def __init__(self, path: str | Path, eos_token: str | None = None) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self.path = Path(path)
        try:
            self._tokenizer = RustTokenizer.from_file(str(self.path))
        except Exception as error:  # the Rust side raises a bare Exception
            raise TokenizerError(
                f"tokenizer {str(self.path)!r} is not a Hugging Face tokenizer.json: {error}"
            ) from error
        self.eos_token = eos_token or _config_eos(self.path)
        if self.eos_token is None:
            self.eos_token = next(
                (t for t in EOS_CANDIDATES if self._tokenizer.token_to_id(t) is not None), None
            )
        self.eos_id = None if self.eos_token is None else self._tokenizer.token_to_id(self.eos_token)
        _check_eos(self.path, eos_token, self.eos_token, self.eos_id, looked_for=EOS_CANDIDATES)
        self.identity = f"hf-{_sha16(self.path)}-eos{self.eos_id}"

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode_documents(self, documents: Sequence[Document]) -> list[np.ndarray]:
        encodings = self._tokenizer.encode_batch([_text(d) for d in documents], add_special_tokens=False)
        return _append_eos((e.ids for e in encodings), self.eos_id)  # type: ignore[arg-type]

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode([i for i in ids if 0 <= i < self.vocab_size])


BPETokenizer = HFTokenizer
"""The locally trained BPE is a Hugging Face tokenizer (name kept for older imports)."""


class SentencePieceTokenizer:
    """A SentencePiece `.model`; documents end with `eos_id()` (or the given `eos_token`)."""

    def __init__(self, path: str | Path, eos_token: str | None = None) -> None:
        import sentencepiece

        self.path = Path(path)
        self._model = sentencepiece.SentencePieceProcessor()
        try:
            self._model.Load(str(self.path))
        except (OSError, RuntimeError) as error:
            raise TokenizerError(
                f"tokenizer {str(self.path)!r} is not a SentencePiece model: {error}"
            ) from error
        if eos_token is not None:
            found = self._model.piece_to_id(eos_token)
            self.eos_id: int | None = None if found == self._model.unk_id() else found
        else:
            self.eos_id = self._model.eos_id() if self._model.eos_id() >= 0 else None
        _check_eos(self.path, eos_token, eos_token or "eos_id()", self.eos_id, looked_for=("eos_id()",))
        self.identity = f"sentencepiece-{_sha16(self.path)}-eos{self.eos_id}"

    @property
    def vocab_size(self) -> int:
        return self._model.get_piece_size()

    def encode_documents(self, documents: Sequence[Document]) -> list[np.ndarray]:
        return _append_eos(self._model.encode([_text(d) for d in documents]), self.eos_id)  # type: ignore[arg-type]

    def encode(self, text: str) -> list[int]:
        return self._model.encode(text)

    def decode(self, ids: list[int]) -> str:
        size = self._model.get_piece_size()  # SentencePiece raises IndexError on any id past its pieces
        return self._model.decode([i for i in ids if 0 <= i < size])


def _tiktoken_params(path: Path) -> dict:
    """Constructor arguments of `tiktoken.Encoding` for a local encoding file."""
    import tiktoken_ext.openai_public as openai_public
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(path))
    constructor = openai_public.ENCODING_CONSTRUCTORS.get(path.stem)
    if constructor is None:  # an unknown encoding: cl100k's split pattern, one special token
        params = _tiktoken_named(openai_public, openai_public.cl100k_base, {})
        return {
            "name": path.stem,
            "pat_str": params["pat_str"],
            "mergeable_ranks": ranks,
            "special_tokens": {END_OF_TEXT: len(ranks)},
        }
    return _tiktoken_named(openai_public, constructor, ranks, path)


def _tiktoken_named(module: object, constructor: object, ranks: dict, path: Path | None = None) -> dict:
    """Run an OpenAI encoding constructor with its download replaced by the local ranks."""
    wanted: list[str | None] = []

    def local(_url: str, expected_hash: str | None = None) -> dict:
        wanted.append(expected_hash)
        return ranks

    original = module.load_tiktoken_bpe  # type: ignore[attr-defined]
    module.load_tiktoken_bpe = local  # type: ignore[attr-defined]
    try:
        params = constructor()  # type: ignore[operator]
    finally:
        module.load_tiktoken_bpe = original  # type: ignore[attr-defined]
    if (
        path is not None
        and wanted
        and wanted[0]
        and hashlib.sha256(path.read_bytes()).hexdigest() != wanted[0]
    ):
        raise TokenizerError(
            f"tokenizer {str(path)!r} is named like the {path.stem} encoding but its sha256 differs from the "
            "published file; rename it to use it as a custom encoding"
        )
    return params


class TiktokenTokenizer:
    """A tiktoken encoding read from a local file; documents end with `<|endoftext|>`."""

    def __init__(self, path: str | Path, eos_token: str | None = None) -> None:
        import tiktoken

        self.path = Path(path)
        try:
            self._encoding = tiktoken.Encoding(**_tiktoken_params(self.path))
        except (ValueError, OSError) as error:
            if isinstance(error, TokenizerError):
                raise
            raise TokenizerError(
                f"tokenizer {str(self.path)!r} is not a tiktoken encoding file: {error}"
            ) from error
        name = eos_token or END_OF_TEXT
        self.eos_id = self._encoding._special_tokens.get(name)
        _check_eos(self.path, eos_token, name, self.eos_id, looked_for=(END_OF_TEXT,))
        self.identity = f"tiktoken-{_sha16(self.path)}-eos{self.eos_id}"

    @property
    def vocab_size(self) -> int:
        return self._encoding.n_vocab

    def encode_documents(self, documents: Sequence[Document]) -> list[np.ndarray]:
        return _append_eos(self._encoding.encode_ordinary_batch([_text(d) for d in documents]), self.eos_id)  # type: ignore[arg-type]

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self._encoding.decode([i for i in ids if 0 <= i < self._encoding.n_vocab])


def _check_eos(
    path: Path, given: str | None, name: str | None, eos_id: int | None, looked_for: tuple
) -> None:
    if eos_id is not None:
        return
    if given is not None:
        raise TokenizerError(f"eos_token={given!r} is not in the vocabulary of tokenizer {str(path)!r}")
    raise TokenizerError(
        f"tokenizer {str(path)!r} has no end-of-document token (looked for {', '.join(looked_for)}); "
        "name one with data.eos_token=... (python -m recipes.prepare: --eos-token ...)"
    )


def resolve_tokenizer(name: str, eos_token: str | None = None) -> TokenizerSpec:
    """The spec for `name`: "byte", a tokenizer file, or a directory holding `tokenizer.json`/`.model`.

    Raises:
        TokenizerError: the file does not exist or its type is not one of the known ones.
    """
    if name == "byte":
        return TokenizerSpec("byte", None, None)
    path = Path(name).expanduser()
    if path.is_dir():
        found = [path / f for f in _DIR_FILES if (path / f).is_file()] + sorted(path.glob("*.tiktoken"))
        if not found:
            raise TokenizerError(
                f"tokenizer={name!r}: the directory holds none of {', '.join(_DIR_FILES)}, *.tiktoken"
            )
        path = found[0]
    kind = _SUFFIX_KIND.get(path.suffix)
    if not path.is_file() or kind is None:
        problem = "does not exist" if not path.is_file() else f"has an unknown type {path.suffix!r}"
        raise TokenizerError(
            f"tokenizer={name!r} {problem}; give 'byte', 'bpe' (trained on the corpus), a Hugging Face "
            "tokenizer.json, a SentencePiece .model, a tiktoken .tiktoken file, or a directory holding one"
        )
    return TokenizerSpec(kind, str(path.resolve()), eos_token)


def load_tokenizer_spec(spec: TokenizerSpec) -> Tokenizer:
    """Build the tokenizer `spec` describes (any process)."""
    if spec.kind == "byte":
        return ByteTokenizer()
    classes = {"hf": HFTokenizer, "sentencepiece": SentencePieceTokenizer, "tiktoken": TiktokenTokenizer}
    if spec.kind not in classes or spec.path is None:
        raise TokenizerError(f"unknown tokenizer kind {spec.kind!r}; valid: {', '.join(TOKENIZER_KINDS)}")
    return classes[spec.kind](spec.path, spec.eos_token)


def train_bpe(documents: Iterable[Document], vocab_size: int, path: Path) -> HFTokenizer:
    """Train a byte-level BPE with `vocab_size` entries on `documents` and save it atomically to `path`.

    Raises:
        ValueError: if `vocab_size` cannot hold the 256 byte symbols plus the end-of-text token.
    """
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_BPE_VOCAB_SIZE:
        raise ValueError(
            f"data.bpe_vocab_size must be >= {MIN_BPE_VOCAB_SIZE} (256 bytes + end-of-text), got {vocab_size}"
        )
    tokenizer = RustTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts() -> Iterator[str]:
        for document in documents:
            yield _text(document)

    tokenizer.train_from_iterator(texts(), trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tokenizer.save(str(tmp))
    os.replace(tmp, path)
    return HFTokenizer(path)
