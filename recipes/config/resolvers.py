"""Values the recipe's config takes from Hydra's own state: the `recipe.*` OmegaConf resolvers.

Some settings are not YAML scalars, because a scalar would be wrong as soon as the user chooses
something else (a default `cpu_demo` name or a fixed task count silently laid over `model=llama_1b
trainer=gpu` was issue 11). They are OmegaConf resolvers, registered when this module is imported:

- `${recipe.run_name:}`, the default `run_name`: `cpu_demo` for the demo's groups (`model=tiny data=stdlib
  trainer=cpu`), otherwise `<model>-<data>-<trainer>` from the groups chosen, so two different setups
  never share (and resume from) one directory unless the user names them alike. Experiments set
  their own name.
- `${recipe.job_dir:}`, `run_dir`: the directory Hydra runs the job in: `hydra.run.dir` (default
  `<output_root>/<run_name>`, no timestamp, so `ckpt_path=last` finds it again), or
  `hydra.sweep.dir/hydra.sweep.subdir` in a multirun. `hydra.run.dir=X` therefore places checkpoints,
  logs and `config.yaml` in X. Lightning's launcher re-runs the command for ranks > 0 with
  `hydra.run.dir=<the resolved dir>`, so every rank gets the same one.
- `${recipe.nodes:nodes,num_nodes}`, `${recipe.tasks_per_node:accelerator,devices,gpus_per_node}` and
  `${recipe.gpus_per_node:accelerator,devices,gpus_per_node}`: the SLURM allocation of the submitit
  launcher (`conf/hydra/launcher/slurm.yaml`), by the same functions `recipes.sbatch` writes its
  `#SBATCH` lines with (`slurm_nodes`, `tasks_per_node`, `gpus_per_node`). Each value the allocation
  and the job must agree on is derived once, from `cluster.*` and `trainer.*`, or refused when the two
  disagree, naming both - when the script is written or the job submitted, not after it waited in
  the queue for Lightning to find `--nodes != num_nodes` or `--ntasks-per-node != devices`.

The first two read Hydra's runtime state (`HydraConfig`), which `@hydra.main` installs, and so does
`recipes.config.compose.compose_recipe` outside it. This module imports no other recipe module: the
schema (`recipes.config.schema`) imports it so that the YAML files' interpolations resolve.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, ListConfig, OmegaConf

DEMO_CHOICES = {"model": "tiny", "data": "stdlib", "trainer": "cpu"}
DEMO_RUN_NAME = "cpu_demo"
GPU_ACCELERATORS = ("gpu", "cuda")


def hydra_node(root: DictConfig) -> DictConfig:
    """Hydra's own config: the root's `hydra` node where it is still there (a multirun's launching
    process, which resolves the launcher's settings before any job exists), else Hydra's runtime state
    (a job, and `compose_recipe`)."""
    return root.hydra if "hydra" in root else HydraConfig.get()


def default_run_name(*, _root_: DictConfig) -> str:
    """`cpu_demo` for the demo's groups, else `<model>-<data>-<trainer>` of the groups chosen."""
    choices = hydra_node(_root_).runtime.choices
    chosen = {group: choices.get(group) for group in DEMO_CHOICES}
    if chosen == DEMO_CHOICES:
        return DEMO_RUN_NAME
    return "-".join(str(choice) for choice in chosen.values())


def job_dir(*, _root_: DictConfig) -> str:
    """The directory Hydra runs this job in (a multirun job: its sweep subdirectory)."""
    hydra = hydra_node(_root_)
    if hydra.mode == RunMode.MULTIRUN:
        return str(Path(str(hydra.sweep.dir)) / str(hydra.sweep.subdir))
    return str(hydra.run.dir)


def device_count(devices: Any) -> int | None:
    """Devices a `trainer.devices` value asks for; None for `auto` / -1 (whatever the node has)."""
    if isinstance(devices, list | tuple | ListConfig):
        return len(devices)
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, int) and not isinstance(devices, bool) and devices >= 0:
        return devices
    return None


def tasks_per_node(accelerator: str, devices: Any, gpus_per_node: int | None) -> int:
    """SLURM tasks per node: one per device (Lightning checks `--ntasks-per-node == devices`).

    On GPU trainers with `cluster.gpus_per_node` set, `trainer.devices` must be `auto` (all the node's
    GPUs) or that same number; on CPU trainers it is `trainer.devices` (`auto`: one process).

    Raises:
        ValueError: when the two numbers disagree or neither gives a count, naming both settings.
    """
    count = device_count(devices)
    if str(accelerator) in GPU_ACCELERATORS:
        if gpus_per_node is not None and count not in (None, gpus_per_node):
            raise ValueError(
                f"trainer.devices={devices} but cluster.gpus_per_node={gpus_per_node}: SLURM starts one "
                f"task per GPU; set trainer.devices=auto (or {gpus_per_node}), or "
                f"cluster.gpus_per_node={count}"
            )
        if count is None and gpus_per_node is None:
            raise ValueError(
                f"trainer.devices={devices} with cluster.gpus_per_node=null: the number of tasks per node "
                "is unknown; set cluster.gpus_per_node or trainer.devices to a number"
            )
        return gpus_per_node if gpus_per_node is not None else count  # type: ignore[return-value]
    return 1 if count is None else count


def slurm_nodes(nodes: int, num_nodes: Any) -> int:
    """SLURM nodes: `cluster.nodes`, which `trainer.num_nodes` follows (`conf/trainer/*.yaml`).

    Raises:
        ValueError: when `trainer.num_nodes` was set to another number, naming both settings.
    """
    if num_nodes != nodes:
        raise ValueError(
            f"trainer.num_nodes={num_nodes} but cluster.nodes={nodes}: the job is sized from cluster.nodes "
            f"(SLURM's --nodes={nodes}) and Lightning would wait for {num_nodes} node(s); set "
            f"cluster.nodes={num_nodes} (trainer.num_nodes follows it)"
        )
    return nodes


def gpus_per_node(accelerator: str, devices: Any, gpus_per_node: int | None) -> int | None:
    """GPUs to request per node: one per task on GPU trainers (`tasks_per_node`: `cluster.gpus_per_node`,
    or the number `trainer.devices` gives when that is null), none on CPU trainers.

    Raises:
        ValueError: as `tasks_per_node`.
    """
    if str(accelerator) not in GPU_ACCELERATORS:
        return None
    return tasks_per_node(accelerator, devices, gpus_per_node)


def register_resolvers() -> None:
    """Register the `recipe.*` resolvers (idempotent)."""
    for name, function in (
        ("recipe.run_name", default_run_name),
        ("recipe.job_dir", job_dir),
        ("recipe.nodes", slurm_nodes),
        ("recipe.tasks_per_node", tasks_per_node),
        ("recipe.gpus_per_node", gpus_per_node),
    ):
        OmegaConf.register_new_resolver(name, function, replace=True)


register_resolvers()
