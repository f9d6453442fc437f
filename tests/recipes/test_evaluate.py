"""`python -m recipes.evaluate`: the loss Lightning logged, from a checkpoint, a run directory or
explicit data; which checkpoint a run directory means; and every refusal, before any evaluation."""

from __future__ import annotations

import os
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from recipes.checkpoints.load import LoadError
from recipes.checkpoints.locate import resolve_checkpoint
from recipes.data.config import DataConfig
from recipes.data.module import PretrainDataModule
from recipes.evaluate import main
from recipes.training.model import GPTConfig
from recipes.training.module import OptimConfig, PretrainModule
from tests.recipes.tiny_fit import quiet_trainer, write_text_corpus

TINY = GPTConfig(vocab_size=256, max_seq_len=32, n_layer=1, n_head=2, d_model=32)
RESULT = re.compile(r"(val|train): loss ([\d.]+) nats/token, perplexity ([\d.]+) over ([\d,]+) tokens")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run directory as `recipes.pretrain` leaves it: 6 steps of the byte-level tiny model, validated
    on the whole held-out split after the last step; `checkpoints/last.ckpt` and `config.yaml`."""
    root = tmp_path_factory.mktemp("evaluate")
    text_dir = write_text_corpus(root / "text")
    data = DataConfig(
        path=str(text_dir), seq_len=32, batch_size=4, val_fraction=0.2, cache_dir=str(root / "cache")
    )
    trainer = quiet_trainer(max_steps=6, val_check_interval=6, limit_val_batches=1.0)
    module = PretrainModule(TINY, OptimConfig(lr=1e-2, warmup_steps=2))
    datamodule = PretrainDataModule(data)
    trainer.fit(module, datamodule=datamodule)
    run_dir = root / "run"
    trainer.save_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    resolved = {"data": {"_target_": "recipes.data.config.DataConfig", **asdict(data)}, "seed": 1234}
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
    return {
        "run_dir": run_dir,
        "text_dir": text_dir,
        "cache_dir": root / "cache",
        "module": module.eval(),
        "datamodule": datamodule,
        "logged": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }


def evaluate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[str, float, float, int]:
    """Run the CLI; its split, loss, perplexity and token count."""
    main([*argv])
    out = capsys.readouterr().out
    match = RESULT.search(out)
    assert match, out
    return match[1], float(match[2]), float(match[3]), int(match[4].replace(",", ""))


def test_a_run_directory_gives_the_validation_loss_lightning_logged(
    run: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    split, loss, perplexity, tokens = evaluate(capsys, str(run["run_dir"]))
    assert split == "val"
    assert tokens == len(run["datamodule"].val_set) * 32 and tokens > 10 * 4 * 32  # more than 10 batches
    assert loss == pytest.approx(run["logged"]["val/loss"], rel=1e-6, abs=2e-6)
    assert perplexity == pytest.approx(run["logged"]["val/ppl"], rel=1e-5)


def test_explicit_data_split_and_limit_match_a_hand_computation(
    run: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """`data=text` with overrides instead of the run's config; the first 3 training batches, in order."""
    checkpoint = run["run_dir"] / "checkpoints" / "last.ckpt"
    data = [f"data.path={run['text_dir']}", "data.tokenizer=byte", "data.seq_len=32", "data.batch_size=4"]
    data += ["data.val_fraction=0.2", f"data.cache_dir={run['cache_dir']}"]
    split, loss, _, tokens = evaluate(
        capsys, str(checkpoint), "data=text", *data, "split=train", "limit_batches=3"
    )
    train_set = run["datamodule"].train_set
    inputs, targets = (torch.stack(t) for t in zip(*(train_set[i] for i in range(12)), strict=True))
    with torch.no_grad():
        logits = run["module"].model(inputs)  # (12, 32, 256)
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    assert split == "train" and tokens == 12 * 32
    assert loss == pytest.approx(expected, rel=1e-6, abs=2e-6)


def test_a_run_directory_means_its_newest_complete_checkpoint(tmp_path: Path) -> None:
    """Files and sharded directories alike (a directory counts from its meta.pt, written last); a
    directory without meta.pt, or a file cut off mid-write, is not a checkpoint."""
    from lightning_zero.checkpoint import FORMAT_VERSION

    (tmp_path / "checkpoints").mkdir()
    step3 = tmp_path / "checkpoints" / "step000003.ckpt"
    torch.save({"step": 3}, step3)
    last = tmp_path / "checkpoints" / "last.ckpt"
    last.mkdir()
    torch.save({"format_version": FORMAT_VERSION, "files": {}}, last / "meta.pt")
    unfinished = tmp_path / "checkpoints" / "step000009.ckpt"
    unfinished.mkdir()
    truncated = tmp_path / "checkpoints" / "step000012.ckpt"
    truncated.write_bytes(step3.read_bytes()[:50])
    requeue = tmp_path / "hpc_ckpt_1.ckpt"
    torch.save({"step": 1}, requeue)
    for age, path in enumerate([requeue, step3, last / "meta.pt", unfinished, truncated]):
        os.utime(path, (1000 + age, 1000 + age))
    assert resolve_checkpoint(tmp_path) == last
    os.utime(requeue, (2000, 2000))
    assert resolve_checkpoint(tmp_path) == requeue
    assert resolve_checkpoint(step3) == step3
    with pytest.raises(LoadError, match="neither a checkpoint .* nor a run directory with checkpoints"):
        resolve_checkpoint(tmp_path / "checkpoints" / "step000009.ckpt")


