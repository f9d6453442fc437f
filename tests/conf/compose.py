"""Compose `conf/pretrain.yaml` in-process with Hydra's compose API, for tests.

The schema is registered by importing `recipes.schema`; `GlobalHydra` is cleared around each call so
tests can compose repeatedly in one process.
"""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

import recipes.schema  # noqa: F401  (registers pretrain_schema)

REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "conf"


def compose_pretrain(overrides: list[str] | None = None) -> DictConfig:
    """The composed root config with `overrides` applied (as on the command line)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR), job_name="test"):
        return compose(config_name="pretrain", overrides=overrides or [])


def group_options(group: str) -> list[str]:
    """Names of the YAML files of one config group."""
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))
