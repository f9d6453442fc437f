"""Every YAML under conf/ composes against the schema and its `_target_` instantiates.

Large models are built on the meta device (no memory); the ZeRO strategy files are only composed unless
`lightning_zero` imports; the GPU trainer is only instantiated where CUDA exists.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, InterpolationResolutionError, ValidationError

from recipes.config import schema
from recipes.data.config import DataConfig
from recipes.training.model import GPT, GPTConfig
from recipes.training.module import OptimConfig
from tests.conf.compose import CONF_DIR, compose_pretrain, group_options

# Mandatory values some options leave open (`???`), filled the way a user would.
REQUIRED = {"data": ["data.path=README.md"], "cluster": ["cluster.partition=debug"]}
PARAMS_M = {
    "tiny": (1, 3),
    "gpt2_124m": (115, 130),
    "llama_1b": (1000, 1200),
    "llama_7b": (6500, 7000),
    "llama_70b": (68000, 70000),
}


def _model(cfg: DictConfig) -> GPT:
    vocab = cfg.model.vocab_size if cfg.model.vocab_size is not None else cfg.data.bpe_vocab_size
    config = instantiate(cfg.model, vocab_size=vocab)
    assert isinstance(config, GPTConfig)
    with torch.device("meta"):
        return GPT(config)


def test_every_yaml_belongs_to_a_tested_group() -> None:
    tested = {
        "model",
        "data",
        "strategy",
        "trainer",
        "logger",
        "callbacks",
        "cluster",
        "experiment",
        "debug",
        "launcher",
    }
    groups = {path.parent.name for path in CONF_DIR.rglob("*.yaml") if path.parent != CONF_DIR}
    assert groups == tested
    assert [path.name for path in CONF_DIR.glob("*.yaml")] == ["pretrain.yaml"]


def test_slurm_launcher_is_sized_from_cluster_and_trainer() -> None:
    """conf/hydra/launcher/slurm.yaml: submitit's sbatch numbers follow the recipe's own settings."""
    overrides = [
        "hydra/launcher=slurm",
        "cluster=slurm",
        "cluster.partition=gpu",
        "cluster.nodes=3",
        "trainer.devices=4",
        "cluster.cpus_per_task=5",
    ]
    cfg = compose_pretrain(overrides, return_hydra_config=True)
    assert cfg.hydra.launcher.tasks_per_node == 4 and cfg.hydra.launcher.nodes == 3  # CPU: trainer.devices
    assert cfg.hydra.launcher.partition == "gpu" and cfg.hydra.launcher.cpus_per_task == 5
    assert cfg.hydra.launcher.max_num_timeout == 0  # one requeue mechanism: the recipe's SIGUSR1 callback
    assert cfg.hydra.launcher.additional_parameters.signal == "USR1@90"
    gpu = compose_pretrain(["hydra/launcher=slurm", "cluster=slurm", "trainer=gpu"], return_hydra_config=True)
    assert gpu.hydra.launcher.tasks_per_node == gpu.hydra.launcher.gpus_per_node == 8  # one task per GPU
    mismatch = compose_pretrain([*overrides, "trainer=gpu"], return_hydra_config=True)
    with pytest.raises(InterpolationResolutionError, match="trainer.devices=4 but cluster.gpus_per_node=8"):
        _ = mismatch.hydra.launcher.tasks_per_node


def test_default_config_is_the_cpu_demo() -> None:
    cfg = compose_pretrain()
    assert cfg.run_name == "cpu_demo" and cfg.run_dir == "outputs/cpu_demo" and cfg.model.n_layer == 4
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.devices == 2
    assert cfg.trainer.max_steps == 250 and cfg.trainer.val_check_interval == 125
    assert cfg.optim.lr == 3e-3 and cfg.optim.warmup_steps == 30
    assert cfg.strategy._target_ == "lightning_zero.ZeroStrategy" and cfg.strategy.stage == 2
    assert cfg.data.path is None and cfg.data.tokenizer == "byte"
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert OmegaConf.to_container(compose_pretrain(["experiment=cpu_demo"]), resolve=True) == resolved


@pytest.mark.parametrize("name", group_options("model"))
def test_model_sizes_instantiate_on_meta(name: str) -> None:
    model = _model(compose_pretrain([f"model={name}"]))
    low, high = PARAMS_M[name]
    assert low * 1e6 <= model.num_params() <= high * 1e6
    assert model.flops_per_token() > 6 * model.num_params(exclude_embedding=True) - 1


@pytest.mark.parametrize("name", group_options("data"))
def test_data_options_instantiate(name: str) -> None:
    cfg = compose_pretrain([f"data={name}", *([] if name == "stdlib" else REQUIRED["data"])])
    data = instantiate(cfg.data)
    assert isinstance(data, DataConfig)
    assert (data.tokenizer is None) == (name == "tokens")  # a prepared directory names its own tokenizer


@pytest.mark.parametrize("name", group_options("strategy"))
def test_strategy_options(name: str) -> None:
    cfg = compose_pretrain([f"strategy={name}"])
    if name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        assert isinstance(instantiate(cfg.strategy), DDPStrategy)
        return
    assert cfg.strategy._target_ == "lightning_zero.ZeroStrategy"
    assert cfg.strategy.stage == {"zero": 2, "zero1": 1, "zero2": 2, "zero3": 3}[name]
    assert cfg.strategy.bucket_cap_mb == 25 and cfg.strategy.overlap_comm is True
    lightning_zero = pytest.importorskip("lightning_zero")
    strategy = instantiate(cfg.strategy)
    assert isinstance(strategy, lightning_zero.ZeroStrategy)


TRAINER_ATTRIBUTES = (
    "max_steps",
    "max_epochs",
    "num_nodes",
    "precision",
    "val_check_interval",
    "check_val_every_n_epoch",
    "limit_val_batches",
    "num_sanity_val_steps",
    "log_every_n_steps",
    "gradient_clip_val",
    "accumulate_grad_batches",
    "default_root_dir",
)
"""`Trainer` arguments that it keeps under their own name (what a test can read back)."""


@pytest.mark.parametrize("name", group_options("trainer"))
def test_trainer_options(name: str, tmp_path: Path) -> None:
    """Each file instantiates a `Trainer` holding its values. Without CUDA the GPU file is built on the
    CPU with everything else of it (its accelerator and device count are what the machine lacks;
    bf16-mixed runs on CPUs too), so a value Lightning refuses fails here, not on the cluster."""
    from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator

    cfg = compose_pretrain([f"trainer={name}", f"output_root={tmp_path}"])
    values = OmegaConf.to_container(cfg.trainer, resolve=True)
    assert isinstance(values, dict)
    machine = {}
    if values["accelerator"] == "gpu" and not torch.cuda.is_available():
        machine = {"accelerator": "cpu", "devices": 1}
    trainer = instantiate(cfg.trainer, logger=False, enable_checkpointing=False, **machine)
    expected = CUDAAccelerator if values["accelerator"] == "gpu" and not machine else CPUAccelerator
    assert isinstance(trainer.accelerator, expected)
    assert {key: getattr(trainer, key) for key in TRAINER_ATTRIBUTES} == {
        key: values[key] for key in TRAINER_ATTRIBUTES
    }
    assert trainer.progress_bar_callback is not None  # enable_progress_bar: true


@pytest.mark.parametrize("name", group_options("logger"))
def test_logger_options(name: str, tmp_path: Path) -> None:
    cfg = compose_pretrain([f"logger={name}", f"output_root={tmp_path}"])
    if name == "wandb":
        pytest.importorskip("wandb")  # without it: tests/recipes/test_validate.py checks the message
        assert cfg.logger.wandb.offline is True  # nothing tries the network unless the user says so
    loggers = [instantiate(node) for node in cfg.logger.values()]
    assert loggers and all(isinstance(logger, Logger) for logger in loggers)
    assert all(Path(logger.save_dir).is_relative_to(tmp_path) for logger in loggers)


@pytest.mark.parametrize("name", group_options("callbacks"))
def test_callback_options(name: str, tmp_path: Path) -> None:
    cfg = compose_pretrain([f"callbacks={name}", f"output_root={tmp_path}"])
    callbacks = [instantiate(node) for node in cfg.callbacks.values() if node is not None]
    assert callbacks and all(isinstance(callback, Callback) for callback in callbacks)


@pytest.mark.parametrize("name", group_options("cluster"))
def test_cluster_options(name: str) -> None:
    cfg = compose_pretrain([f"cluster={name}", *([] if name == "local" else REQUIRED["cluster"])])
    assert cfg.cluster.name == name and cfg.trainer.num_nodes == cfg.cluster.nodes >= 1


@pytest.mark.parametrize("name", group_options("experiment"))
def test_experiments_compose_and_instantiate(name: str) -> None:
    overrides = [f"experiment={name}", *REQUIRED["data"], *REQUIRED["cluster"]]
    if name == "cpu_demo":
        overrides = ["experiment=cpu_demo"]
    cfg = compose_pretrain(overrides)
    assert "${" not in str(OmegaConf.to_container(cfg, resolve=False)["run_name"])  # named by the experiment
    OmegaConf.resolve(cfg)
    assert cfg.run_name == name
    model = _model(cfg)
    data = instantiate(cfg.data)
    assert isinstance(instantiate(cfg.optim), OptimConfig)
    assert data.seq_len <= model.config.max_seq_len
    if data.tokenizer is None:  # a prepared directory: its vocabulary is its index's, checked below
        assert name in PREPARED_DATA_EXPERIMENTS
    else:
        assert model.config.vocab_size >= data.vocab_size


PREPARED_DATA_EXPERIMENTS = ["llama_1b_multinode"]
"""Experiments on a prepared token directory (`data=tokens`), whose vocabulary is known only from it."""


def prepared_with_vocabulary(directory: Path, vocab_size: int) -> Path:
    """A token directory whose tokenizer (a word-level `tokenizer.json`) has `vocab_size` ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from recipes.data.preparation import PrepareConfig, prepare

    words = {"[UNK]": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "text").mkdir()
    for doc in range(20):
        (directory / "text" / f"{doc}.txt").write_text(
            " ".join(f"w{2 + (doc * 7 + i) % 300}" for i in range(200))
        )
    out = directory / "tok"
    tokenizer_file = str(directory / "tokenizer.json")
    inputs = (str(directory / "text"),)
    prepare(
        PrepareConfig(out=str(out), inputs=inputs, tokenizer=tokenizer_file, val_fraction=0.2, progress=False)
    )
    return out


