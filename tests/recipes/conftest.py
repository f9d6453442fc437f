"""Tiny tokenizers built locally (no download): a Hugging Face BPE with `</s>`, a SentencePiece model,
a tiktoken encoding file; and a small multi-document corpus in several formats."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

LINES = [
    f"def function_{i}(value):\n    return value * {i} + len('document number {i}')\n" for i in range(60)
] + ["the quick brown fox jumps over the lazy dog " * 3, "héllo wörld → naïve café"]


@pytest.fixture(scope="session")
def hf_tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE (vocabulary 300), specials `<s>` (added before every text) and `</s>`: Llama style."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(LINES, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="session")
def sp_model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SentencePiece BPE model (vocabulary 120, eos id 2)."""
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(LINES * 3),
        model_writer=model,
        vocab_size=120,
        model_type="bpe",
        minloglevel=2,
    )
    path = tmp_path_factory.mktemp("sp") / "tiny.model"
    path.write_bytes(model.getvalue())
    return path


@pytest.fixture(scope="session")
def tiktoken_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiktoken encoding file: the 256 bytes plus a few merges (the format of `load_tiktoken_bpe`)."""
    tokens = [bytes([i]) for i in range(256)] + [
        b"de",
        b"def",
        b" v",
        b"re",
        b"ret",
        b"return",
        b"  ",
        b"    ",
    ]
    path = tmp_path_factory.mktemp("tiktoken") / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return path


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t, "meta": i}) + "\n" for i, t in enumerate(texts)))
    return path


def write_parquet(path: Path, texts: list[str], field: str = "text", row_group_size: int = 16) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({field: texts, "meta": list(range(len(texts)))}), path, row_group_size=row_group_size
    )
    return path
