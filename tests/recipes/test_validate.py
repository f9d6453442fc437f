"""In-process checks of `recipes.config.validation` for the settings the command-line tests do not cover."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from recipes.config.validation import ConfigError, validate
from tests.conf.compose import compose_pretrain
from tests.recipes.conftest import write_parquet
from tests.recipes.tiny_fit import write_text_corpus


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
        (["data.seq_len=257"], "data.seq_len=257 exceeds model.max_seq_len=256"),  # 256: the default
        (["data.tokenizer=bpe", "data.bpe_vocab_size=256"], "data.bpe_vocab_size must be >= 257 (256 bytes"),
        (["cluster.peer_failure_requeues=-1"], "cluster.peer_failure_requeues=-1: expected a number of"),
        (
            ["model.compile_blocks=true", "strategy.overlap_param_gather=true"],
            "model.compile_blocks=true with strategy.overlap_param_gather=true",
        ),
    ],
)
def test_invalid_settings_are_named(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate(compose_pretrain(overrides))
    assert all(part in str(info.value) for part in message.split("..."))  # (...): the import's own error


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


def test_token_ids_cross_the_vocabulary_boundary_exactly(tmp_path: Path) -> None:
    """Valid ids are 0 .. model.vocab_size - 1 (id vocab_size is an embedding lookup out of range: a
    device-side assert on CUDA): the last one is accepted, the next one refused. And the model's
    vocabulary may equal the tokenizer's, not be one smaller."""

    def tokens_up_to(top: int) -> Path:
        path = tmp_path / f"top{top}.bin"
        np.r_[np.arange(20000) % 256, top].astype(np.uint16).tofile(path)  # byte ids, then `top`
        return path

    pretokenized = ["data=pretokenized", "model.vocab_size=300"]
    configs = validate(compose_pretrain([*pretokenized, f"data.path={tokens_up_to(299)}"]))
    assert configs.model.vocab_size == 300
    message = r"holds token id 300, outside model.vocab_size=300 .*set model.vocab_size>=301"
    with pytest.raises(ConfigError, match=message):
        validate(compose_pretrain([*pretokenized, f"data.path={tokens_up_to(300)}"]))
    text = [f"data.path={write_text_corpus(tmp_path / 'text')}", "data.seq_len=32"]
    assert validate(compose_pretrain([*text, "model.vocab_size=256"])).model.vocab_size == 256
    with pytest.raises(ConfigError, match="model.vocab_size=255 is smaller than the tokenizer's 256"):
        validate(compose_pretrain([*text, "model.vocab_size=255"]))


def test_the_smallest_bpe_is_accepted_before_it_is_trained() -> None:
    """257 ids (the bytes and end-of-text) is the smallest BPE; 256 is refused above, at validation, not
    when `prepare_data` trains it on one rank per node while the others wait."""
    configs = validate(compose_pretrain(["data.tokenizer=bpe", "data.bpe_vocab_size=257"]))
    assert configs.model.vocab_size == 257


def test_every_core_may_be_used_and_not_one_more(monkeypatch: pytest.MonkeyPatch) -> None:
    from recipes.config.validation import check_devices

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    check_devices("cpu", 4)
    check_devices("cpu", [0, 1, 2, 3])
    with pytest.raises(ConfigError, match=r"trainer.devices=5 but this machine has 4 CPU cores"):
        check_devices("cpu", 5)


def test_corpus_smaller_than_two_windows_is_refused(tmp_path: Path) -> None:
    (tmp_path / "short.txt").write_text("print('hello')\n" * 20)
    with pytest.raises(ConfigError, match="too few for data.seq_len=256"):
        validate(compose_pretrain([f"data.path={tmp_path / 'short.txt'}"]))


def test_prepared_directory_validates_against_the_model_vocabulary(tmp_path: Path) -> None:
    from recipes.data.preparation import PrepareConfig, prepare

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


# --- the open but checked schema: what users add on purpose works, typos and wrong types fail ---


def test_every_trainer_and_strategy_argument_is_accepted_and_reaches_the_object(tmp_path: Path) -> None:
    """Trainer and ZeroStrategy arguments the old closed schema refused, set without `+`."""
    from datetime import timedelta

    from hydra.utils import instantiate
    from lightning.pytorch.profilers import SimpleProfiler

    cfg = compose_pretrain(
        [
            f"hydra.run.dir={tmp_path}",
            "trainer.fast_dev_run=2",
            "trainer.limit_train_batches=0.5",
            "trainer.profiler=simple",
            "trainer.gradient_clip_algorithm=value",
            "strategy.async_checkpoint=true",
            "strategy.reduce_dtype=bf16",
            "strategy.timeout.seconds=60",
        ]
    )
    validate(cfg)
    strategy = instantiate(cfg.strategy)
    assert strategy._async_writer is not None and strategy.zero_config.reduce_dtype == "bf16"
    assert strategy._timeout == timedelta(seconds=60)
    trainer = instantiate(cfg.trainer, strategy=strategy, logger=False, enable_checkpointing=False)
    assert trainer.fast_dev_run == 2 and isinstance(trainer.profiler, SimpleProfiler)
    assert trainer.limit_train_batches == 2  # fast_dev_run wins over the fraction, as in Lightning
    assert trainer.gradient_clip_algorithm == "value"


