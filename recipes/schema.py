"""Typed schema of `conf/pretrain.yaml`, registered in Hydra's ConfigStore.

`conf/pretrain.yaml` lists `pretrain_schema` first in its defaults, so every YAML file and command-line
override is merged into these dataclasses: an unknown key (`model.n_layers=4`) or a wrong type
(`data.batch_size=big`) fails at compose time, naming the full key, before any process or run
directory content is created. Strategies take different arguments, so each strategy file pulls its own
schema (`schema/strategy/ddp`, `schema/strategy/zero`) into its package with `@_here_`.

Objects are built with `hydra.utils.instantiate` from the `_target_` fields: `recipes.model.GPTConfig`,
`recipes.data.DataConfig`, `recipes.module.OptimConfig`, the Lightning `Trainer`, strategy, loggers and
callbacks. The schemas of the three recipe configs mirror those dataclasses field for field (a test
checks it); their value checks stay in the dataclasses' `__post_init__`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class ModelSchema:
    _target_: str = "recipes.model.GPTConfig"
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


@dataclass
class DataSchema:
    _target_: str = "recipes.data.DataConfig"
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
    _target_: str = "recipes.module.OptimConfig"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    decay_embeddings: bool = False


@dataclass
class TrainerSchema:
    _target_: str = "lightning.pytorch.Trainer"
    accelerator: str = "cpu"
    devices: Any = 1  # int, list of ids, or "auto"
    num_nodes: int = 1
    precision: Any = "32-true"
    max_steps: int = 100
    max_epochs: int = -1
    val_check_interval: Any = 50  # int: every N training batches; float: fraction of an epoch
    check_val_every_n_epoch: int | None = None
    limit_val_batches: Any = 10
    num_sanity_val_steps: int = 0
    log_every_n_steps: int = 10
    gradient_clip_val: float | None = 1.0
    accumulate_grad_batches: int = 1
    enable_progress_bar: bool = True
    enable_model_summary: bool = True
    deterministic: bool = False
    default_root_dir: str = "${run_dir}"


@dataclass
class DDPStrategySchema:
    _target_: str = "lightning.pytorch.strategies.DDPStrategy"
    process_group_backend: str | None = None  # None: gloo on CPU, nccl on GPU
    find_unused_parameters: bool = False


@dataclass
class ZeroStrategySchema:
    _target_: str = "lightning_zero.ZeroStrategy"
    stage: int = 2
    bucket_cap_mb: float = 25.0
    overlap_comm: bool = True


@dataclass
class LoggerSchema:
    _target_: str = MISSING
    save_dir: str = "${run_dir}"
    name: str = "logs"
    version: str | None = None  # None: the next free version_N, so a resumed run keeps older logs


@dataclass
class CheckpointSchema:
    _target_: str = "lightning.pytorch.callbacks.ModelCheckpoint"
    dirpath: str = "${run_dir}/checkpoints"
    filename: str = "step{step:06d}"
    save_last: bool = True
    save_top_k: int = 1
    every_n_train_steps: int | None = None
    auto_insert_metric_name: bool = False


@dataclass
class ProgressBarSchema:
    _target_: str = "recipes.progress.RefreshProgressBar"
    refresh_rate: int = 10
    show: list[str] = field(default_factory=lambda: ["train/loss", "tokens_per_s"])


@dataclass
class ThroughputSchema:
    _target_: str = "recipes.throughput.TokenThroughput"
    window: int = 2
    peak_flops_per_device: float | None = "${peak_flops_per_device}"  # type: ignore[assignment]


@dataclass
class LossPlotSchema:
    _target_: str = "recipes.plot.LossPlot"
    path: str | None = "${run_dir}/loss.png"
    train_key: str = "train/loss"
    val_key: str = "val/loss"


@dataclass
class TrainedSamplesSchema:
    _target_: str = "recipes.resume.TrainedSamples"
    dirpath: str = "${run_dir}/trained_samples"


@dataclass
class CallbacksSchema:
    model_checkpoint: CheckpointSchema | None = None
    progress_bar: ProgressBarSchema | None = None
    throughput: ThroughputSchema | None = None
    loss_plot: LossPlotSchema | None = None
    trained_samples: TrainedSamplesSchema | None = None  # set by callbacks=trained_samples


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


@dataclass
class SampleSchema:
    prompt: str = "def "
    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int | None = 40


@dataclass
class PretrainSchema:
    run_name: str = "cpu_demo"
    output_root: str = "outputs"
    run_dir: str = "${output_root}/${run_name}"
    seed: int = 1234
    ckpt_path: str | None = None
    peak_flops_per_device: float | None = None
    model: ModelSchema = MISSING
    data: DataSchema = MISSING
    optim: OptimSchema = field(default_factory=OptimSchema)
    trainer: TrainerSchema = MISSING
    strategy: Any = MISSING
    logger: dict[str, LoggerSchema] = field(default_factory=dict)
    callbacks: CallbacksSchema = field(default_factory=CallbacksSchema)
    cluster: ClusterSchema = MISSING
    sample: SampleSchema = field(default_factory=SampleSchema)


def register_schema() -> None:
    """Store the schemas under the names the YAML defaults lists refer to (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="pretrain_schema", node=PretrainSchema)
    store.store(group="schema/strategy", name="ddp", node=DDPStrategySchema)
    store.store(group="schema/strategy", name="zero", node=ZeroStrategySchema)


register_schema()
