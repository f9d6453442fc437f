"""Tokenizers users bring: Hugging Face tokenizer.json, SentencePiece, tiktoken files; the
end-of-document token comes from the tokenizer, and a missing one is an error, never silence."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from recipes.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    TokenizerError,
    load_tokenizer_spec,
    resolve_tokenizer,
)

TEXT = "def function_3(value):\n    return value"


def test_byte_tokenizer_round_trips_utf8_and_ends_documents_with_a_blank_line() -> None:
    tokenizer = ByteTokenizer()
    text = "héllo → wörld"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert [ids.tolist() for ids in tokenizer.encode_documents([b"ab", "c"])] == [
        [97, 98, 10, 10],
        [99, 10, 10],
    ]


def test_hf_tokenizer_finds_a_llama_style_end_of_document_token(hf_tokenizer_file: Path) -> None:
    tokenizer = load_tokenizer_spec(resolve_tokenizer(str(hf_tokenizer_file)))
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.eos_token == "</s>"
    (ids,) = tokenizer.encode_documents([TEXT])
    assert ids[-1] == tokenizer.eos_id == 1 and tokenizer.decode(ids[:-1].tolist()) == TEXT
    assert 0 not in ids  # no <s>: documents are encoded without the tokenizer's own specials


def test_hf_tokenizer_config_and_explicit_eos_token_win(hf_tokenizer_file: Path, tmp_path: Path) -> None:
    shutil.copy(hf_tokenizer_file, tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<s>"}}))
    assert load_tokenizer_spec(resolve_tokenizer(str(tmp_path))).eos_id == 0  # a directory works too
    explicit = load_tokenizer_spec(resolve_tokenizer(str(hf_tokenizer_file), eos_token="<s>"))
    assert explicit.eos_id == 0 and explicit.identity != HFTokenizer(hf_tokenizer_file).identity
    with pytest.raises(TokenizerError, match="eos_token='<nope>' is not in the vocabulary"):
        HFTokenizer(hf_tokenizer_file, eos_token="<nope>")


def test_tokenizer_without_end_of_document_token_is_refused(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bare = Tokenizer(models.BPE())
    bare.pre_tokenizer = pre_tokenizers.ByteLevel()
    bare.train_from_iterator(["a b c"], trainers.BpeTrainer(vocab_size=280, show_progress=False))
    bare.save(str(tmp_path / "bare.json"))
    with pytest.raises(TokenizerError, match=r"no end-of-document token .*data.eos_token=.*--eos-token"):
        HFTokenizer(tmp_path / "bare.json")


def test_sentencepiece_model_ends_documents_with_eos_id(sp_model_file: Path) -> None:
    tokenizer = load_tokenizer_spec(resolve_tokenizer(str(sp_model_file)))
    assert isinstance(tokenizer, SentencePieceTokenizer) and tokenizer.vocab_size == 120
    text = "def function_3(value): return value"  # SentencePiece folds newlines into spaces
    (ids,) = tokenizer.encode_documents([text])
    assert ids[-1] == tokenizer.eos_id == 2 and tokenizer.decode(ids[:-1].tolist()) == text


def test_tiktoken_file_read_locally(tiktoken_file: Path) -> None:
    tokenizer = load_tokenizer_spec(resolve_tokenizer(str(tiktoken_file)))
    assert isinstance(tokenizer, TiktokenTokenizer)
    assert tokenizer.eos_id == 264 and tokenizer.vocab_size == 265  # <|endoftext|> after the 264 ranks
    (ids,) = tokenizer.encode_documents(["def f():\n    return 1 <|endoftext|>"])
    assert ids[-1] == 264 and 264 not in ids[:-1]  # special text in a document is plain text
    assert 257 in ids and 260 in ids  # the merges "def" and "ret"
    assert tokenizer.decode(ids[:-1].tolist()) == "def f():\n    return 1 <|endoftext|>"


def test_tiktoken_file_named_like_an_openai_encoding_must_be_that_file(
    tiktoken_file: Path, tmp_path: Path
) -> None:
    fake = tmp_path / "cl100k_base.tiktoken"
    shutil.copy(tiktoken_file, fake)
    with pytest.raises(TokenizerError, match="named like the cl100k_base encoding but its sha256 differs"):
        load_tokenizer_spec(resolve_tokenizer(str(fake)))


def test_unknown_tokenizer_names_are_refused_listing_the_valid_ones(tmp_path: Path) -> None:
    (tmp_path / "vocab.txt").write_text("a\n")
    for name, problem in [
        (str(tmp_path / "vocab.txt"), "unknown type '.txt'"),
        ("/nonexistent.json", "does not exist"),
    ]:
        with pytest.raises(
            TokenizerError, match=f"{problem}.*tokenizer.json, a SentencePiece .model, a tiktoken"
        ):
            resolve_tokenizer(name)
    with pytest.raises(TokenizerError, match="the directory holds none of"):
        resolve_tokenizer(str(tmp_path))


@pytest.mark.parametrize("kind", ["byte", "hf", "sentencepiece", "tiktoken"])
def test_decode_keeps_the_last_id_and_leaves_out_ids_past_the_vocabulary(
    kind: str, hf_tokenizer_file: Path, sp_model_file: Path, tiktoken_file: Path
) -> None:
    """`model.vocab_size` only has to cover the tokenizer's vocabulary, so a sample (the end-of-run one,
    `recipes.generate`) can hold ids `vocab_size` and up: decoding leaves them out instead of failing
    after training (SentencePiece raised IndexError); `vocab_size - 1` is a token and is kept."""
    name = {
        "byte": "byte",
        "hf": hf_tokenizer_file,
        "sentencepiece": sp_model_file,
        "tiktoken": tiktoken_file,
    }
    tokenizer = load_tokenizer_spec(resolve_tokenizer(str(name[kind])))
    ids, size = tokenizer.encode("def value"), tokenizer.vocab_size
    assert tokenizer.decode([*ids, size, size + 1000]) == tokenizer.decode(ids)
    assert tokenizer.decode([*ids, size - 1]) != tokenizer.decode(ids)
