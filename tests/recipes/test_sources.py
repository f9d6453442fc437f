"""`recipes.data.sources`: one `DataSource` class per kind of `data.path`, chosen in one place, each
answering the same questions (no Lightning, no fit: milliseconds to seconds)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from recipes.data import CorpusError, DataConfig, data_source
from recipes.data.module import PretrainDataModule
from recipes.data.preparation import PrepareConfig, prepare
from recipes.data.sources import BinTokens, PreparedTokens, TextTokens

TEXT = "def add(a, b):\n    return a + b\n" * 20


@pytest.fixture
def paths(tmp_path: Path) -> dict[str, Path]:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(10):
        (corpus / f"{i}.txt").write_text(f"{TEXT}{i}\n")
    prepare(PrepareConfig(out=str(tmp_path / "tok"), inputs=(str(corpus),), val_fraction=0.2, progress=False))
    (np.arange(4000) % 256).astype(np.uint16).tofile(tmp_path / "tokens.bin")
    return {
        "text": corpus,
        "tokens": tmp_path / "tok",
        "bin": tmp_path / "tokens.bin",
        "cache": tmp_path / "c",
    }


def configs(paths: dict[str, Path]) -> dict[type, DataConfig]:
    """One config per kind of source, each with a window every split can hold."""
    common = {"seq_len": 16, "cache_dir": str(paths["cache"])}
    return {
        PreparedTokens: DataConfig(path=str(paths["tokens"]), tokenizer=None, **common),
        BinTokens: DataConfig(path=str(paths["bin"]), **common),
        TextTokens: DataConfig(path=str(paths["text"]), val_fraction=0.2, **common),
    }


def test_each_kind_of_path_gets_its_own_source_class(paths: dict[str, Path]) -> None:
    for kind, config in configs(paths).items():
        assert type(data_source(config)) is kind, config.path
    assert type(data_source(DataConfig(path=None))) is TextTokens  # the stdlib corpus
    assert type(data_source(DataConfig(path=str(paths["text"] / "*.txt")))) is TextTokens  # a glob


def test_every_source_answers_the_same_questions(paths: dict[str, Path]) -> None:
    for kind, config in configs(paths).items():
        source = data_source(config)
        vocab = source.vocab_size()
        source.check(vocab)
        expected_top = {PreparedTokens: 255, BinTokens: 255, TextTokens: -1}[kind]  # text: the tokenizer's
        assert vocab == 256 and source.max_token_id(vocab) <= expected_top, kind
        assert (source.corpus is not None) == (kind is TextTokens)
        source.prepare()
        assert source.tokenizer().vocab_size == vocab
        train, val = source.open("train"), source.open("val")
        assert len(train) > len(val) > config.seq_len, kind
        assert int(np.asarray(train[0:8]).max()) < vocab


def test_the_data_module_refuses_splits_shorter_than_a_window(paths: dict[str, Path]) -> None:
    config = DataConfig(path=str(paths["bin"]), seq_len=1000, val_fraction=0.1)  # 400 validation tokens
    with pytest.raises(
        CorpusError, match="3600 training and 400 validation tokens, too few for data.seq_len"
    ):
        PretrainDataModule(config).setup("fit")