@pytest.mark.parametrize("name", PREPARED_DATA_EXPERIMENTS)
def test_an_experiment_on_prepared_data_checks_its_vocabulary_against_the_index(
    name: str, tmp_path: Path
) -> None:
    """The vocabulary check the experiment relies on, with the data it is made for: a tokenizer of exactly
    `model.vocab_size` ids passes (what stops the run here is the machine: no 8 GPUs), one more is
    refused before anything starts."""
    from recipes.config.validation import ConfigError, validate

    model_vocab = compose_pretrain(
        [f"experiment={name}", *REQUIRED["data"], *REQUIRED["cluster"]]
    ).model.vocab_size
    assert model_vocab is not None
    for vocab_size in (model_vocab, model_vocab + 1):
        data = prepared_with_vocabulary(tmp_path / str(vocab_size), vocab_size)
        overrides = [f"experiment={name}", f"data.path={data}", "data.seq_len=64", *REQUIRED["cluster"]]
        with pytest.raises(ConfigError) as refused:
            validate(compose_pretrain([*overrides, f"hydra.run.dir={tmp_path / 'run'}"]))
        if vocab_size == model_vocab:
            assert "CUDA GPU" in str(refused.value)  # past the vocabulary check, stopped by the machine
        else:
            message = f"model.vocab_size={model_vocab} is smaller than the tokenizer's {vocab_size}"
            assert message in str(refused.value)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.n_layers=4", "n_layers"),  # unknown key
        ("model.n_layer=four", "model.n_layer"),  # wrong type
        ("data.batch_size=1.5", "data.batch_size"),
        ("trainer.max_step=5", "max_step"),
        ("strategy.bucket_cap=3", "bucket_cap"),
        ("trainer.max_steps=ten", "trainer.max_steps"),  # generated from Trainer's signature: typed int
        ("strategy.async_checkpoint=maybe", "strategy.async_checkpoint"),
        ("callbacks.model_checkpoint.every_n_train_steps=x", "model_checkpoint.every_n_train_steps"),
        ("callbacks.model_checkpoint.save_lst=true", "save_lst"),
        ("logger.csv.flush_logs_every_n_steps=1.5", "logger.csv.flush_logs_every_n_steps"),
    ],
)
def test_schema_rejects_bad_keys_and_types_naming_the_key(override: str, key: str) -> None:
    with pytest.raises((ConfigCompositionException, ValidationError, ConfigKeyError)) as info:
        compose_pretrain([override])
    message = f"{info.value} {info.value.__cause__}"
    assert key in message


