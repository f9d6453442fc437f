"""Turn a validated config into the objects of one run: data module, LightningModule, Trainer.

Everything here runs in every process (Lightning's launcher re-runs the script for ranks > 0 with the
same run directory), so side effects are limited to rank 0: writing the resolved `config.yaml` into the
run directory and logging it as hyper-parameters. The model dataclass gets its `vocab_size` from the
tokenizer when `model.vocab_size` is null.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_zero import ZeroStrategy
from recipes.config.validation import RecipeConfigs
from recipes.data.module import PretrainDataModule
from recipes.training import PretrainModule, SlurmRequeue, TokenizerCopy, requeued_resume_path


@dataclass
class Run:
    """The objects `trainer.fit` needs, plus where the run writes."""

    trainer: pl.Trainer
    module: PretrainModule
    datamodule: PretrainDataModule
    run_dir: Path
    ckpt_path: str | None

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        return self.trainer.checkpoint_callback


def build_callbacks(cfg: DictConfig) -> list[Callback]:
    """Instantiate every non-null entry of the `callbacks` group (no progress bar if it is disabled)."""
    nodes = dict(cfg.callbacks.items())
    if not cfg.trainer.enable_progress_bar:
        nodes.pop("progress_bar", None)  # Lightning refuses a progress-bar callback when bars are off
    return [instantiate(node) for node in nodes.values() if node is not None]


def build_loggers(cfg: DictConfig) -> list[Logger]:
    """Instantiate every entry of the `logger` group (an empty group means no logger)."""
    return [instantiate(node) for node in cfg.logger.values() if node is not None]


def build_plugins(cfg: DictConfig) -> list[Any]:
    """The user's `trainer.plugins` (a node, a list, or a name Lightning knows), plus, under SLURM, the
    environment without Lightning's auto-requeue (the recipe's `SlurmRequeue` is the one mechanism)."""
    node = cfg.trainer.get("plugins")
    if isinstance(node, ListConfig):
        plugins = list(instantiate(node))
    else:
        plugins = [] if node is None else [instantiate(node) if isinstance(node, DictConfig) else node]
    if SLURMEnvironment.detect():
        plugins.append(SLURMEnvironment(auto_requeue=False))
    return plugins


def quiet_other_ranks() -> None:
    """Ranks > 0 log warnings only, so the console shows one copy of Lightning's start-up messages."""
    if rank_zero_only.rank != 0:
        for name in ("lightning.pytorch", "lightning.fabric"):
            logging.getLogger(name).setLevel(logging.WARNING)
    # Lightning 2.6 calls a torch pytree API that torch 2.13 deprecates, once per rank; nothing to act on.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")


def build_module(trainer: pl.Trainer, configs: RecipeConfigs) -> PretrainModule:
    """The LightningModule; under `"zero3"` on the meta device (`trainer.init_module(empty_init=True)`),
    so that no rank ever holds the whole model: the strategy initializes it unit by unit at setup, to
    the values eager construction gives (`lightning_zero.engine.deferred_init`; the model follows its
    rule), and a resume then overwrites the shards. Under tensor parallelism it is built with values
    and split in `configure_model` (a meta-device build with the plan is not tested in the recipe).
    Under pipeline parallelism it is built with values too, and the strategy drops the other stages'
    layers: the strategy's meta-device build under a pipeline equals the eager one in its own test
    (`tests/distributed/test_pipeline_trainer.py`); the recipe's run built so at `64-true` draws its
    initial values in float64, not as the eager build's float32 draws (docs/recipes.md)."""
    strategy = trainer.strategy
    stage3 = isinstance(strategy, ZeroStrategy) and strategy.zero_config.stage == 3
    if stage3 and configs.tensor_parallel <= 1 and configs.pipeline_parallel <= 1:
        with trainer.init_module(empty_init=True):
            return PretrainModule(configs.model, configs.optim)
    return PretrainModule(configs.model, configs.optim)


def build_run(cfg: DictConfig, configs: RecipeConfigs) -> Run:
    """Instantiate data, module, strategy, loggers, callbacks and the Trainer for `cfg`.

    Must be called on every rank, with the same config.
    """
    quiet_other_ranks()
    pl.seed_everything(cfg.seed, workers=True)
    datamodule = PretrainDataModule(configs.data, source=configs.source)
    loggers = build_loggers(cfg)
    callbacks, plugins = [*build_callbacks(cfg), TokenizerCopy(cfg.run_dir)], build_plugins(cfg)
    ckpt_path = cfg.ckpt_path
    if SLURMEnvironment.detect():  # one requeue mechanism: ours, not Lightning's signal-handler save
        callbacks.append(SlurmRequeue(cfg.cluster.peer_failure_requeues))
        ckpt_path = requeued_resume_path(ckpt_path, callbacks)  # a requeued job continues its series
    trainer: pl.Trainer = instantiate(
        cfg.trainer,
        strategy=instantiate(cfg.strategy),
        logger=loggers or False,
        callbacks=callbacks,
        plugins=plugins or None,
    )
    module = build_module(trainer, configs)
    run_dir = Path(cfg.run_dir)
    if rank_zero_only.rank == 0:  # the trainer's own ranks are only set once fit() launches
        resolved: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
        for logger in loggers:
            logger.log_hyperparams(resolved)
    return Run(trainer=trainer, module=module, datamodule=datamodule, run_dir=run_dir, ckpt_path=ckpt_path)
