"""In-process checks of `recipes.validate` for the settings the command-line tests do not cover."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from recipes.validate import ConfigError, validate
from tests.conf.compose import compose_pretrain


def test_default_config_validates_and_resolves_the_vocabulary() -> None:
    configs = validate(compose_pretrain())
    assert configs.model.vocab_size == 256 and configs.data.tokenizer == "byte"
    assert configs.corpus.files and not configs.corpus.pretokenized


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.vocab_size=100"], "model.vocab_size=100 is smaller than the tokenizer's 256"),
        (["data.tokenizer=words"], "data.tokenizer='words' does not exist; give 'byte', 'bpe'"),
        (["data.val_fraction=1.5"], "data.val_fraction"),
        (["model.n_head=5"], "model.n_head=5"),
        (["optim.lr=-1"], "optim.lr"),
        (["strategy._target_=no_such_package.Strategy"], "strategy._target_=no_such_package.Strategy"),
        (["ckpt_path=/nonexistent/x.ckpt"], "ckpt_path='/nonexistent/x.ckpt' does not exist"),
        (["data.tokenizer=/nonexistent.json"], "data.tokenizer='/nonexistent.json' does not exist"),
        (["data.tokenizer=null"], "data.tokenizer=null needs data.path to be a directory written by"),
    ],
)
def test_invalid_settings_are_named(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate(compose_pretrain(overrides))
    assert message in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_gpu_trainer_without_gpu_is_refused() -> None:
    with pytest.raises(ConfigError, match="no CUDA GPU is visible"):
        validate(compose_pretrain(["trainer=gpu"]))


def test_pretokenized_input_checks(tmp_path: Path) -> None:
    good, odd, gpt2 = tmp_path / "good.bin", tmp_path / "odd.bin", tmp_path / "gpt2.bin"
    (np.arange(20000) % 256).astype(np.uint16).tofile(good)
    odd.write_bytes(b"\0" * 4001)
    np.r_[np.arange(19999) % 256, 50256].astype(np.uint16).tofile(gpt2)  # one id the tiny model lacks
    configs = validate(compose_pretrain(["data=pretokenized", f"data.path={good}"]))
    assert configs.corpus is None and configs.model.vocab_size == 256
    with pytest.raises(ConfigError, match="not a multiple of 2"):
        validate(compose_pretrain(["data=pretokenized", f"data.path={odd}"]))
    with pytest.raises(ConfigError, match="pre-tokenized: data.tokenizer=bpe"):
        validate(compose_pretrain(["data=pretokenized", f"data.path={good}", "data.tokenizer=bpe"]))
    message = r"holds token id 50256, outside model.vocab_size=256 \(tokenizer vocabulary 256\)"
    with pytest.raises(ConfigError, match=message):
        validate(compose_pretrain(["data=pretokenized", f"data.path={gpt2}"]))


def test_corpus_smaller_than_two_windows_is_refused(tmp_path: Path) -> None:
    (tmp_path / "short.txt").write_text("print('hello')\n" * 20)
    with pytest.raises(ConfigError, match="too few for data.seq_len=256"):
        validate(compose_pretrain([f"data.path={tmp_path / 'short.txt'}"]))


def test_prepared_directory_validates_against_the_model_vocabulary(tmp_path: Path) -> None:
    from recipes.prepare import PrepareConfig, prepare

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"{i}.txt").write_text(f"print('hello {i}')\n" * 40)
    prepare(PrepareConfig(out=str(tmp_path / "tok"), inputs=(str(corpus),), val_fraction=0.1, progress=False))
    tokens = ["data=tokens", f"data.path={tmp_path / 'tok'}", "data.seq_len=64"]
    configs = validate(compose_pretrain(tokens))
    assert configs.corpus is None and configs.model.vocab_size == 256  # from the index
    with pytest.raises(ConfigError, match="model.vocab_size=200 is smaller than the tokenizer's 256"):
        validate(compose_pretrain([*tokens, "model.vocab_size=200"]))
    with pytest.raises(ConfigError, match="is a prepared token directory: use data=tokens"):
        validate(compose_pretrain([f"data.path={tmp_path / 'tok'}"]))
    with pytest.raises(ConfigError, match="validation tokens, too few for data.seq_len=4000"):
        validate(compose_pretrain([*tokens, "data.seq_len=4000", "model.max_seq_len=4096"]))
    (tmp_path / "tok" / "index.json").unlink()
    with pytest.raises(ConfigError, match="data.tokenizer=null needs data.path to be a directory written by"):
        validate(compose_pretrain(tokens))