def refusal(capsys: pytest.CaptureFixture[str], *argv: str, status: int = 1) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv])
    assert exit_info.value.code == status
    captured = capsys.readouterr()
    assert "loss" not in captured.out  # nothing was evaluated
    return captured.err


def test_refusals_name_the_bad_value(
    run: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path, hf_tokenizer_file: Path
) -> None:
    run_dir = str(run["run_dir"])
    assert f"checkpoint not found: {tmp_path / 'nope'}" in refusal(capsys, str(tmp_path / "nope"))
    assert f"{tmp_path} is neither a checkpoint" in refusal(capsys, str(tmp_path))
    assert "data.paht: Key 'paht' not in 'DataConfig'" in refusal(capsys, run_dir, "data.paht=x")
    assert "data.seq_len: Value 'big'" in refusal(capsys, run_dir, "data.seq_len=big")
    err = refusal(capsys, run_dir, "data=nope")
    assert "data=nope is not a data config; choose one of " in err and "stdlib" in err
    assert "data.path is required by data=text" in refusal(capsys, run_dir, "data=text")
    assert "unknown argument 'extra'" in refusal(capsys, run_dir, "extra")
    assert "unrecognized arguments: --seq-len=8" in refusal(capsys, run_dir, "seq_len=8", status=2)
    assert "data.seq_len=33 is longer than the model's context (max_seq_len=32)" in refusal(
        capsys, run_dir, "data.seq_len=33"
    )  # 32, the context itself, is what every other test evaluates
    err = refusal(capsys, run_dir, f"data.tokenizer={hf_tokenizer_file}")
    assert "the checkpoint was trained with tokenizer byte-v1 but" in err and "is tokenized with hf-" in err


def test_a_bare_checkpoint_file_still_gets_the_vocabulary_check(
    run: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path, hf_tokenizer_file: Path
) -> None:
    """No run directory beside it: the tokenizer cannot be compared, its size can (300 ids > 256)."""
    bare = tmp_path / "model.ckpt"
    bare.write_bytes((run["run_dir"] / "checkpoints" / "last.ckpt").read_bytes())
    data = [f"data.path={run['text_dir']}", f"data.tokenizer={hf_tokenizer_file}", "data.seq_len=32"]
    err = refusal(capsys, str(bare), "data=text", *data, f"data.cache_dir={run['cache_dir']}")
    assert "note: only the vocabulary size can be checked" in err
    assert "the tokenizer has 300 tokens but the model only model.vocab_size=256" in err
    assert "no run config.yaml beside" in refusal(capsys, str(bare))


def test_a_checkpoint_from_before_the_throughput_callback_still_loads(
    run: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Its hyper-parameters name `peak_flops_per_device`, which the module no longer takes: it loads the
    same weights (the loss of the first batch is the trained model's, computed here by hand), and
    `limit_batches=1` evaluates one batch of 4 windows."""
    checkpoint = torch.load(run["run_dir"] / "checkpoints" / "last.ckpt", weights_only=True)
    checkpoint["hyper_parameters"]["peak_flops_per_device"] = None
    (tmp_path / "checkpoints").mkdir()
    torch.save(checkpoint, tmp_path / "checkpoints" / "old.ckpt")
    (tmp_path / "config.yaml").write_text((run["run_dir"] / "config.yaml").read_text())
    split, loss, _, tokens = evaluate(capsys, str(tmp_path), "limit_batches=1")
    val_set = run["datamodule"].val_set
    inputs, targets = (torch.stack(t) for t in zip(*(val_set[i] for i in range(4)), strict=True))
    with torch.no_grad():
        logits = run["module"].model(inputs)  # (4, 32, 256)
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    assert split == "val" and tokens == 4 * 32  # one batch of data.batch_size=4 windows of 32
    assert loss == pytest.approx(expected, rel=1e-6, abs=2e-6)


def test_a_tokenizer_mismatch_is_refused_before_the_data_is_prepared(
    run: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path, hf_tokenizer_file: Path
) -> None:
    """A tokenizer known without preparing (a file) is compared first: nothing is tokenized for it."""
    cache = tmp_path / "cache"
    err = refusal(
        capsys, str(run["run_dir"]), f"data.tokenizer={hf_tokenizer_file}", f"data.cache_dir={cache}"
    )
    assert "the checkpoint was trained with tokenizer byte-v1 but" in err and not cache.exists()


def test_token_ids_the_model_cannot_embed_are_refused(
    run: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A `.bin` of byte-sized ids with one id the model lacks (its only record: one pass over it); the
    boundary exactly: the model's last id, 255, is evaluated, 256 is refused."""
    data = ["data=pretokenized", "data.seq_len=32"]
    for top in (255, 256, 300):
        np.r_[np.arange(3000) % 256, top].astype(np.uint16).tofile(tmp_path / f"top{top}.bin")
    split, loss, _, _ = evaluate(
        capsys, str(run["run_dir"]), *data, f"data.path={tmp_path / 'top255.bin'}", "limit_batches=1"
    )
    assert split == "val" and loss > 0
    for top in (256, 300):
        tokens = tmp_path / f"top{top}.bin"
        err = refusal(capsys, str(run["run_dir"]), *data, f"data.path={tokens}")
        assert f"data.path='{tokens}' holds token id {top}, outside the model's vocabulary of 256" in err
