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
        (["data.tokenizer=words"], "data.tokenizer='words' is not valid"),
        (["data.val_fraction=1.5"], "data.val_fraction"),
        (["model.n_head=5"], "model.n_head=5"),
        (["optim.lr=-1"], "optim.lr"),
        (["strategy._target_=no_such_package.Strategy"], "strategy._target_=no_such_package.Strategy"),
        (["ckpt_path=/nonexistent/x.ckpt"], "ckpt_path='/nonexistent/x.ckpt' does not exist"),
        (["data.tokenizer=bpe", "data.tokenizer_path=/nonexistent.json"], "data.tokenizer_path="),
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
    good, odd = tmp_path / "good.bin", tmp_path / "odd.bin"
    np.arange(20000, dtype=np.uint16).tofile(good)
    odd.write_bytes(b"\0" * 4001)
    assert validate(compose_pretrain(["data=pretokenized", f"data.path={good}"])).corpus.pretokenized
    with pytest.raises(ConfigError, match="not a multiple of 2 bytes"):
        validate(compose_pretrain(["data=pretokenized", f"data.path={odd}"]))
    with pytest.raises(ConfigError, match="data.tokenizer_path"):
        validate(compose_pretrain(["data=pretokenized", f"data.path={good}", "data.tokenizer=bpe"]))


def test_corpus_smaller_than_two_windows_is_refused(tmp_path: Path) -> None:
    (tmp_path / "short.txt").write_text("print('hello')\n" * 20)
    with pytest.raises(ConfigError, match="too few for data.seq_len=256"):
        validate(compose_pretrain([f"data.path={tmp_path / 'short.txt'}"]))
