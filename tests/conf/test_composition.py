"""Composition that respects the user (issue 11, item 1): choosing groups takes those groups' values and
nothing of the CPU demo, experiments and debug setups are opt-in, the run directory is Hydra's, and
SLURM's task count follows the GPUs per node. All in-process compositions (milliseconds each)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError

from recipes.config.resolvers import tasks_per_node
from recipes.config.validation import ConfigError, check_keys
from recipes.sbatch import ROOT, sbatch_script
from recipes.sbatch import main as sbatch_main
from tests.conf.compose import compose_pretrain, flatten, group_file_values, group_options

USER_CHOICES = [
    {"trainer": "gpu"},
    {"model": "llama_1b", "trainer": "gpu"},
    {"model": "gpt2_124m", "data": "text"},
    {"cluster": "slurm", "trainer": "gpu", "strategy": "ddp"},
    {"model": "llama_7b", "data": "tokens", "strategy": "zero1", "logger": "tensorboard"},
]
FILL = ["data.path=README.md", "cluster.partition=debug"]  # the `???` values some options leave open


def unresolved(overrides: list[str]) -> dict[str, object]:
    return flatten(OmegaConf.to_container(compose_pretrain(overrides), resolve=False))


@pytest.mark.parametrize("choices", USER_CHOICES, ids=lambda c: " ".join(f"{k}={v}" for k, v in c.items()))
def test_chosen_groups_keep_every_value_of_their_files(choices: dict[str, str]) -> None:
    composed = unresolved([f"{group}={option}" for group, option in choices.items()] + FILL)
    expected: dict[str, object] = {}
    for group, option in choices.items():
        expected.update(group_file_values(group, option))
    expected = {key: value for key, value in expected.items() if value != "???"}
    assert {key: composed[key] for key in expected} == expected


def test_a_1b_gpu_run_inherits_nothing_of_the_demo() -> None:
    cfg = compose_pretrain(["model=llama_1b", "trainer=gpu"])
    assert cfg.trainer.devices == "auto" and cfg.trainer.max_steps == 10000  # trainer/gpu.yaml
    assert cfg.trainer.val_check_interval == 500 and cfg.trainer.precision == "bf16-mixed"
    assert cfg.optim.lr == 4e-4 and cfg.optim.warmup_steps == 2000  # model/llama_1b.yaml
    assert cfg.run_name == "llama_1b-stdlib-gpu" and cfg.run_dir == "outputs/llama_1b-stdlib-gpu"


def test_experiments_and_debug_setups_are_opt_in() -> None:
    compose_pretrain()
    choices = HydraConfig.get().runtime.choices
    assert choices.experiment is None and choices.debug is None


@pytest.mark.parametrize("name", [n for n in group_options("experiment") if n != "cpu_demo"])
def test_experiments_set_everything_they_name(name: str) -> None:
    """Every value an experiment file sets is in the composed config, whatever the root says."""
    composed = unresolved([f"experiment={name}", *FILL])
    expected = {k: v for k, v in group_file_values("experiment", name).items() if v is not None}
    assert {key: composed[key] for key in expected} == expected
    assert composed["run_name"] == name and composed["trainer.max_steps"] > 1000


@pytest.mark.parametrize("name", group_options("debug"))
def test_debug_setups(name: str) -> None:
    cfg = compose_pretrain([f"debug={name}"])
    assert cfg.trainer.devices == 1 and cfg.trainer.detect_anomaly is True
    assert cfg.callbacks.model_checkpoint is None and cfg.trainer.enable_checkpointing is False
    assert cfg.run_name.startswith("debug")
    assert {"fdr": cfg.trainer.fast_dev_run is True, "overfit": cfg.trainer.overfit_batches == 1}.get(
        name, True
    )
    if name == "profiler":
        assert (
            cfg.trainer.profiler._target_.endswith("SimpleProfiler")
            and cfg.trainer.profiler.dirpath == cfg.run_dir
        )
    if name == "fdr":
        assert dict(cfg.logger) == {}  # fast_dev_run logs nothing: no logger writes a version_N
    check_keys(cfg)


def test_command_line_values_win_over_a_debug_setup() -> None:
    cfg = compose_pretrain(["debug=fdr", "run_name=mine", "trainer.devices=2", "logger=csv"])
    assert cfg.run_name == "mine" and cfg.trainer.devices == 2 and "csv" in cfg.logger


def test_hydra_run_dir_places_the_whole_run(tmp_path: Path) -> None:
    cfg = compose_pretrain([f"hydra.run.dir={tmp_path / 'here'}"])
    run_dir = str(tmp_path / "here")
    assert cfg.run_dir == run_dir and cfg.trainer.default_root_dir == run_dir
    assert cfg.callbacks.model_checkpoint.dirpath == f"{run_dir}/checkpoints"
    assert cfg.logger.csv.save_dir == run_dir


def test_a_multirun_job_runs_in_its_sweep_subdirectory(tmp_path: Path) -> None:
    cfg = compose_pretrain(["hydra.mode=MULTIRUN", f"hydra.sweep.dir={tmp_path}", "run_name=lr1"])
    assert cfg.run_dir == str(tmp_path / "lr1")


def test_a_multirun_launching_process_resolves_the_launcher_before_any_job(tmp_path: Path) -> None:
    """`-m hydra/launcher=slurm` builds submitit's launcher (its folder is under `run_dir`) in the
    launching process, where Hydra's runtime state is not set yet: the root's `hydra` node serves."""
    overrides = ["hydra/launcher=slurm", "cluster=slurm", "cluster.partition=debug", "hydra.mode=MULTIRUN"]
    cfg = compose_pretrain([*overrides, f"hydra.sweep.dir={tmp_path}"], return_hydra_config=True)
    HydraConfig.instance().cfg = None  # type: ignore[assignment]  # as before the first job starts
    assert cfg.hydra.launcher.submitit_folder == f"{tmp_path}/cpu_demo/.submitit/%j"


def test_setting_run_dir_itself_is_refused_naming_hydra_run_dir() -> None:
    with pytest.raises(ConfigError, match="set hydra.run.dir=/tmp/x instead"):
        check_keys(compose_pretrain(["run_dir=/tmp/x"]))


@pytest.mark.parametrize(
    ("accelerator", "devices", "gpus_per_node", "tasks"),
    [
        ("gpu", "auto", 8, 8),
        ("gpu", 8, 8, 8),
        ("cuda", [0, 1], None, 2),
        ("gpu", "4", None, 4),
        ("cpu", 2, 8, 2),
    ]
    + [("cpu", "auto", None, 1), ("gpu", -1, 4, 4)],
)
def test_tasks_per_node(accelerator: str, devices: object, gpus_per_node: int | None, tasks: int) -> None:
    assert tasks_per_node(accelerator, devices, gpus_per_node) == tasks


@pytest.mark.parametrize(("devices", "gpus_per_node"), [(2, 8), ("auto", None)])
def test_tasks_per_node_refuses_what_slurm_cannot_start(devices: object, gpus_per_node: int | None) -> None:
    with pytest.raises(ValueError, match=f"trainer.devices={devices}.*cluster.gpus_per_node"):
        tasks_per_node("gpu", devices, gpus_per_node)


def test_sbatch_for_a_gpu_cluster_starts_one_task_per_gpu() -> None:
    overrides = ["cluster=slurm", "trainer=gpu", "cluster.partition=gpu"]
    lines = sbatch_script(compose_pretrain(overrides), overrides, python="python").splitlines()
    assert "#SBATCH --ntasks-per-node=8" in lines and "#SBATCH --gpus-per-node=8" in lines
    assert "#SBATCH --job-name=tiny-stdlib-gpu" in lines


def test_sbatch_refuses_devices_that_disagree_with_the_gpus_per_node(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "job.sbatch"
    overrides = ["cluster=slurm", "trainer=gpu", "cluster.partition=gpu", "trainer.devices=2"]
    assert sbatch_main(["--output", str(out), *overrides]) == 2 and not out.exists()
    assert "error: trainer.devices=2 but cluster.gpus_per_node=8" in capsys.readouterr().err


# --- the allocation SLURM is asked for (sbatch script, submitit launcher) and the job agree (issue 19) ---

SLURM = ["cluster=slurm", "cluster.partition=gpu"]
Allocation = tuple[int, int, int | None]  # nodes, tasks per node, GPUs per node (None: no GPU asked)


def sbatch_allocation(overrides: list[str]) -> Allocation:
    text = sbatch_script(compose_pretrain(overrides), overrides, python="python")
    found = dict(re.findall(r"^#SBATCH --(nodes|ntasks-per-node|gpus-per-node)=(\d+)$", text, re.MULTILINE))
    gpus = found.get("gpus-per-node")
    return int(found["nodes"]), int(found["ntasks-per-node"]), None if gpus is None else int(gpus)


def launcher_allocation(overrides: list[str]) -> Allocation:
    cfg = compose_pretrain(["hydra/launcher=slurm", *overrides], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    return launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["trainer=gpu"], (2, 8, 8)),
        (["trainer=gpu", "cluster.nodes=4", "trainer.num_nodes=4"], (4, 8, 8)),
        (["trainer=gpu", "trainer.devices=8"], (2, 8, 8)),
        (["trainer=gpu", "trainer.devices=[0,1,2,3]", "cluster.gpus_per_node=4"], (2, 4, 4)),
        (["trainer=gpu", "cluster.gpus_per_node=null", "trainer.devices=4"], (2, 4, 4)),  # GPUs asked for
        (["trainer.devices=2", "cluster.nodes=3"], (3, 2, None)),  # CPU trainer: no GPU asked for
        (["experiment=llama_1b_multinode", "data.path=/shared/tok"], (2, 8, 8)),
    ],
)
def test_the_sbatch_script_and_the_submitit_launcher_size_the_job_alike(
    overrides: list[str], expected: Allocation
) -> None:
    """One derivation for both ways of submitting, and what the job then starts agrees with it."""
    overrides = [*SLURM, *overrides]
    assert sbatch_allocation(overrides) == launcher_allocation(overrides) == expected
    nodes, tasks, gpus = expected
    job = OmegaConf.to_container(compose_pretrain(overrides).trainer, resolve=True)
    assert isinstance(job, dict) and job["num_nodes"] == nodes  # Lightning's --nodes check under srun
    devices = len(job["devices"]) if isinstance(job["devices"], list) else job["devices"]
    assert devices in (tasks, "auto") and (devices == tasks or gpus == tasks)  # --ntasks-per-node check
    assert gpus in (None, tasks) and (gpus is None) == (job["accelerator"] == "cpu")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["trainer=gpu", "model=llama_1b", "trainer.num_nodes=4"],
            "trainer.num_nodes=4 but cluster.nodes=2: the job is sized from cluster.nodes (SLURM's "
            "--nodes=2) and Lightning would wait for 4 node(s); set cluster.nodes=4",
        ),
        (["trainer.num_nodes=1"], "trainer.num_nodes=1 but cluster.nodes=2"),  # a CPU trainer too
        (["trainer=gpu", "trainer.devices=2"], "trainer.devices=2 but cluster.gpus_per_node=8"),
        (
            ["trainer=gpu", "cluster.gpus_per_node=null"],
            "trainer.devices=auto with cluster.gpus_per_node=null",
        ),
    ],
)
def test_an_allocation_the_job_would_disagree_with_is_refused_naming_both(
    overrides: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused when the script is written or the launcher set up, not after the job waited in the queue."""
    overrides = [*SLURM, f"hydra.run.dir={tmp_path / 'run'}", *overrides]
    out = tmp_path / "job.sbatch"
    assert sbatch_main(["--output", str(out), *overrides]) == 2
    assert f"error: {message}" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match=re.escape(message)):
        sbatch_script(compose_pretrain(overrides), overrides)
    cfg = compose_pretrain(["hydra/launcher=slurm", *overrides], return_hydra_config=True)
    with pytest.raises(InterpolationResolutionError, match=re.escape(message)):
        [cfg.hydra.launcher[key] for key in ("nodes", "tasks_per_node", "gpus_per_node")]


