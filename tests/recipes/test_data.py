"""Corpus resolution, tokenizers, the token cache and the windows each rank reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from recipes.data.config import DataConfig, check_token_count
from recipes.data.corpus import CorpusError, resolve_corpus, stdlib_corpus
from recipes.data.module import PretrainDataModule, TokenWindows
from recipes.data.preparation import PrepareConfig, prepare
from recipes.data.shards import ShardError, TokenStream, read_index, token_dtype
from recipes.data.sources import prepare_config
from recipes.data.tokenizer import HFTokenizer

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 40


def write_corpus(directory: Path, texts: list[str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(texts):
        (directory / f"doc{i}.txt").write_text(text)
    return directory


def test_text_source_is_prepared_once_and_its_key_follows_the_files(tmp_path: Path) -> None:
    corpus_dir = write_corpus(tmp_path / "corpus", [TEXT, TEXT.upper()] * 4)
    config = DataConfig(path=str(corpus_dir), seq_len=32, cache_dir=str(tmp_path / "cache"), val_fraction=0.2)
    first = prepare_config(config, resolve_corpus(config.path, 1.0))
    datamodule = PretrainDataModule(config)
    datamodule.prepare_data()
    assert Path(first.out).parent == tmp_path / "cache" / "tokens" and read_index(first.out).tokens["val"] > 0
    again = prepare(PrepareConfig(**{**first.__dict__, "progress": False}))
    assert again.reused_units == again.units  # a second run tokenizes nothing
    (corpus_dir / "doc1.txt").write_text(TEXT.upper() + "#")
    assert prepare_config(config, resolve_corpus(config.path, 1.0)).out != first.out


def test_bpe_is_trained_into_the_prepared_directory_and_round_trips(tmp_path: Path) -> None:
    corpus_dir = write_corpus(tmp_path / "corpus", [TEXT, TEXT[::-1]] * 3)
    config = DataConfig(
        path=str(corpus_dir), tokenizer="bpe", bpe_vocab_size=300, seq_len=16, cache_dir=str(tmp_path)
    )
    datamodule = PretrainDataModule(config)
    datamodule.prepare_data()
    datamodule.setup("fit")
    tokenizer = datamodule.tokenizer
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.vocab_size == 300
    assert tokenizer.path.parent == datamodule.directory and tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.decode(tokenizer.encode("def add(a, b):")) == "def add(a, b):"


def test_windows_are_shifted_pairs_and_may_span_shards(tmp_path: Path) -> None:
    windows = TokenWindows(np.arange(1000, dtype=np.uint16), seq_len=32)
    x, y = windows[3]
    assert len(windows) == 31 and x.shape == (32,) and x.dtype == torch.long
    assert torch.equal(x[1:], y[:-1]) and int(x[0]) == 96 and int(y[-1]) == 128
    prepare(
        PrepareConfig(
            out=str(tmp_path / "out"),
            inputs=(str(write_corpus(tmp_path / "c", [TEXT[:300]] * 6)),),
            shard_mb=400 / 2**20,
            val_fraction=0.0,
            progress=False,
        )
    )
    index = read_index(tmp_path / "out")
    stream = TokenStream(tmp_path / "out", index.split("train"), index.dtype)
    assert len(index.split("train")) == 6 and len(stream) == 6 * 302
    whole = np.frombuffer((TEXT[:300] + "\n\n").encode() * 6, dtype=np.uint8)
    spanning = TokenWindows(stream, seq_len=500)  # windows longer than a shard
    assert len(spanning) == 3
    for i in range(len(spanning)):
        x, y = spanning[i]
        assert np.array_equal(x.numpy(), whole[i * 500 : i * 500 + 500])
        assert np.array_equal(y.numpy(), whole[i * 500 + 1 : i * 500 + 501])


def test_distributed_sampling_gives_distinct_reproducible_samples_per_rank() -> None:
    windows = TokenWindows(np.arange(5000, dtype=np.uint16), seq_len=16)
    per_rank = []
    for rank in range(2):
        sampler = DistributedSampler(windows, num_replicas=2, rank=rank, shuffle=True, seed=1234)
        sampler.set_epoch(0)
        per_rank.append(list(sampler))
    assert not set(per_rank[0]) & set(per_rank[1])
    assert len(set(per_rank[0]) | set(per_rank[1])) == len(windows)
    again = DistributedSampler(windows, num_replicas=2, rank=0, shuffle=True, seed=1234)
    assert list(again) == per_rank[0]


def test_datamodule_reads_a_prepared_directory_and_splits_by_documents(tmp_path: Path) -> None:
    corpus_dir = write_corpus(tmp_path / "corpus", [f"{TEXT}{i}" for i in range(20)])
    prepare(
        PrepareConfig(out=str(tmp_path / "tok"), inputs=(str(corpus_dir),), val_fraction=0.2, progress=False)
    )
    config = DataConfig(path=str(tmp_path / "tok"), tokenizer=None, seq_len=32, batch_size=4)
    datamodule = PretrainDataModule(config)
    datamodule.prepare_data()  # nothing to do
    datamodule.setup("fit")
    x, y = next(iter(datamodule.train_dataloader()))
    assert x.shape == y.shape == (4, 32)
    index = read_index(tmp_path / "tok")
    assert index.documents == {"train": 16, "val": 4}
    assert datamodule.val_set is not None and len(datamodule.val_set.tokens) == index.tokens["val"]
    (tmp_path / "tok" / index.shards[0].name).write_bytes(b"\0")
    with pytest.raises(ShardError, match="has 1 bytes.*run python -m recipes.prepare again"):
        PretrainDataModule(config).setup("fit")


def test_pretokenized_bin_is_read_without_tokenizing(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    np.arange(3000, dtype=np.uint16).tofile(path)
    config = DataConfig(path=str(path), seq_len=16, batch_size=2, cache_dir=str(tmp_path / "cache"))
    datamodule = PretrainDataModule(config)
    datamodule.prepare_data()
    datamodule.setup("fit")
    assert not (tmp_path / "cache").exists()
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
    with pytest.raises(
        CorpusError, match="2000 training and 50 validation tokens, too few for data.seq_len=100"
    ):
        check_token_count(2000, 50, config)
    check_token_count(2000, 101, config)  # seq_len + 1 tokens: one window (inputs and shifted targets)
    with pytest.raises(CorpusError, match="2000 training and 100 validation tokens"):
        check_token_count(2000, 100, config)  # seq_len tokens hold no window
    with pytest.raises(CorpusError, match="100 training and 2000 validation tokens"):
        check_token_count(100, 2000, config)


@pytest.mark.parametrize(("tokens", "windows"), [(64, 1), (65, 2), (96, 2), (97, 3), (32, 0), (33, 1)])
def test_windows_end_at_the_last_token_and_never_past_it(tokens: int, windows: int) -> None:
    """k windows of 32 need k * 32 + 1 tokens (the targets are shifted by one): 64 tokens hold one."""
    dataset = TokenWindows(np.arange(tokens, dtype=np.uint16), seq_len=32)
    assert len(dataset) == windows
    if windows:
        x, y = dataset[windows - 1]
        assert x.shape == y.shape == (32,) and int(y[-1]) <= tokens - 1
    with pytest.raises(IndexError):
        dataset[windows]


def test_token_dtype_follows_vocabulary_size() -> None:
    assert (
        token_dtype(256) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    )


def test_fit_on_shards_prepared_with_a_sentencepiece_model(tmp_path: Path, sp_model_file: Path) -> None:
    """The whole path in one process: prepare with the user's tokenizer -> data=tokens -> fit."""
    import lightning.pytorch as pl

    from recipes.config.validation import validate
    from recipes.training.module import PretrainModule
    from tests.conf.compose import compose_pretrain

    corpus = write_corpus(tmp_path / "corpus", [f"def f{i}(x): return x * {i}\n" * 30 for i in range(20)])
    prepare(
        PrepareConfig(
            out=str(tmp_path / "tok"),
            inputs=(str(corpus),),
            tokenizer=str(sp_model_file),
            val_fraction=0.1,
            progress=False,
        )
    )
    cfg = compose_pretrain(
        [
            "data=tokens",
            f"data.path={tmp_path / 'tok'}",
            "data.seq_len=32",
            "data.batch_size=4",
            "model.n_layer=1",
            "model.d_model=32",
            "model.n_head=2",
        ]
    )
    configs = validate(cfg)
    assert configs.model.vocab_size == 120  # the SentencePiece model's, from index.json
    datamodule = PretrainDataModule(configs.data)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        limit_val_batches=1,
        val_check_interval=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(PretrainModule(configs.model, configs.optim), datamodule=datamodule)
    assert trainer.global_step == 3 and torch.isfinite(trainer.callback_metrics["val/loss"])
    assert datamodule.tokenizer is not None and datamodule.tokenizer.eos_id == 2
    assert datamodule.tokenizer.decode(datamodule.tokenizer.encode("def f1(x):")) == "def f1(x):"
