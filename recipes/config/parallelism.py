"""`parallelism.tensor=T` and `parallelism.pipeline=P` checked against the strategy, the model, the data
and the machine before any process starts (`recipes.config.validation` calls `check_pipeline_settings`
among the keys' checks, before the strategy is built, then `check_tensor_parallel` and
`check_pipeline_parallel`).

One setting: `parallelism.tensor` reaches the strategy as `tensor_parallel_size` by interpolation in
the lightning-zero strategy files (`conf/strategy/zero*.yaml`), so a strategy whose
`tensor_parallel_size` differs (set by hand, or a strategy file without the interpolation) is
refused rather than left to disagree with the model's plan. Under `T > 1`, every refusal names the
setting and the value it needs:

  * a strategy without tensor parallelism (`strategy=ddp`);
  * `T` not dividing `model.n_head`, the key/value heads, the MLP width or the vocabulary
    (`GPTConfig.check_tensor_parallel`: each rank keeps whole heads and equal slices);
  * `T` not dividing `data.seq_len` (sequence parallelism gives each rank `seq_len / T` positions
    of the norms' activations) or `trainer.devices` (a tensor-parallel group is `T` consecutive
    ranks of one node);
  * `model.compile_blocks`: a compiled block body over `DTensor` activations is not tested here.

Pipeline parallelism, likewise one setting per strategy argument (`parallelism.pipeline`,
`.microbatches`, `.schedule`, `.virtual_stages` reach `pipeline_parallel_size`, `pipeline_microbatches`,
`pipeline_schedule`, `pipeline_virtual_stages`). Refused, naming the setting and what would do:

  * a value out of range, a schedule torch does not have, virtual stages that do not match the
    schedule (`interleaved_1f1b` needs 2 or more, the others 1), and any of them set without
    `parallelism.pipeline > 1`, where they would be ignored;
  * under `P > 1`: a strategy without a pipeline (`strategy=ddp`); `P x T` not dividing the job's ranks
    (`cluster.nodes x trainer.devices`: every stage gets as many); the micro-batches (`P` when null) not
    dividing `data.batch_size`, the batch each rank cuts into them; fewer of the model's blocks
    (`model.n_layer`: the stages hold equal numbers of them, the embedding with the first, the final
    norm and the head with the last) than stages (`P x V`); `model.tie_embeddings=true` (the embedding
    of the first stage and the head of the last would share a tensor); `trainer.precision=16-mixed` (its
    loss scaler would have to run inside the schedule); `strategy.sharded_checkpoint=false` with
    checkpoints on (the recipe's `callbacks.model_checkpoint`, Lightning's default one when
    `trainer.enable_checkpointing`, or a `ckpt_path`): a stage holds only its layers, so the strategy
    writes and reads sharded directories only;
  * under `P > 1`, what the recipe has not tested with a pipeline yet: `model.compile_blocks`,
    `model.init_from`.

The recipe's checkpoints run under a pipeline as without one: `RunCheckpoint` saves the series through
the strategy (every stage its own files in one directory), the data position (a function of the
optimizer's step count and the data-parallel layout, the same on every stage's ranks) is saved once
with the trainer's state, and a run resumes in the same layout or another (`P=2 -> P=1`), tested in
`tests/recipes/test_pipeline_recipe.py`.
"""

from __future__ import annotations

from omegaconf import DictConfig

from recipes.config.schema import strategy_default
from recipes.data import DataConfig
from recipes.training import GPTConfig

STRATEGY_ARGUMENT = "tensor_parallel_size"
PIPELINE_ARGUMENTS = {
    "pipeline": "pipeline_parallel_size",
    "microbatches": "pipeline_microbatches",
    "schedule": "pipeline_schedule",
    "virtual_stages": "pipeline_virtual_stages",
}
"""Each `parallelism.<key>` of the pipeline and the `ZeroStrategy` argument it reaches."""


