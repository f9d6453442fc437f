"""Checks of a composed config that the schema cannot express, run before any process starts.

The schema (`recipes.config.schema`) already rejects unknown keys and wrong types at compose time, and
Hydra rejects unknown group options (`model=huge`) listing the valid ones. `check_keys` catches what
composition lets through without looking at data or machine (`recipes.sbatch` runs it too): keys added
with `+key=` to a recipe node, values left `???`, a hand-set `run_dir`, a `trainer.num_nodes` other than
`cluster.nodes` (what SLURM is asked for), and every Lightning `_target_` node (trainer, strategy, each
logger and callback, nested ones) against its class's signature (`recipes.config.signatures`: an argument
it does not take, with the closest valid names; a value outside its annotation's union or `Literal`
choices). `check_objects` builds the strategy, loggers and callbacks once, so a constructor's own check or
a missing package (`logger=wandb` without wandb, the loss plot without matplotlib) fails here. `validate`
then catches what needs the values together or the machine, asking the data source that `data.path`
designates (`recipes.data.sources`) for what it knows: a data path that matches nothing or holds no text
(or a .jsonl / .parquet without the text field), a prepared directory that is incomplete or too small, a
window longer than the model's context, token ids the model's vocabulary cannot cover (from the prepared
index's `max_token_id`; for a `.bin` by one pass over it), more devices than the machine has, a
`ckpt_path` with nothing to resume, a `parallelism.tensor` or `parallelism.pipeline` the strategy, model,
data or devices cannot split into (`recipes.config.parallelism`), and the value checks of the recipe
dataclasses. Each failure is a `ConfigError` whose message names the setting and what would be valid; the
entry point prints it and exits non-zero without touching earlier runs.

Optional packages fail here, never after training (`check_objects`, `data_vocab_size`, `check_data`):
everything the config asks for that imports a package only when first used - a logger's client (its
constructor only reads the package's metadata), the loss plot's matplotlib (imported by `LossPlot`'s
constructor), the tokenizer's library (a BPE is trained in `prepare_data` on one rank per node while
the others wait; a prepared directory's tokenizer is otherwise loaded once every process runs), the
parquet reader - is imported now, on every rank alike. The policy is to refuse, never to warn and
skip: each of these is an output or an input the config names (the loss plot is in the default
callbacks), a warning scrolls past in a multi-node log while the output silently goes missing, and
the message names the one override that goes without it (`callbacks.loss_plot=null`, another logger).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger, TensorBoardLogger, WandbLogger
from lightning_utilities.core.imports import RequirementCache
from omegaconf import DictConfig, OmegaConf

from recipes.config.parallelism import check_pipeline_parallel, check_pipeline_settings, check_tensor_parallel
from recipes.config.resolvers import slurm_nodes
from recipes.config.schema import RUN_DIR_DEFAULT, TRAINER_ARGS_FROM_GROUPS
from recipes.config.signatures import SIGNATURE_SCHEMA, ArgumentError, check_arguments
from recipes.data import Corpus, DataConfig, DataError, DataSource, TokenizerError, data_source
from recipes.training import GPTConfig, OptimConfig, newest_checkpoint


class ConfigError(ValueError):
    """A setting that cannot work; the message says which and what is valid."""


EXAMPLE_TARGETS = {
    "logger": "lightning.pytorch.loggers.MLFlowLogger",
    "callbacks": "lightning.pytorch.callbacks.LearningRateMonitor",
}


@dataclass(frozen=True)
class RecipeConfigs:
    """The validated recipe dataclasses, ready to build the model, data and optimizer."""

    model: GPTConfig
    data: DataConfig
    optim: OptimConfig
    source: DataSource
    """Where `data` reads its tokens, as checked (`recipes.data.sources`)."""
    tensor_parallel: int
    """`parallelism.tensor`, as checked (`recipes.config.parallelism`)."""
    pipeline_parallel: int = 1
    """`parallelism.pipeline`, as checked (`recipes.config.parallelism`)."""

    @property
    def corpus(self) -> Corpus | None:
        """The text corpus to prepare; None for a prepared directory or a `.bin`."""
        return self.source.corpus


def _build(node: DictConfig, **kwargs: Any) -> Any:
    """Instantiate one `_target_` node, turning its constructor's ValueError into a ConfigError."""
    try:
        return instantiate(node, _convert_="all", **kwargs)  # plain lists, not ListConfig, in dataclasses
    except InstantiationException as error:
        raise ConfigError(str(error.__cause__ or error)) from error


def missing_package(setting: str, error: ImportError, instead: str) -> ConfigError:
    """The error for a package that `setting` needs and that cannot be imported."""
    package = (error.name or "?").split(".")[0]
    return ConfigError(
        f"{setting} needs the Python package {package!r}, which cannot be imported here ({error}); "
        f"install it (`pip install -e '.[recipes]'`), or {instead}"
    )


