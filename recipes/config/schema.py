"""Typed schema of `conf/pretrain.yaml`, registered in Hydra's ConfigStore.

`conf/pretrain.yaml` lists `pretrain_schema` first in its defaults, so every YAML file and command-line
override is merged into these dataclasses: an unknown key (`model.n_layers=4`) or a wrong type
(`data.batch_size=big`) fails at compose time, naming the full key, before any process or run
directory content is created.

Open where users add things on purpose, checked all the same. The recipe's `model`, `data` and `optim`
nodes are generated from `GPTConfig`, `DataConfig` and `OptimConfig` (one definition per group: names,
types and defaults are the dataclasses'; the few fields the recipe requires from a model file or takes
from the run are overridden by name; value checks stay in their `__post_init__`); `cluster` and `sample`
exist only here. The Lightning side is generated from constructor signatures
(`recipes.config.signatures`) too, so it offers every argument of the installed version: `trainer` is
every `Trainer` argument except the three the recipe fills from groups (`TRAINER_ARGS_FROM_GROUPS`); each
strategy file pulls its class's schema into its package with `@_here_`, and the shipped callback and
logger files pull theirs into their entries. `logger` and `callbacks` are open mappings:
`+callbacks.lr_monitor._target_=...` adds any callback, and `recipes.config.validation` checks such
additions (and `+key=` additions to generated nodes) against their class's signature before any process
starts."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning.pytorch as pl
from hydra.core.config_store import ConfigStore
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.strategies import DDPStrategy
from omegaconf import MISSING

import recipes.config.resolvers  # noqa: F401  (registers the recipe.* resolvers the YAML files use)
from recipes.config.signatures import schema_for
from recipes.data.config import DataConfig
from recipes.data.resume import TrainedSamples
from recipes.training import LossPlot, RefreshProgressBar, RunCheckpoint, StepTrace, TokenThroughput
from recipes.training.model_config import GPTConfig
from recipes.training.module import OptimConfig

TRAINER_ARGS_FROM_GROUPS = {
    "strategy": "the strategy group: strategy=zero|zero1|zero2|ddp, strategy.<argument>=...",
    "logger": "the logger group: logger=csv|tensorboard|wandb|many, ~logger, +logger.<name>._target_=...",
    "callbacks": "the callbacks group: callbacks.<name>=null, +callbacks.<name>._target_=...",
}
"""Trainer arguments the recipe fills from groups of their own (so they are not in `trainer`)."""
RUN_DIR_DEFAULT = "${recipe.job_dir:}"
TrainerSchema = schema_for(pl.Trainer, exclude=TRAINER_ARGS_FROM_GROUPS)


def _zero_strategy_schema() -> Any:
    """ZeroStrategy's schema; an open node when `lightning_zero` is not importable (validation says so)."""
    try:
        from lightning_zero import ZeroStrategy
    except ImportError:
        return {}
    return schema_for(ZeroStrategy)


GROUP_ENTRY_SCHEMAS: dict[str, dict[str, Any]] = {
    "strategy": {"ddp": schema_for(DDPStrategy), "zero": _zero_strategy_schema()},
    "callbacks": {
        "model_checkpoint": schema_for(RunCheckpoint),
        "progress_bar": schema_for(RefreshProgressBar),
        "throughput": schema_for(TokenThroughput),
        "loss_plot": schema_for(LossPlot),
        "trained_samples": schema_for(TrainedSamples),
        "ema": schema_for(EMAWeightAveraging),
        "trace": schema_for(StepTrace),
    },
    "logger": {
        "csv": schema_for(CSVLogger),
        "tensorboard": schema_for(TensorBoardLogger),
        "wandb": schema_for(WandbLogger),
    },
}
"""Schemas the group files pull into their entries (`- /schema/<group>/<name>@<entry>`)."""


ModelSchema = schema_for(
    GPTConfig,
    overrides={"vocab_size": (Optional[int], field(default=None))},  # noqa: UP045  (None: the tokenizer's)
    keys_from_signature=False,
)
DataSchema = schema_for(
    DataConfig,
    overrides={
        "path": (Optional[str], field(default=MISSING)),  # noqa: UP045  (a YAML `???` must be able to win)
        "seed": (int, field(default="${seed}")),  # the run's seed
    },
    keys_from_signature=False,
)
OptimSchema = schema_for(
    OptimConfig,
    overrides={"lr": (float, field(default=MISSING)), "warmup_steps": (int, field(default=MISSING))},
    keys_from_signature=False,
)  # from the model file: they depend on the model's size