def test_the_recipe_refuses_a_num_nodes_other_than_the_clusters() -> None:
    """The job itself too (a hand-written script, torchrun): one number of nodes, `cluster.nodes`."""
    check_keys(compose_pretrain(["cluster.nodes=2", "trainer.num_nodes=2"]))
    with pytest.raises(ConfigError, match=r"trainer.num_nodes=2 but cluster.nodes=1: "):
        check_keys(compose_pretrain(["trainer.num_nodes=2"]))


# --- where the job's run directory is, and who creates it ---


def test_the_jobs_run_directory_is_relative_to_the_repository_root(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The script `cd`s into the repository root before `srun`: a relative run_dir is the job's there,
    wherever the script was generated from."""
    monkeypatch.chdir(tmp_path)
    overrides = [*SLURM, "run_name=here"]
    lines = sbatch_script(compose_pretrain(overrides), overrides, python="python").splitlines()
    assert f"#SBATCH --output={ROOT / 'outputs' / 'here'}/slurm-%j.out" in lines
    cd = f"cd {shlex.quote(str(ROOT))}"
    assert lines.index(cd) < next(i for i, line in enumerate(lines) if line.startswith("srun "))


def test_sbatch_creates_the_log_directory_only_with_output_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SLURM opens `<run_dir>/slurm-%j.out` before the script runs and creates no directory."""
    run_dir = tmp_path / "runs" / "a"
    overrides = [*SLURM, f"hydra.run.dir={run_dir}"]
    assert sbatch_main(overrides) == 0  # printed: nothing created, the mkdir named
    printed = capsys.readouterr()
    assert f"#SBATCH --output={run_dir}/slurm-%j.out" in printed.out.splitlines()
    assert f"`mkdir -p {run_dir}` before sbatch" in printed.err and not run_dir.exists()
    assert sbatch_main(["--output", str(tmp_path / "job.sbatch"), *overrides]) == 0
    assert run_dir.is_dir() and f"created the job's run directory {run_dir}" in capsys.readouterr().out
    assert sbatch_main(["--output", str(tmp_path / "job.sbatch"), *overrides]) == 0
    assert "created" not in capsys.readouterr().out  # there already: nothing to say