def data_vocab_size(source: DataSource) -> int:
    """Vocabulary of the configured tokenizer: a prepared directory's index, or the tokenizer itself.

    The tokenizer's library is imported here: `data.tokenizer=bpe` trains with `tokenizers` only in
    `prepare_data`, and a prepared directory's tokenizer (`data.tokenizer=null`) is loaded only once
    every process has started.
    """
    data = source.config
    setting = (
        f"data.tokenizer={data.tokenizer}" if data.tokenizer else f"data.path={data.path!r} (its tokenizer)"
    )
    try:
        vocab_size = source.vocab_size()
        if data.tokenizer == "bpe":
            importlib.import_module("tokenizers")
        elif data.tokenizer is None:
            source.declared_tokenizer()
        return vocab_size
    except ImportError as error:
        raise missing_package(setting, error, "choose data.tokenizer=byte") from error
    except TokenizerError as error:
        raise ConfigError(f"data.{error}") from error
    except DataError as error:
        raise ConfigError(str(error)) from error


def check_vocabulary(source: DataSource, data_vocab: int, model_vocab: int) -> None:
    """Refuse token ids the model's embedding cannot look up (on CUDA: a device-side assert)."""
    data = source.config
    if model_vocab < data_vocab:
        raise ConfigError(
            f"model.vocab_size={model_vocab} is smaller than the tokenizer's {data_vocab} "
            f"(data.tokenizer={data.tokenizer}); set model.vocab_size>={data_vocab} or null"
        )
    top = source.max_token_id(data_vocab)
    if top >= model_vocab:
        raise ConfigError(
            f"data.path={data.path!r} holds token id {top}, outside model.vocab_size={model_vocab} "
            f"(tokenizer vocabulary {data_vocab}): these tokens were made by another tokenizer; set "
            f"model.vocab_size>={top + 1} and the matching data.tokenizer"
        )


def check_data(source: DataSource, vocab_size: int) -> None:
    """The source's own checks (files, sizes, token counts; `recipes.data.sources`) as `ConfigError`."""
    try:
        source.check(vocab_size)
    except ImportError as error:  # a reader of the files' format (.parquet: pyarrow)
        raise missing_package(
            f"data.path={source.config.path!r}", error, "give text or .jsonl files"
        ) from error
    except DataError as error:
        raise ConfigError(str(error)) from error


def check_devices(accelerator: str, devices: Any) -> None:
    """Refuse a `trainer.devices` count above what this machine offers for `trainer.accelerator`."""
    if accelerator in ("gpu", "cuda"):
        import torch

        available, kind = torch.cuda.device_count(), "CUDA GPUs"
        if available == 0:
            raise ConfigError(
                f"trainer.accelerator={accelerator} but no CUDA GPU is visible; use trainer=cpu"
            )
    elif accelerator == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        available, kind = cores or 1, "CPU cores"
    else:
        return
    requested = len(devices) if isinstance(devices, list | tuple) else devices
    if isinstance(requested, int) and requested > available:
        raise ConfigError(
            f"trainer.devices={requested} but this machine has {available} {kind}; "
            f"use trainer.devices=1..{available} (or 'auto')"
        )


def check_slurm_launch(env: Mapping[str, str] | None = None) -> None:
    """Inside an sbatch allocation of several tasks, refuse to start outside `srun`.

    Lightning would take SLURM's task count as the world size and wait forever for ranks that were
    never started. (Under `srun`, Lightning itself checks tasks per node against `trainer.devices`.)
    """
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" not in env or env.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return
    ntasks = int(env.get("SLURM_NTASKS", "1"))
    if ntasks > 1 and "SLURM_STEP_ID" not in env:
        raise ConfigError(
            f"running inside SLURM job {env['SLURM_JOB_ID']} with {ntasks} tasks but not through srun: "
            "start the recipe with `srun python -m recipes.pretrain ...` (python -m recipes.sbatch writes "
            "such a script)"
        )


def check_ckpt_path(ckpt_path: str | None, run_dir: Path, run_name: str) -> None:
    """`last` needs a complete checkpoint in this run's checkpoint series (the newest one is resumed,
    whichever callback wrote it); any other value must be an existing path."""
    if ckpt_path is None:
        return
    if ckpt_path == "last":
        if newest_checkpoint(run_dir / "checkpoints") is None:  # what RunCheckpoint resumes from
            raise ConfigError(
                f"ckpt_path=last: no checkpoint in {run_dir / 'checkpoints'} (none, or none completely "
                f"written; run_name={run_name}). "
                "Run once without ckpt_path, or set run_name to an earlier run's name."
            )
    elif not Path(ckpt_path).expanduser().exists():
        raise ConfigError(f"ckpt_path={ckpt_path!r} does not exist; give a checkpoint path, 'last' or null")


