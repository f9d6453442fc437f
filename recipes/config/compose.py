"""Composition of `conf/pretrain.yaml` outside `@hydra.main`, as `python -m recipes.pretrain` composes it.

`compose_recipe` composes with Hydra's compose API and installs Hydra's runtime state (`HydraConfig`)
the way `@hydra.main` does, so the `recipe.*` resolvers (`recipes.config.resolvers`) work in
`recipes.sbatch` and in tests. Importing this module registers the schema (`recipes.config.schema`) in
Hydra's ConfigStore, which registers the resolvers: composition needs both.
"""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from recipes.config import schema  # noqa: F401  (registers `pretrain_schema` and, through it, the resolvers)

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def compose_recipe(overrides: list[str], return_hydra_config: bool = False) -> DictConfig:
    """`conf/pretrain.yaml` with `overrides`, as `python -m recipes.pretrain` composes it.

    Raises Hydra's and OmegaConf's errors for an unknown key, a wrong type or an unknown group option,
    each naming it.
    """
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="pretrain"):
        cfg = compose(config_name="pretrain", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    if not return_hydra_config:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg
