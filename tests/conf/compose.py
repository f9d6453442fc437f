"""Compose `conf/pretrain.yaml` in-process as `python -m recipes.pretrain` does, for tests.

`recipes.config.compose.compose_recipe` installs Hydra's runtime state like `@hydra.main`, so `run_name` and
`run_dir` (resolvers over the group choices and Hydra's job directory) resolve; it clears `GlobalHydra`
around each call, so tests can compose repeatedly in one process.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from recipes.config.compose import CONF_DIR, compose_recipe

REPO_ROOT = CONF_DIR.parent


def compose_pretrain(overrides: list[str] | None = None, return_hydra_config: bool = False) -> DictConfig:
    """The composed root config with `overrides` applied (as on the command line)."""
    return compose_recipe(overrides or [], return_hydra_config=return_hydra_config)


def group_options(group: str) -> list[str]:
    """Names of the YAML files of one config group."""
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def flatten(node: object, prefix: str = "") -> dict[str, object]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`."""
    if not isinstance(node, dict):
        return {prefix: node}
    flat: dict[str, object] = {}
    for key, child in node.items():
        flat.update(flatten(child, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def group_file_values(group: str, option: str) -> dict[str, object]:
    """The values one group file sets, by full key (a `_global_` file's from the root), unresolved."""
    path = CONF_DIR / group / f"{option}.yaml"
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    assert isinstance(raw, dict)
    raw.pop("defaults", None)
    is_global = path.read_text().startswith("# @package _global_")
    return flatten(raw if is_global else {group: raw})