def check_strategy(strategy: DictConfig) -> None:
    """The strategy's `_target_` must be importable (the ZeRO configs need `lightning_zero`)."""
    target = str(strategy.get("_target_", ""))
    module_name = target.rpartition(".")[0]
    try:
        importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(
            f"strategy._target_={target} cannot be imported ({error}); "
            "install the library with `pip install -e .` or choose strategy=ddp"
        ) from error


def unknown_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Keys added with Hydra's `+key=value` to a node typed by a recipe dataclass (model, data, optim,
    cluster, sample, the root). Nodes typed from a signature (`recipes.config.signatures`) and the open
    `logger` and `callbacks` entries are checked against their class instead (`check_target_nodes`)."""
    found: list[str] = []
    node_type = OmegaConf.get_type(node)
    if getattr(node_type, SIGNATURE_SCHEMA, False) or "_target_" in node and node_type is dict:
        return found
    allowed = {f.name for f in dataclasses.fields(node_type)} if dataclasses.is_dataclass(node_type) else None
    for key in node.keys():
        full_key = f"{prefix}{key}"
        if allowed is not None and key not in allowed:
            found.append(full_key)
        if OmegaConf.is_missing(node, key):
            continue
        child = node[key]
        if isinstance(child, DictConfig):
            found.extend(unknown_keys(child, prefix=f"{full_key}."))
    return found


def check_run_dir(cfg: DictConfig) -> None:
    """`run_dir` follows Hydra's job directory; setting it directly would leave Hydra's elsewhere."""
    value = OmegaConf.to_container(cfg, resolve=False)["run_dir"]  # type: ignore[index,call-overload]
    if value != RUN_DIR_DEFAULT:
        raise ConfigError(
            f"run_dir={value}: the run directory is the one Hydra runs the job in; set "
            f"hydra.run.dir={value} instead (hydra.sweep.dir with -m), or output_root= / run_name="
        )


def check_target_nodes(cfg: DictConfig) -> None:
    """Every `_target_` node of the Lightning side against its class's signature (`signatures`)."""
    for name in TRAINER_ARGS_FROM_GROUPS:
        if name in cfg.trainer:
            raise ConfigError(f"trainer.{name} is set by {TRAINER_ARGS_FROM_GROUPS[name]}")
    nodes = {"trainer": cfg.trainer, "strategy": cfg.strategy}
    for group in ("logger", "callbacks"):
        for name, node in cfg[group].items():
            if node is None:
                continue
            if not isinstance(node, DictConfig) or "_target_" not in node:
                raise ConfigError(
                    f"{group}.{name} has no _target_: name its class, e.g. "
                    f"+{group}.{name}._target_={EXAMPLE_TARGETS[group]}"
                )
            nodes[f"{group}.{name}"] = node
    for key, node in nodes.items():
        try:
            check_arguments(OmegaConf.to_container(node, resolve=True), key)  # type: ignore[arg-type]
        except ArgumentError as error:
            raise ConfigError(str(error)) from error


def check_keys(cfg: DictConfig) -> None:
    """What composition lets through: `+key=` additions, values left `???`, a `run_dir` set by hand, a
    `trainer.num_nodes` that disagrees with `cluster.nodes`, and the arguments of every Lightning object.
    Needs no data and no machine (`recipes.sbatch` too).

    Raises:
        ConfigError: naming the key and what would be valid.
    """
    extra = unknown_keys(cfg)
    if extra:
        raise ConfigError(f"unknown key(s): {', '.join(extra)}; see `python -m recipes.pretrain --cfg job`")
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(
            f"missing mandatory value(s): {', '.join(missing)}; set them as key=value overrides"
        )
    check_run_dir(cfg)
    try:  # one number of nodes: SLURM's (`recipes.sbatch`, the submitit launcher) is cluster.nodes
        slurm_nodes(cfg.cluster.nodes, cfg.trainer.num_nodes)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    if cfg.cluster.peer_failure_requeues < 0:
        raise ConfigError(
            f"cluster.peer_failure_requeues={cfg.cluster.peer_failure_requeues}: expected a number of "
            "requeues >= 0 (0: a job whose rank died or hung is not requeued)"
        )
    if cfg.parallelism.tensor < 1:
        raise ConfigError(
            f"parallelism.tensor={cfg.parallelism.tensor} must be >= 1 (ranks splitting each layer; 1: none)"
        )
    try:
        check_pipeline_settings(cfg)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    check_strategy(cfg.strategy)
    check_shard_group(cfg)
    check_target_nodes(cfg)


