"""Corpus resolution, tokenizers, the token cache and the windows each rank reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from recipes.corpus import CorpusError, resolve_corpus, stdlib_corpus
from recipes.data import (
    DataConfig,
    PretrainDataModule,
    RandomWindows,
    build_token_cache,
    check_token_count,
    load_tokenizer,
    token_dtype,
)
from recipes.tokenizer import BPETokenizer, ByteTokenizer

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 40


def write_corpus(directory: Path, texts: list[str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(texts):
        (directory / f"doc{i}.txt").write_text(text)
    return directory


def test_byte_tokenizer_round_trips_utf8() -> None:
    tokenizer = ByteTokenizer()
    text = "héllo → wörld"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode_document(b"ab").tolist() == [97, 98, 10, 10]


def test_token_cache_hits_on_second_load_and_key_follows_content(tmp_path: Path) -> None:
    corpus_dir = write_corpus(tmp_path / "corpus", [TEXT, TEXT.upper()])
    tokenizer = ByteTokenizer()
    first = build_token_cache(resolve_corpus(str(corpus_dir), 1.0), tokenizer, tmp_path / "cache")
    second = build_token_cache(resolve_corpus(str(corpus_dir), 1.0), tokenizer, tmp_path / "cache")
    assert not first.hit and second.hit and first.key == second.key
    assert first.n_tokens == len(TEXT) * 2 + 4 and first.dtype == "uint16"
    assert bytes(first.load()[: len(TEXT)].astype(np.uint8)) == TEXT.encode()

    (corpus_dir / "doc1.txt").write_text(TEXT.upper() + "#")
    changed = build_token_cache(resolve_corpus(str(corpus_dir), 1.0), tokenizer, tmp_path / "cache")
    assert not changed.hit and changed.key != first.key


def test_bpe_is_trained_once_cached_and_round_trips(tmp_path: Path) -> None:
    corpus_dir = write_corpus(tmp_path / "corpus", [TEXT, TEXT[::-1]])
    config = DataConfig(path=str(corpus_dir), tokenizer="bpe", bpe_vocab_size=300, cache_dir=str(tmp_path))
    corpus = resolve_corpus(config.path, config.max_corpus_mb)
    tokenizer = load_tokenizer(config, corpus, train_if_missing=True)
    assert isinstance(tokenizer, BPETokenizer) and tokenizer.vocab_size == 300
    again = load_tokenizer(config, corpus, train_if_missing=False)  # would raise if not cached
    assert again.identity == tokenizer.identity
    assert tokenizer.decode(tokenizer.encode("def add(a, b):")) == "def add(a, b):"
    byte_key = build_token_cache(corpus, ByteTokenizer(), tmp_path).key
    assert build_token_cache(corpus, tokenizer, tmp_path).key != byte_key


def test_windows_are_shifted_pairs_and_seeded() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    windows = RandomWindows(tokens, seq_len=32, seed=7)
    x, y = windows[3]
    assert x.shape == (32,) and x.dtype == torch.long and torch.equal(x[1:], y[:-1])
    assert int(y[-1]) == int(x[-1]) + 1
    assert np.array_equal(windows.offsets, RandomWindows(tokens, 32, seed=7).offsets)
    assert not np.array_equal(windows.offsets, RandomWindows(tokens, 32, seed=8).offsets)


def test_distributed_sampling_gives_distinct_reproducible_samples_per_rank() -> None:
    windows = RandomWindows(np.arange(5000, dtype=np.uint16), seq_len=16, seed=0)
    per_rank = []
    for rank in range(2):
        sampler = DistributedSampler(windows, num_replicas=2, rank=rank, shuffle=True, seed=1234)
        sampler.set_epoch(0)
        per_rank.append(list(sampler))
    assert not set(per_rank[0]) & set(per_rank[1])
    assert len(set(per_rank[0]) | set(per_rank[1])) == len(windows)
    again = DistributedSampler(windows, num_replicas=2, rank=0, shuffle=True, seed=1234)
    assert list(again) == per_rank[0]


def test_datamodule_splits_train_and_val(tmp_path: Path) -> None:
    corpus_dir = write_corpus(tmp_path / "corpus", [TEXT] * 5)
    config = DataConfig(
        path=str(corpus_dir), seq_len=32, batch_size=4, val_fraction=0.2, cache_dir=str(tmp_path)
    )
    datamodule = PretrainDataModule(config)
    datamodule.prepare_data()
    datamodule.setup("fit")
    x, y = next(iter(datamodule.train_dataloader()))
    assert x.shape == y.shape == (4, 32)
    assert datamodule.train_set is not None and datamodule.val_set is not None
    n_train, n_val = len(datamodule.train_set.tokens), len(datamodule.val_set.tokens)
    assert n_val == pytest.approx(0.2 * (n_train + n_val), abs=1)


def test_pretokenized_bin_is_read_without_tokenizing(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    np.arange(3000, dtype=np.uint16).tofile(path)
    config = DataConfig(path=str(path), seq_len=16, batch_size=2, cache_dir=str(tmp_path / "cache"))
    datamodule = PretrainDataModule(config)
    datamodule.prepare_data()
    datamodule.setup("fit")
    assert datamodule.cache is None and not (tmp_path / "cache").exists()
    assert datamodule.train_set is not None and int(datamodule.train_set.tokens[10]) == 10


def test_stdlib_corpus_is_deterministic_and_sized() -> None:
    first, second = stdlib_corpus(0.5), stdlib_corpus(0.5)
    assert first.files == second.files
    assert 0.5 * 2**20 <= first.nbytes < 0.5 * 2**20 + max(p.stat().st_size for p in first.files)
    assert all(p.suffix == ".py" and "site-packages" not in p.parts for p in first.files)


def test_corpus_errors_name_data_path(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="data.path=.*no file matches"):
        resolve_corpus(str(tmp_path / "missing" / "*.txt"), 1.0)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(CorpusError, match="data.path=.*empty"):
        resolve_corpus(str(tmp_path / "empty.txt"), 1.0)
    (tmp_path / "a.bin").write_bytes(b"\0\0")
    with pytest.raises(CorpusError, match="exactly one .bin"):
        resolve_corpus(str(tmp_path), 1.0)


def test_too_small_corpus_is_refused_with_the_sizes() -> None:
    config = DataConfig(seq_len=100, val_fraction=0.1)
    with pytest.raises(CorpusError, match="data.seq_len=100"):
        check_token_count(500, config)
    check_token_count(2000, config)


def test_token_dtype_follows_vocabulary_size() -> None:
    assert (
        token_dtype(256) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    )