def check_tensor_parallel(cfg: DictConfig, model: GPTConfig, data: DataConfig) -> None:
    """Refuse a `parallelism.tensor` this run cannot train with (see the module docstring).

    Raises:
        ValueError: naming the setting and what would be valid (`validate` raises it as a `ConfigError`).
    """
    tensor = cfg.parallelism.tensor
    strategy = cfg.strategy
    if STRATEGY_ARGUMENT not in strategy:
        if tensor > 1:
            raise ValueError(
                f"parallelism.tensor={tensor} needs a lightning-zero strategy (strategy=zero|zero1|zero2|"
                f"zero3); strategy._target_={strategy.get('_target_')} has no tensor parallelism"
            )
        return
    if strategy[STRATEGY_ARGUMENT] != tensor:
        raise ValueError(
            f"strategy.{STRATEGY_ARGUMENT}={strategy[STRATEGY_ARGUMENT]} differs from parallelism.tensor="
            f"{tensor}: set parallelism.tensor={strategy[STRATEGY_ARGUMENT]} instead (the strategy files "
            f"take {STRATEGY_ARGUMENT} from it; the model's plan follows the same value)"
        )
    model.check_tensor_parallel(tensor)
    if tensor == 1:
        return
    devices = cfg.trainer.devices
    if isinstance(devices, int) and devices % tensor != 0:
        raise ValueError(
            f"parallelism.tensor={tensor} does not divide trainer.devices={devices}: a tensor-parallel "
            f"group is {tensor} ranks of one node; use trainer.devices={tensor}, {2 * tensor}, ..."
        )
    if data.seq_len % tensor != 0:
        raise ValueError(
            f"parallelism.tensor={tensor} does not divide data.seq_len={data.seq_len}: sequence "
            f"parallelism gives each rank data.seq_len / {tensor} positions; use a multiple of {tensor}"
        )
    if model.compile_blocks:
        raise ValueError(
            f"model.compile_blocks=true with parallelism.tensor={tensor}: compiled blocks over "
            "tensor-parallel (DTensor) activations are not tested yet; use model.compile_blocks=false"
        )


def check_pipeline_settings(cfg: DictConfig) -> None:
    """The `parallelism` values of the pipeline on their own (no model, data or machine needed), before
    the strategy is built from them.

    Raises:
        ValueError: naming the setting and what would be valid.
    """
    from lightning_zero.comm.pipeline import SCHEDULES

    settings = cfg.parallelism
    stages, micro, kind, virtual = (settings[key] for key in PIPELINE_ARGUMENTS)
    for key, value in (("pipeline", stages), ("virtual_stages", virtual)):
        if value < 1:
            raise ValueError(f"parallelism.{key}={value} must be >= 1")
    if micro is not None and micro < 1:
        raise ValueError(f"parallelism.microbatches={micro} must be >= 1, or null (one per stage)")
    if kind not in SCHEDULES:
        raise ValueError(f"parallelism.schedule={kind} is not one of {', '.join(sorted(SCHEDULES))}")
    if (kind == "interleaved_1f1b") != (virtual > 1):
        need = "2 or more" if virtual == 1 else "1"
        raise ValueError(
            f"parallelism.virtual_stages={virtual} with parallelism.schedule={kind}: set "
            f"parallelism.virtual_stages={need} (stages per rank: several only with interleaved_1f1b)"
        )
    changed = [
        f"parallelism.{key}={settings[key]}"
        for key, argument in PIPELINE_ARGUMENTS.items()
        if key != "pipeline" and settings[key] != strategy_default(argument)
    ]
    if stages == 1 and changed:
        raise ValueError(
            f"{', '.join(changed)} without a pipeline: set parallelism.pipeline=P (stages, > 1) too, or "
            "leave them at their defaults"
        )


