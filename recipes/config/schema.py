"""Typed schema of `conf/pretrain.yaml`, registered in Hydra's ConfigStore.

`conf/pretrain.yaml` lists `pretrain_schema` first in its defaults, so every YAML file and command-line
override is merged into these dataclasses: an unknown key (`model.n_layers=4`) or a wrong type
(`data.batch_size=big`) fails at compose time, naming the full key, before any process or run
directory content is created.

Open where users add things on purpose, checked all the same. The recipe's own nodes (model, data,
optim, cluster, sample) are hand-written dataclasses that mirror `GPTConfig`, `DataConfig` and
`OptimConfig` field for field (a test checks it; value checks stay in their `__post_init__`). The
Lightning side is generated from constructor signatures (`recipes.config.signatures`), so it offers every
argument of the installed version: `trainer` is every `Trainer` argument except the three the recipe
fills from groups (`TRAINER_ARGS_FROM_GROUPS`); each strategy file pulls its class's schema into its
package with `@_here_`, and the shipped callback and logger files pull theirs into their entries.
`logger` and `callbacks` are open mappings: `+callbacks.lr_monitor._target_=...` adds any callback, and
`recipes.config.validation` checks such additions (and `+key=` additions to generated nodes) against their
class's signature before any process starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
from hydra.core.config_store import ConfigStore
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.strategies import DDPStrategy
from omegaconf import MISSING

import recipes.config.resolvers  # noqa: F401  (registers the recipe.* resolvers the YAML files use)
from recipes.config.signatures import schema_for
from recipes.data.resume import TrainedSamples
from recipes.training import LossPlot, RefreshProgressBar, RunCheckpoint, TokenThroughput

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
    },
    "logger": {
        "csv": schema_for(CSVLogger),
        "tensorboard": schema_for(TensorBoardLogger),
        "wandb": schema_for(WandbLogger),
    },
}
"""Schemas the group files pull into their entries (`- /schema/<group>/<name>@<entry>`)."""


@dataclass
class ModelSchema:
    _target_: str = "recipes.training.model_config.GPTConfig"
    vocab_size: int | None = None  # None: the tokenizer's vocabulary size
    max_seq_len: int = MISSING
    n_layer: int = MISSING
    n_head: int = MISSING
    d_model: int = MISSING
    n_kv_head: int | None = None
    mlp_hidden: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    activation_checkpointing: bool = False
    init_from: str | None = None  # a Hugging Face Llama directory to start from (docs/recipes.md)
    compile_blocks: bool = False
    compile_backend: str = "inductor"  # inductor | aot_eager | eager (checked by GPTConfig)


@dataclass
class DataSchema:
    _target_: str = "recipes.data.config.DataConfig"
    path: str | None = MISSING  # MISSING, not None: a YAML `???` cannot override a default when merged
    tokenizer: str | None = "byte"  # byte | bpe | tokenizer file; null: a prepared directory's own
    eos_token: str | None = None
    text_field: str = "text"
    bpe_vocab_size: int = 4096
    seq_len: int = 256
    batch_size: int = 16
    val_fraction: float = 0.05
    max_corpus_mb: float = 4.0
    cache_dir: str = "~/.cache/lightning-zero"
    num_workers: int = 0
    seed: int = "${seed}"  # type: ignore[assignment]  # interpolation, resolved to an int


@dataclass
class OptimSchema:
    _target_: str = "recipes.training.module.OptimConfig"
    lr: float = MISSING  # from the model file: it depends on the model's size
    min_lr_ratio: float = 0.1
    warmup_steps: int = MISSING  # from the model file
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    decay_embeddings: bool = False


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
    sample: SampleSchema = field(default_factory=SampleSchema)


def register_schema() -> None:
    """Store the schemas under the names the YAML defaults lists refer to (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="pretrain_schema", node=PretrainSchema)
    for group, schemas in GROUP_ENTRY_SCHEMAS.items():
        for name, node in schemas.items():
            store.store(group=f"schema/{group}", name=name, node=node)


register_schema()
