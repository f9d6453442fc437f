"""The Hydra side of the recipe: from `conf/` and command-line overrides to the objects of one run.

* `resolvers` - the `recipe.*` OmegaConf resolvers (`run_name`, `run_dir`, the SLURM allocation: nodes,
  tasks and GPUs per node, shared with `recipes.sbatch`);
* `schema` - the typed schema of `conf/pretrain.yaml`, registered in Hydra's ConfigStore;
* `signatures` - schemas and checks read from the Lightning classes' constructor signatures;
* `compose` - composition outside `@hydra.main` (`recipes.sbatch`, tests), as the command composes;
* `validation` - every check before any process starts (`ConfigError`), giving the recipe dataclasses
  and the data source (`RecipeConfigs`);
* `build` - the data module, LightningModule, callbacks, loggers and Trainer of one run.

Arrows go one way: resolvers <- schema <- compose, schema <- validation <- build; this package builds from
`recipes.data` and `recipes.training`, which know nothing of it. Hydra composes and instantiates here
only. Importing this package registers the schema and the resolvers.
"""

from __future__ import annotations

from recipes.config.build import Run, build_run
from recipes.config.compose import CONF_DIR, compose_recipe
from recipes.config.resolvers import gpus_per_node, slurm_nodes, tasks_per_node
from recipes.config.validation import ConfigError, RecipeConfigs, check_keys, validate

__all__ = [
    "CONF_DIR",
    "ConfigError",
    "RecipeConfigs",
    "Run",
    "build_run",
    "check_keys",
    "compose_recipe",
    "gpus_per_node",
    "slurm_nodes",
    "tasks_per_node",
    "validate",
]