def check_pipeline_parallel(cfg: DictConfig, model: GPTConfig, data: DataConfig) -> None:
    """Refuse a `parallelism.pipeline` this run cannot train with (see the module docstring); after
    `check_pipeline_settings`.

    Raises:
        ValueError: naming the setting and what would be valid (`validate` raises it as a `ConfigError`).
    """
    settings, strategy = cfg.parallelism, cfg.strategy
    stages = settings.pipeline
    if PIPELINE_ARGUMENTS["pipeline"] not in strategy:
        if stages > 1:
            raise ValueError(
                f"parallelism.pipeline={stages} needs a lightning-zero strategy (strategy=zero|zero1|zero2|"
                f"zero3); strategy._target_={strategy.get('_target_')} has no pipeline parallelism"
            )
        return
    for key, argument in PIPELINE_ARGUMENTS.items():
        value = strategy.get(argument)
        if value != settings[key]:
            raise ValueError(
                f"strategy.{argument}={value} differs from parallelism.{key}={settings[key]}: set "
                f"parallelism.{key}={value} instead (the strategy files take {argument} from it)"
            )
    if stages == 1:
        return
    _check_pipeline_ranks(cfg)
    micro = stages if settings.microbatches is None else settings.microbatches
    if data.batch_size % micro:
        named = "null (one per stage)" if settings.microbatches is None else str(micro)
        valid = [m for m in range(1, data.batch_size + 1) if data.batch_size % m == 0]
        raise ValueError(
            f"parallelism.microbatches={named} does not divide data.batch_size={data.batch_size}: each rank "
            f"cuts its batch into {micro} equal micro-batches; use parallelism.microbatches in {valid} or a "
            f"data.batch_size that {micro} divides"
        )
    cut = stages * settings.virtual_stages
    if model.n_layer < cut:
        raise ValueError(
            f"parallelism.pipeline={stages} x parallelism.virtual_stages={settings.virtual_stages} = {cut} "
            f"stages, more than model.n_layer={model.n_layer} blocks: every stage holds at "
            "least one (the embedding goes with the first, the final norm and the head with the last); "
            f"use model.n_layer >= {cut} or fewer stages"
        )
    if model.tie_embeddings:
        raise ValueError(
            f"model.tie_embeddings=true with parallelism.pipeline={stages}: the embedding (first stage) and "
            "the head (last stage) would share one tensor across stages; use model.tie_embeddings=false"
        )
    _check_pipeline_support(cfg, model)


def _check_pipeline_ranks(cfg: DictConfig) -> None:
    stages, tensor = cfg.parallelism.pipeline, cfg.parallelism.tensor
    devices, nodes = cfg.trainer.devices, cfg.cluster.nodes
    if not isinstance(devices, int):
        return  # "auto" or a list: Lightning's count, checked by the strategy at setup
    ranks = devices * nodes
    if ranks % (stages * tensor):
        valid = [p for p in range(2, ranks + 1) if ranks % (p * tensor) == 0]
        raise ValueError(
            f"parallelism.pipeline={stages} x parallelism.tensor={tensor} does not divide the job's {ranks} "
            f"ranks (cluster.nodes={nodes} x trainer.devices={devices}): every stage gets as many ranks; "
            f"use parallelism.pipeline in {valid or '[] (none: add devices)'}"
        )


def _check_pipeline_support(cfg: DictConfig, model: GPTConfig) -> None:
    """What the strategy refuses under a pipeline, or the recipe has not tested with one."""
    stages = cfg.parallelism.pipeline
    if str(cfg.trainer.precision) in ("16-mixed", "16"):
        raise ValueError(
            f"trainer.precision={cfg.trainer.precision} with parallelism.pipeline={stages}: its loss scaler "
            "would have to scale every micro-batch inside the schedule; use bf16-mixed or bf16-true"
        )
    lightnings = cfg.trainer.enable_checkpointing is not False  # None: Lightning adds its ModelCheckpoint
    checkpoints = cfg.callbacks.get("model_checkpoint") is not None or lightnings or cfg.ckpt_path is not None
    if checkpoints and cfg.strategy.get("sharded_checkpoint") is False:
        raise ValueError(
            f"strategy.sharded_checkpoint=false with parallelism.pipeline={stages}: each stage holds only "
            "its layers, so the checkpoints are sharded directories (every stage writes its own files); "
            "leave strategy.sharded_checkpoint=true, or turn checkpoints off "
            "(callbacks.model_checkpoint=null trainer.enable_checkpointing=false, no ckpt_path)"
        )
    if model.compile_blocks:
        raise ValueError(
            f"model.compile_blocks=true with parallelism.pipeline={stages}: compiled blocks inside the "
            "pipeline stages are not tested yet; use model.compile_blocks=false"
        )
    if model.init_from is not None:
        raise ValueError(
            f"model.init_from={model.init_from} with parallelism.pipeline={stages}: reading a Llama's "
            "weights into the stages is not tested yet; leave model.init_from=null"
        )