def test_unknown_group_option_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigCompositionException) as info:
        compose_pretrain(["model=gpt5"])
    assert "model/gpt5" in str(info.value) and "tiny" in str(info.value)


@pytest.mark.parametrize(
    ("schema_cls", "config_cls"),
    [(schema.ModelSchema, GPTConfig), (schema.DataSchema, DataConfig), (schema.OptimSchema, OptimConfig)],
)
def test_schemas_are_the_recipe_dataclasses(schema_cls: type, config_cls: type) -> None:
    """One definition per group: the schema's fields and defaults are the dataclass's, except the
    few the recipe overrides on purpose (required from a model file, the run's seed)."""
    overridden = {"vocab_size", "path", "seed", "lr", "warmup_steps"}
    schema_fields = {f.name: f for f in dataclasses.fields(schema_cls)}
    assert set(schema_fields) - {"_target_"} == {f.name for f in dataclasses.fields(config_cls)}
    assert schema_cls._target_ == f"{config_cls.__module__}.{config_cls.__name__}"
    for field in dataclasses.fields(config_cls):
        if field.name in overridden or field.default is dataclasses.MISSING:
            continue
        ours = schema_fields[field.name]
        value = ours.default if ours.default is not dataclasses.MISSING else ours.default_factory()  # type: ignore[misc]
        assert value == field.default or list(value) == list(field.default), field.name


@pytest.mark.parametrize("override", ["+optim.momentum=0.9", "+model.n_layers=4", "+data.shuffle=true"])
def test_a_key_added_to_a_generated_recipe_group_is_unknown(override: str) -> None:
    """The generated model/data/optim schemas keep the recipe's own key check: an added key is refused
    before any process starts (what `recipes.sbatch` runs), naming it."""
    from recipes.config.validation import ConfigError, check_keys

    with pytest.raises(ConfigError, match=r"unknown key\(s\): " + override[1:].split("=")[0]):
        check_keys(compose_pretrain([override]))


def test_a_tuple_field_keeps_its_member_type() -> None:
    """`optim.betas` (a `tuple[float, float]` of `OptimConfig`) is a list of floats in the schema: a
    wrong member fails at compose time, as with the hand-written schema before."""
    assert compose_pretrain(["optim.betas=[0.8,0.9]"]).optim.betas == [0.8, 0.9]
    with pytest.raises(ConfigCompositionException):
        compose_pretrain(["optim.betas=[a,0.9]"])


def test_node_aware_sharding_is_set_from_the_command_line_and_checked_before_launch() -> None:
    """`strategy.shard_group_size=auto` (one node's ranks) composes and builds; a size that does not
    divide cluster.nodes x trainer.devices is refused by the checks `recipes.sbatch` runs too."""
    from recipes.config.validation import ConfigError, check_keys

    cfg = compose_pretrain(["strategy=zero3", "strategy.shard_group_size=auto", "cluster.nodes=2"])
    check_keys(cfg)
    assert instantiate(cfg.strategy)._zero.options.shard_group_size == "auto"
    check_keys(compose_pretrain(["strategy.shard_group_size=2", "cluster.nodes=2", "trainer.devices=2"]))
    bad = compose_pretrain(["strategy.shard_group_size=3", "cluster.nodes=2", "trainer.devices=2"])
    with pytest.raises(
        ConfigError,
        match=r"strategy.shard_group_size=3 must divide the 4 data-parallel ranks.*\[1, 2, 4\].*nodes=2 x",
    ):
        check_keys(bad)