@dataclass
class ClusterSchema:
    name: str = "local"
    nodes: int = 1
    gpus_per_node: int | None = None
    partition: str | None = MISSING
    account: str | None = None
    time: str | None = None  # SLURM time limit, "HH:MM:SS" or "D-HH:MM:SS"
    cpus_per_task: int | None = None  # SLURM --cpus-per-task (data loader workers + the rank itself)
    sbatch_extra: list[str] = field(default_factory=list)  # more #SBATCH lines, e.g. ["--exclusive"]
    peer_failure_requeues: int = 3  # SLURM: requeues of a job after a rank died or hung (0: none)


def strategy_default(argument: str) -> Any:
    """`ZeroStrategy`'s own default of `argument` (its one source)."""
    from lightning_zero import ZeroStrategy

    return inspect.signature(ZeroStrategy).parameters[argument].default


@dataclass
class ParallelismSchema:
    """Model-parallel dimensions of the run, beside the data-parallel one (the rest of the ranks). The
    lightning-zero strategy files pass each on to its `ZeroStrategy` argument (`conf/strategy/zero*.yaml`);
    the defaults are that argument's."""

    tensor: int = field(default_factory=lambda: strategy_default("tensor_parallel_size"))
    """Tensor (+ sequence) parallel ranks splitting each layer: consecutive ranks of one node. The
    lightning-zero strategy files pass it as `tensor_parallel_size`; the module applies
    `recipes.training.tensor_parallel`'s plan over them (docs/recipes.md#tensor-parallelism)."""
    pipeline: int = field(default_factory=lambda: strategy_default("pipeline_parallel_size"))
    """Pipeline stages (`pipeline_parallel_size`): the model's blocks (`PretrainModule.pipeline_layers`:
    the embedding with the first, the final norm and the head with the last) cut into `pipeline` stages
    of consecutive blocks, each on `devices x nodes / pipeline` ranks
    (docs/recipes.md#pipeline-parallelism)."""
    microbatches: int | None = field(default_factory=lambda: strategy_default("pipeline_microbatches"))
    """Micro-batches each rank's batch of `data.batch_size` windows is cut into (`pipeline_microbatches`,
    which `data.batch_size` must divide); null: one per stage."""
    schedule: str = field(default_factory=lambda: strategy_default("pipeline_schedule"))
    """`gpipe`, `1f1b` or `interleaved_1f1b` (`pipeline_schedule`)."""
    virtual_stages: int = field(default_factory=lambda: strategy_default("pipeline_virtual_stages"))
    """Stages per rank (`pipeline_virtual_stages`): 2 or more with `interleaved_1f1b`, 1 otherwise."""


@dataclass
class SampleSchema:
    prompt: str = "def "
    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int | None = 40


@dataclass
class PretrainSchema:
    run_name: str = "${recipe.run_name:}"  # cpu_demo for the demo's groups, else <model>-<data>-<trainer>
    output_root: str = "outputs"
    run_dir: str = RUN_DIR_DEFAULT  # Hydra's job directory (hydra.run.dir); not set directly
    seed: int = 1234
    ckpt_path: str | None = None
    peak_flops_per_device: float | None = None
    model: ModelSchema = MISSING
    data: DataSchema = MISSING
    optim: OptimSchema = field(default_factory=OptimSchema)
    trainer: TrainerSchema = MISSING  # type: ignore[valid-type]  # generated: every Trainer argument
    strategy: Any = MISSING  # each strategy file pulls its own schema/strategy/<name>
    logger: dict[str, Any] = field(default_factory=dict)  # any Logger by _target_
    callbacks: dict[str, Any] = field(default_factory=dict)  # any Callback by _target_; null: left out
    cluster: ClusterSchema = MISSING
    parallelism: ParallelismSchema = field(default_factory=ParallelismSchema)
    sample: SampleSchema = field(default_factory=SampleSchema)


def register_schema() -> None:
    """Store the schemas under the names the YAML defaults lists refer to (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="pretrain_schema", node=PretrainSchema)
    for group, schemas in GROUP_ENTRY_SCHEMAS.items():
        for name, node in schemas.items():
            store.store(group=f"schema/{group}", name=name, node=node)


register_schema()
