"""Compose `conf/pretrain.yaml` in-process as `python -m recipes.pretrain` does, for tests.

`recipes.compose.compose_recipe` installs Hydra's runtime state like `@hydra.main`, so `run_name` and
`run_dir` (resolvers over the group choices and Hydra's job directory) resolve; it clears `GlobalHydra`
around each call, so tests can compose repeatedly in one process.
"""

from __future__ import annotations

from omegaconf import DictConfig

from recipes.compose import CONF_DIR, compose_recipe

REPO_ROOT = CONF_DIR.parent


def compose_pretrain(overrides: list[str] | None = None, return_hydra_config: bool = False) -> DictConfig:
    """The composed root config with `overrides` applied (as on the command line)."""
    return compose_recipe(overrides or [], return_hydra_config=return_hydra_config)


def group_options(group: str) -> list[str]:
    """Names of the YAML files of one config group."""
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))