def test_ddp_takes_distributed_data_parallel_arguments() -> None:
    from hydra.utils import instantiate

    cfg = compose_pretrain(["strategy=ddp", "strategy.static_graph=true", "strategy.bucket_cap_mb=5"])
    validate(cfg)
    assert instantiate(cfg.strategy)._ddp_kwargs["static_graph"] is True


def test_added_callbacks_and_loggers_are_built(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import TensorBoardLogger

    from recipes.config.build import build_callbacks, build_loggers

    cfg = compose_pretrain(
        [
            f"hydra.run.dir={tmp_path}",
            "callbacks.model_checkpoint.save_last=link",
            "+callbacks.lr_monitor._target_=lightning.pytorch.callbacks.LearningRateMonitor",
            "+callbacks.lr_monitor.logging_interval=step",
            "+logger.tb._target_=lightning.pytorch.loggers.TensorBoardLogger",
            f"+logger.tb.save_dir={tmp_path}",
        ]
    )
    validate(cfg)
    callbacks = {type(c).__name__: c for c in build_callbacks(cfg)}
    assert callbacks["RunCheckpoint"].save_last == "link"
    assert isinstance(callbacks["LearningRateMonitor"], LearningRateMonitor)
    assert callbacks["LearningRateMonitor"].logging_interval == "step"
    assert any(isinstance(logger, TensorBoardLogger) for logger in build_loggers(cfg))


def test_wandb_logger_is_offline_or_refused_clearly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`logger=wandb` builds an offline logger (no network); without the package, one clear error."""
    from lightning.pytorch.loggers import wandb as lightning_wandb
    from lightning_utilities.core.imports import RequirementCache

    overrides = ["logger=wandb", f"hydra.run.dir={tmp_path}", "+logger.wandb.tags=[demo]"]  # **kwargs
    if lightning_wandb._WANDB_AVAILABLE:
        from recipes.config.build import build_loggers

        validate(compose_pretrain(overrides))
        (logger,) = build_loggers(compose_pretrain(overrides))
        assert logger._offline and logger._wandb_init["tags"] == ["demo"]
    monkeypatch.setattr(lightning_wandb, "_WANDB_AVAILABLE", RequirementCache("wandb>=999"))
    with pytest.raises(ConfigError, match=r"logger.wandb \(lightning.pytorch.loggers.WandbLogger\): .*wandb"):
        validate(compose_pretrain(overrides))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["+trainer.max_step=5"],
            "trainer.max_step: lightning.pytorch.Trainer takes no argument 'max_step'; "
            "did you mean max_steps",
        ),
        (["trainer.precision=bf17"], "trainer.precision='bf17': lightning.pytorch.Trainer wants one of"),
        (["trainer.limit_train_batches=all"], "trainer.limit_train_batches='all'"),
        (["+callbacks.model_checkpoint.save_lst=true"], "did you mean save_last"),
        (["callbacks.model_checkpoint.save_last=links"], "callbacks.model_checkpoint.save_last='links'"),
        (["+callbacks.lr.logging_interval=step"], "callbacks.lr has no _target_"),
        (
            ["+callbacks.x._target_=lightning.pytorch.loggers.CSVLogger", "+callbacks.x.save_dir=y"],
            "callbacks.x._target_=lightning.pytorch.loggers.CSVLogger is not a Lightning Callback",
        ),
        (
            ["+callbacks.x._target_=lightning.pytorch.callbacks.NoSuchCallback"],
            "callbacks.x._target_=lightning.pytorch.callbacks.NoSuchCallback cannot be imported",
        ),
        (["+trainer.logger=false"], "trainer.logger is set by the logger group"),
        (
            ["strategy=ddp", "+strategy.device_ids=[0]"],
            "strategy.device_ids: lightning.pytorch.strategies.DDP",
        ),
        (["strategy.timeout.minutes=5"], "strategy.timeout.minutes"),
        (["strategy.stage=4"], "stage"),
        (["run_name=a", "run_dir=/tmp/elsewhere"], "set hydra.run.dir=/tmp/elsewhere instead"),
    ],
)
def test_mistakes_in_lightning_arguments_are_named(overrides: list[str], message: str) -> None:
    from hydra.errors import ConfigCompositionException

    try:
        cfg = compose_pretrain(overrides)
    except ConfigCompositionException as error:  # refused while composing: the key is named there
        assert message.split(":")[0].split("=")[0] in f"{error} {error.__cause__}"
        return
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert message in str(info.value)


def test_trainer_plugins_are_built_and_kept() -> None:
    """`trainer.plugins` reaches the Trainer (the recipe adds its SLURM environment next to them)."""
    from lightning.pytorch.plugins.environments import LightningEnvironment

    from recipes.config.build import build_plugins

    target = "lightning.pytorch.plugins.environments.LightningEnvironment"
    cfg = compose_pretrain([f"trainer.plugins=[{{_target_:{target}}}]"])
    validate(cfg)
    assert [type(plugin) for plugin in build_plugins(cfg)] == [LightningEnvironment]


def hide_package(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """`import package` (and its submodules) fails from now on, as when it is not installed (imported
    already or not; `torch.utils.tensorboard` imports `tensorboard`)."""
    dependents = ("torch.utils.tensorboard",) if package == "tensorboard" else ()
    for name in [m for m in sys.modules if m.partition(".")[0] == package or m in dependents]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)


@pytest.mark.parametrize(
    ("package", "overrides", "message"),
    [
        (
            "matplotlib",
            [],
            "callbacks.loss_plot (recipes.training.plot.LossPlot): LossPlot draws the loss curves with "
            "matplotlib (in the `recipes` extra), which cannot be imported here (...); install it, or "
            "leave it out with callbacks.loss_plot=null",
        ),
        (
            "wandb",
            ["logger=wandb"],
            "logger.wandb (lightning.pytorch.loggers.WandbLogger) needs the Python package 'wandb', which "
            "cannot be imported here (...); install it (`pip install -e '.[recipes]'`), or choose another "
            "logger",
        ),
        (
            "tensorboard",
            ["logger=tensorboard"],
            "logger.tensorboard (lightning.pytorch.loggers.TensorBoardLogger) needs the Python package "
            "'tensorboard'",
        ),
        ("tokenizers", ["data.tokenizer=bpe"], "data.tokenizer=bpe needs the Python package 'tokenizers'"),
        (
            "sentencepiece",
            ["data.tokenizer=SP"],
            "data.tokenizer=SP needs the Python package 'sentencepiece'",
        ),
        ("pyarrow", ["data.path=PARQUET"], "data.path='PARQUET' needs the Python package 'pyarrow'"),
        (
            "tokenizers",
            ["data=tokens", "data.path=PREPARED"],
            "data.path='PREPARED' (its tokenizer) needs the Python package 'tokenizers'",
        ),
    ],
    ids=["plot", "wandb", "tensorboard", "bpe", "sentencepiece-file", "parquet", "prepared-hf"],
)
def test_a_missing_optional_package_is_refused_before_any_process_starts(
    package: str,
    overrides: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    sp_model_file: Path,
    hf_tokenizer_file: Path,
) -> None:
    """Each is imported later than start-up otherwise: the plot at the end of training, a logger's client
    at its first log, `tokenizers` when `prepare_data` trains the BPE on one rank per node, a prepared
    directory's tokenizer once every process runs. With the package there, the same config validates."""
    from recipes.data.preparation import PrepareConfig, prepare

    text = write_text_corpus(tmp_path / "text")
    paths = {
        "SP": str(sp_model_file),
        "PARQUET": str(tmp_path / "docs.parquet"),
        "PREPARED": str(tmp_path / "tok"),
    }
    if "PARQUET" in str(overrides):
        write_parquet(tmp_path / "docs.parquet", [f"document {i} " * 50 for i in range(40)])
    if "PREPARED" in str(overrides):
        prepare(
            PrepareConfig(
                out=paths["PREPARED"], inputs=(str(text),), tokenizer=str(hf_tokenizer_file), progress=False
            )
        )
    for key, path in paths.items():
        overrides = [o.replace(key, path) for o in overrides]
        message = message.replace(key, path)
    overrides = [f"data.path={text}", f"hydra.run.dir={tmp_path / 'run'}", "data.seq_len=32", *overrides]
    validate(compose_pretrain(overrides))
    hide_package(monkeypatch, package)
    with pytest.raises(ConfigError) as info:
        validate(compose_pretrain(overrides))
    assert all(part in str(info.value) for part in message.split("..."))  # (...): the import's own error