def check_shard_group(cfg: DictConfig) -> None:
    """`strategy.shard_group_size` (node-aware sharding) must split the job's ranks, `cluster.nodes`
    times `trainer.devices`, into equal groups; checked before anything is queued or launched."""
    size = cfg.strategy.get("shard_group_size")
    devices = cfg.trainer.devices
    if not isinstance(size, int) or isinstance(size, bool) or not isinstance(devices, int) or size < 1:
        return  # None, "auto" (one node), or a bad value the strategy's constructor names
    from lightning_zero.layout.dims import ParallelDims  # checked importable by check_strategy

    try:
        ParallelDims.of(cfg.cluster.nodes * devices, size)
    except ValueError as error:
        raise ConfigError(
            f"strategy.{error} (the job: cluster.nodes={cfg.cluster.nodes} x trainer.devices={devices})"
        ) from error


def _build_named(node: DictConfig, key: str) -> Any:
    """Instantiate the `_target_` node at `key`; a constructor's error becomes a ConfigError naming it."""
    try:
        return instantiate(node)
    except InstantiationException as error:
        cause = error.__cause__ or error
        raise ConfigError(f"{key} ({node._target_}): {cause}{hint(key, cause)}") from error


def hint(key: str, cause: BaseException) -> str:
    """How to go on without the package a constructor found missing (nothing for other errors)."""
    if not isinstance(cause, ImportError):
        return ""
    group = key.split(".")[0]
    instead = f"leave it out with {key}=null" if group == "callbacks" else f"choose another {group}"
    return f"; install it, or {instead}"


def logger_packages(logger: Logger) -> tuple[str, ...]:
    """Modules a Lightning logger imports only at its first log (its constructor reads package metadata
    alone, so a package installed but broken, or shadowed, passes it)."""
    if isinstance(logger, WandbLogger):
        return ("wandb",)
    if isinstance(logger, TensorBoardLogger):  # as Lightning chooses: tensorboard's writer, else tensorboardX
        return ("torch.utils.tensorboard",) if RequirementCache("tensorboard") else ("tensorboardX",)
    return ()


def check_objects(cfg: DictConfig) -> None:
    """Build the strategy, every logger and every callback once, so a bad value or a package that is
    missing (`logger=wandb` without wandb, the loss plot without matplotlib) fails here, before any
    process starts, naming its key; then import what each logger imports at its first log. Their
    constructors only record settings (files and connections come at fit time)."""
    _build_named(cfg.strategy, "strategy")
    for group, base in (("logger", Logger), ("callbacks", Callback)):
        for name, node in cfg[group].items():
            if node is None:
                continue
            built = _build_named(node, f"{group}.{name}")
            if not isinstance(built, base):
                kind = f"a Lightning {base.__name__}"
                raise ConfigError(f"{group}.{name}._target_={node._target_} is not {kind}")
            for module in logger_packages(built) if group == "logger" else ():
                try:
                    importlib.import_module(module)
                except ImportError as error:
                    raise missing_package(
                        f"{group}.{name} ({node._target_})", error, "choose another logger"
                    ) from error


def validate(cfg: DictConfig) -> RecipeConfigs:
    """Check the composed config; return the recipe dataclasses it describes.

    Raises:
        ConfigError: with a message naming the offending setting.
    """
    check_keys(cfg)
    check_objects(cfg)
    data: DataConfig = _build(cfg.data)
    source = data_source(data)
    data_vocab = data_vocab_size(source)
    model_vocab = cfg.model.vocab_size if cfg.model.vocab_size is not None else data_vocab
    model: GPTConfig = _build(cfg.model, vocab_size=model_vocab)
    optim: OptimConfig = _build(cfg.optim)
    check_data(source, data_vocab)
    check_vocabulary(source, data_vocab, model.vocab_size)
    if data.seq_len > model.max_seq_len:
        raise ConfigError(
            f"data.seq_len={data.seq_len} exceeds model.max_seq_len={model.max_seq_len}; "
            f"use data.seq_len<={model.max_seq_len} or a larger model.max_seq_len"
        )
    if model.compile_blocks and cfg.strategy.get("overlap_param_gather", False):
        raise ConfigError(
            "model.compile_blocks=true with strategy.overlap_param_gather=true: the gather waits are "
            "hooks on layers inside the compiled block body; use one of the two"
        )
    try:
        check_tensor_parallel(cfg, model, data)
        check_pipeline_parallel(cfg, model, data)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    check_devices(str(cfg.trainer.accelerator), cfg.trainer.devices)
    check_slurm_launch()
    check_ckpt_path(cfg.ckpt_path, Path(cfg.run_dir), cfg.run_name)
    return RecipeConfigs(
        model=model,
        data=data,
        optim=optim,
        source=source,
        tensor_parallel=cfg.parallelism.tensor,
        pipeline_parallel=cfg.parallelism.pipeline,
    )
