"""The recipe on a real single-node SLURM (started by scripts/slurm_cluster.sh) and under torchrun
with two "nodes" on localhost. Polls with deadlines; the cluster is stopped afterwards if this
module started it.

What runs on this machine (the recipe's sbatch generation, the reference runs, torchrun's agents) is
forked from the suite's warm interpreters (``tests.launch``): only the ranks that SLURM, torchrun or
Lightning's launcher start themselves pay Lightning's import. The torchrun and submitit runs train on
64-token windows with 2 validation batches: what they compare (ranks, nodes, shards) does not depend on
the batch's shape."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_zero.checkpoint import read_meta, shard_name
from lightning_zero.checkpoint.consolidate import load_module_checkpoint
from recipes.data.sampling import global_batch
from recipes.sbatch import ROOT, compose_config, sbatch_script
from recipes.training.lineage import is_complete
from tests.launch import free_port, launch_env, run_launches, run_script

SCRIPT = ROOT / "scripts" / "slurm_cluster.sh"
TINY = [
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "sample.max_new_tokens=5",
    "data.seq_len=64",
    "trainer.limit_val_batches=2",
]


def _slurm_running() -> bool:
    return subprocess.run(["pgrep", "-x", "slurmctld"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def slurm() -> Iterator[None]:
    was_running = _slurm_running()
    start = subprocess.run(["bash", str(SCRIPT), "start"], capture_output=True, text=True, timeout=600)
    assert start.returncode == 0, start.stdout + start.stderr
    try:
        yield
    finally:
        if not was_running:
            subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, timeout=60)


def _job_info(job_id: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout


def wait_for_job(job_id: str, deadline_s: float) -> str:
    end = time.monotonic() + deadline_s
    state = "UNKNOWN"
    while time.monotonic() < end:
        out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
        match = re.search(r"JobState=(\w+)", out)
        state = match.group(1) if match else "UNKNOWN"
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state
        time.sleep(2)
    subprocess.run(["scancel", job_id], capture_output=True)
    raise AssertionError(f"job {job_id} still {state} after {deadline_s} s (cancelled)")


WAITING = ("PENDING", "CONFIGURING", "RUNNING")  # CONFIGURING: allocated, node not yet ready (busy slurmd)


def wait_until_complete(job_id: str, checkpoint: Path, log: Path, deadline_s: float) -> None:
    """Poll until ``checkpoint`` is complete while the job is still waiting or running; any other state
    (the first attempt ended, or is being requeued, before it got there) fails with the state, its
    reason and the job's log."""
    end = time.monotonic() + deadline_s
    while not is_complete(checkpoint):
        info = _job_info(job_id)  # empty when scontrol timed out on a busy slurmctld: poll again
        state = re.search(r"JobState=(\w+)", info)
        reason = re.search(r"Reason=(\S+)", info)
        tail = log.read_text()[-3000:] if log.exists() else f"(no {log.name} yet)"
        assert state is None or state.group(1) in WAITING, (
            f"job {job_id} is {state.group(1)} (reason {reason.group(1) if reason else '?'}) "
            f"before {checkpoint.name}:\n{tail}"
        )
        assert time.monotonic() < end, f"job {job_id}: no {checkpoint.name} in {deadline_s} s:\n{tail}"
        time.sleep(1)


SLURM_TWO_TASKS = ["cluster=slurm", "cluster.partition=debug", "cluster.nodes=1", "trainer.devices=2"]


def submit_generated(overrides: list[str], tmp_path: Path) -> str:
    """Write the recipe's sbatch script for ``overrides`` with ``python -m recipes.sbatch``, submit it,
    return the job id."""
    script = tmp_path / "job.sbatch"
    made = _run([sys.executable, "-m", "recipes.sbatch", "--output", str(script), *overrides], timeout=60)
    assert made.returncode == 0, made.stderr
    job = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=30)
    assert job.returncode == 0, job.stderr
    return job.stdout.strip().split(";")[0]


def test_generated_script_matches_the_config() -> None:
    overrides = [
        "cluster=slurm",
        "cluster.partition=gpu",
        "cluster.nodes=4",
        "cluster.account=proj",
        "trainer=gpu",
        "trainer.devices=8",
        "run_name=big",
        "cluster.cpus_per_task=6",
        "cluster.sbatch_extra=[--exclusive]",
        "strategy.shard_group_size=auto",  # node-aware sharding: a shard group is a node's 8 tasks
    ]
    text = sbatch_script(compose_config(overrides), overrides, python="python")
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj",
        "#SBATCH --signal=SIGUSR1@90",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --cpus-per-task=6",
        "#SBATCH --exclusive",
    ):
        assert line in text.splitlines(), line
    assert text.rstrip().endswith(
        "srun --kill-on-bad-exit=0 python -m recipes.pretrain " + " ".join(shlex.quote(o) for o in overrides)
    )


def test_bad_override_fails_before_writing(tmp_path: Path) -> None:
    out = tmp_path / "job.sbatch"
    result = _run(
        [sys.executable, "-m", "recipes.sbatch", "--output", str(out), "cluster.nodez=2"], timeout=60
    )
    assert result.returncode != 0 and "nodez" in result.stderr and not out.exists()


def assert_same_shards(ours: Path, reference: Path) -> None:
    """Two sharded checkpoints of 2 ranks hold bit-identical parameters and optimizer state."""
    for rank in (0, 1):
        mine = torch.load(ours / shard_name(rank, 2), weights_only=True)
        ref = torch.load(reference / shard_name(rank, 2), weights_only=True)
        for key, tensors in ref.items():
            assert all(torch.equal(x, y) for x, y in zip(mine[key], tensors, strict=True)), (rank, key)


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``command`` (``python -m ...``) run here as one process, forked from a warm interpreter; the
    ``timeout`` bounds the run, not Python's start-up."""
    return run_script(command, 1, cwd=ROOT, env=launch_env(), timeout=timeout)


def _torchrun_nodes(per_node: int, overrides: list[str]) -> list[list[str]]:
    """The commands of two torchrun "nodes" of ``per_node`` processes each running the recipe."""
    port = free_port()
    return [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--nproc-per-node={per_node}",
            "--rdzv-backend=c10d",  # as on clusters without SLURM; ranks are assigned at rendezvous
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=lzero-{port}",
            "-m",
            "recipes.pretrain",
            f"trainer.devices={per_node}",
            "cluster.nodes=2",
            *overrides,
        ]
        for _node in (0, 1)
    ]


def _run_at_once(*jobs: list[list[str]]) -> None:
    """Start every job (the commands of one world, each forked from a warm interpreter) at once and wait
    for all of them to succeed."""
    launches = [(commands, [launch_env()] * len(commands)) for commands in jobs]
    for codes, outs, errs in run_launches(launches, cwd=ROOT, timeout=300):
        for code, out, err in zip(codes, outs, errs, strict=True):
            assert code == 0, (out + err)[-4000:]


def test_torchrun_two_nodes_matches_one_node(tmp_path: Path) -> None:
    common = [f"output_root={tmp_path}", *TINY]
    # the reference runs meanwhile: its ranks start one after the other
    one = [sys.executable, "-m", "recipes.pretrain", "run_name=one_node", "trainer.devices=2", *common]
    _run_at_once([one], _torchrun_nodes(1, ["run_name=two_nodes", *common]))
    a, b = (tmp_path / name / "checkpoints" / "last.ckpt" for name in ("one_node", "two_nodes"))
    assert read_meta(b)["world_size"] == 2
    assert_same_shards(b, a)


def test_torchrun_two_nodes_of_two_shard_within_a_node_and_match_flat_sharding(tmp_path: Path) -> None:
    """``torchrun --nnodes=2 --nproc-per-node=2`` with ``strategy.shard_group_size=auto``: each node's
    2 ranks shard, the 2 nodes replicate (the checkpoint holds 2 shards), and training equals flat
    sharding over the same 4 ranks launched the same way (fp32: the sums run in another order, so to
    rounding)."""
    common = [f"output_root={tmp_path}", *TINY]
    flat = _torchrun_nodes(2, ["run_name=flat", *common])  # the same launch, flat over the 4 ranks
    _run_at_once(flat, _torchrun_nodes(2, ["run_name=hybrid", "strategy.shard_group_size=auto", *common]))
    a, b = (tmp_path / name / "checkpoints" / "last.ckpt" for name in ("flat", "hybrid"))
    assert read_meta(a)["world_size"] == 4 and read_meta(b)["world_size"] == 2
    ref, got = (load_module_checkpoint(path)["state_dict"] for path in (a, b))
    assert sorted(got) == sorted(ref)
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=name)


def assert_each_sample_trained_once_in_order(run_dir: Path, steps: int, world_size: int) -> None:
    """The `callbacks=trained_samples` record of every rank (lines `step index ...`)
    holds each step 0..steps-1 once, with rank r's part of the order's global batch of that step
    (micro-batch r: no accumulation), so no sample was trained twice or skipped across the requeue."""
    position = read_meta(run_dir / "checkpoints" / "last.ckpt")["lightning"]["PretrainDataModule"]["position"]
    size, batch = position["global_batch_size"], position["micro_batch_size"]
    assert position["consumed_samples"] == steps * size and position["world_size"] == world_size
    for rank in range(world_size):
        lines = (run_dir / "trained_samples" / f"rank{rank}.txt").read_text().split("\n")
        rows = [[int(n) for n in line.split()] for line in lines if line]
        assert [row[0] for row in rows] == list(range(steps)), f"rank {rank}: steps trained twice or skipped"
        for step, row in enumerate(rows):
            order = global_batch(position["dataset_len"], size, position["seed"], step)
            assert row[1:] == order[rank * batch : (rank + 1) * batch].tolist(), (rank, step)


@pytest.mark.collective_faults  # SIGUSR1 stops the first attempt wherever each rank is
def test_requeue_resumes_from_its_checkpoint_and_finishes(slurm: None, tmp_path: Path) -> None:
    """SIGUSR1 part-way (what --signal=SIGUSR1@90 sends every task before a time limit): the ranks
    agree at a step boundary, save that step in the run's checkpoint series, the job requeues itself,
    and the requeued job (same command, no ckpt_path) resumes from the series and ends at max_steps:
    no step trained twice, every sample of the uninterrupted order trained once, the series pruned
    to its newest step checkpoint plus `last`, and the same parameters and optimizer state as an
    uninterrupted run of the same command (run locally while SLURM holds the requeued job)."""
    steps, every = 16, 4
    common = [
        "trainer.devices=2",
        f"trainer.max_steps={steps}",
        "trainer.val_check_interval=1000",
        "sample.max_new_tokens=5",
        "callbacks=trained_samples",
        f"callbacks.model_checkpoint.every_n_train_steps={every}",
        f"output_root={tmp_path}",
    ]
    job_id = submit_generated([*SLURM_TWO_TASKS, *common, "run_name=requeue"], tmp_path)
    run_dir = tmp_path / "requeue"
    log = run_dir / f"slurm-{job_id}.out"
    wait_until_complete(job_id, run_dir / "checkpoints" / f"step{2 * every:06d}.ckpt", log, 240)  # part-way
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True)  # every task of the job's steps
    # SLURM holds a requeued job for ~2 minutes before it is eligible: the reference runs meanwhile
    deadline = time.monotonic() + 120
    while "Reason=BeginTime" not in (info := _job_info(job_id)) and "JobState=COMPLETED" not in info:
        assert time.monotonic() < deadline, info
        time.sleep(1)
    reference = _run([sys.executable, "-m", "recipes.pretrain", *common, "run_name=reference"], timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=False)
    state = wait_for_job(job_id, deadline_s=300)
    text = log.read_text()
    assert state == "COMPLETED", text[-3000:]
    starts = [int(n) for n in re.findall(r"from global step (\d+)", text)]
    saved = [int(n) for n in re.findall(r"SIGUSR1: saved .*/checkpoints/.* at step (\d+)", text)]
    assert len(starts) == 2 and starts[0] == 0 and len(saved) == 1 and starts[1] == saved[0] >= 2 * every, (
        starts,
        saved,
    )
    assert "requeued job (restart 1): resuming from" in text
    assert not list(run_dir.glob("hpc_ckpt_*")), "one series: no separate requeue checkpoint"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "last.ckpt",
        f"step{steps:06d}.ckpt",
    ]
    assert read_meta(run_dir / "checkpoints" / "last.ckpt")["lightning"]["global_step"] == steps
    assert_each_sample_trained_once_in_order(run_dir, steps, world_size=2)
    assert_same_shards(
        run_dir / "checkpoints" / "last.ckpt", tmp_path / "reference" / "checkpoints" / "last.ckpt"
    )


def _job_pids(job_id: str, task: int | None = None) -> list[int]:
    """The pids of the processes of SLURM job ``job_id`` (the batch script, srun, the recipe's ranks);
    with ``task``, only the recipe's process that runs that task."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            environ = set((proc / "environ").read_bytes().split(b"\0"))
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if f"SLURM_JOB_ID={job_id}".encode() not in environ:
            continue
        if task is None or (b"recipes.pretrain" in cmdline and f"SLURM_PROCID={task}".encode() in environ):
            pids.append(int(proc.name))
    return pids


@pytest.mark.collective_faults  # rank 1 is killed mid-step on purpose
def test_a_killed_rank_requeues_the_job_which_resumes_and_finishes(slurm: None, tmp_path: Path) -> None:
    """The generated sbatch script runs the recipe on two SLURM tasks (one job, world size 2), and
    rank 1 is SIGKILLed part-way (what the out-of-memory killer or a crashed node does to one task):
    rank 0 ends on the broken connection at once (`CommError`), requeues the job itself (one requeue, the
    first of `cluster.peer_failure_requeues`; srun runs with --kill-on-bad-exit=0 so it may), and the
    requeued job resumes from the newest complete checkpoint of the series and ends at max_steps."""
    steps, every = 16, 4
    overrides = [
        *SLURM_TWO_TASKS,
        f"trainer.max_steps={steps}",
        "trainer.val_check_interval=1000",
        "sample.max_new_tokens=5",
        f"callbacks.model_checkpoint.every_n_train_steps={every}",
        f"output_root={tmp_path}",
        "run_name=peer_failure",
    ]
    job_id = submit_generated(overrides, tmp_path)
    run_dir = tmp_path / "peer_failure"
    log = run_dir / f"slurm-{job_id}.out"
    wait_until_complete(job_id, run_dir / "checkpoints" / f"step{2 * every:06d}.ckpt", log, 240)
    pids = _job_pids(job_id, task=1)
    assert len(pids) == 1, f"rank 1's process was not found: {pids}"
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 120  # requeued: SLURM holds it ~2 minutes; release it early
    while "Reason=BeginTime" not in (info := _job_info(job_id)) or _job_pids(job_id):
        assert "JobState=COMPLETED" not in info and "JobState=FAILED" not in info, log.read_text()[-3000:]
        assert time.monotonic() < deadline, info
        time.sleep(1)
    # Only once the first run has ended, and not within the second its credential was revoked: slurmd
    # refuses ("Job credential revoked") a start in that second and the job ends FAILED (seen in CI).
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=False)
    state = wait_for_job(job_id, deadline_s=300)
    text = log.read_text()
    assert state == "COMPLETED", text[-3000:]
    assert f"SLURM job {job_id}: world size 2" in text and "MEMBER: 1/2" in text, text[-3000:]
    assert f"rank 0: requeued SLURM job {job_id} after a peer failure (1 of at most 3)" in text, text[-3000:]
    assert "Restarts=1" in _job_info(job_id)
    starts = [int(n) for n in re.findall(r"from global step (\d+)", text)]
    assert len(starts) == 2 and starts[0] == 0 and starts[1] >= 2 * every and starts[1] % every == 0, starts
    assert "requeued job (restart 1): resuming from" in text
    assert read_meta(run_dir / "checkpoints" / "last.ckpt")["lightning"]["global_step"] == steps
    assert sorted(p.name for p in (run_dir / ".requeue").iterdir()) == [f"requeue-{job_id}-0"]


def test_submitit_launcher_submits_the_recipe(slurm: None, tmp_path: Path) -> None:
    overrides = [
        "-m",
        "hydra/launcher=slurm",
        *SLURM_TWO_TASKS,
        "cluster.gpus_per_node=null",
        f"output_root={tmp_path}",
        "run_name=submitit_e2e",
        *TINY,
    ]
    result = _run([sys.executable, "-m", "recipes.pretrain", *overrides], timeout=400)
    run_dir = tmp_path / "submitit_e2e"
    logs = "\n".join(p.read_text() for p in run_dir.glob(".submitit/*/*.out"))
    assert result.returncode == 0, result.stderr[-3000:] + logs[-3000:]
    assert re.search(r"SLURM job \d+: world size 2", logs), logs[-3000:]
    meta = read_meta(run_dir / "checkpoints" / "last.ckpt")
    assert meta["world_size"] == 2 and meta["lightning"]["global_step"] == 6
    sbatch = next(run_dir.glob(".submitit/*/*_submission.sh")).read_text()
    assert (
        "#SBATCH --signal=USR1@90" in sbatch
        and "USR2" not in sbatch
        and "#SBATCH --ntasks-per-node=2" in sbatch
    )


def test_sbatch_without_srun_fails_at_once_with_a_message(slurm: None, tmp_path: Path) -> None:
    """A hand-written script that forgets `srun` must not wait forever for ranks never started."""
    script = tmp_path / "no_srun.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --ntasks-per-node=2\n#SBATCH --nodes=1\n"
        f"#SBATCH --output={tmp_path}/no_srun-%j.out\n"
        f"cd {ROOT}\n"
        f"{sys.executable} -m recipes.pretrain trainer.devices=2 output_root={tmp_path} run_name=no_srun\n"
    )
    job_id = (
        subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True)
        .stdout.strip()
        .split(";")[0]
    )
    state = wait_for_job(job_id, deadline_s=120)
    log = (tmp_path / f"no_srun-{job_id}.out").read_text()
    assert state == "FAILED" and "but not through srun" in log, log[-2000:]


def test_fabric_loop_under_srun_matches_lightning_launcher(slurm: None, tmp_path: Path) -> None:
    """Fabric(strategy="zero") under SLURM (SLURMEnvironment, one task per rank) gives the result of
    Lightning's own launcher bit for bit."""
    cases = json.dumps([{"strategy": "zero", "steps": 4, "accum": 2, "clip": 0.05}])
    module = ["-m", "tests.distributed.fabric_loop", "--devices", "2", "--cases", cases]
    launched = _run([sys.executable, *module, "--out", f"{tmp_path}/launcher.pt"], timeout=240)
    assert launched.returncode == 0, launched.stderr[-3000:]
    state, log = _srun_job(tmp_path, "fabric", f"{shlex.join(module)} --out {tmp_path}/srun.pt")
    assert state == "COMPLETED", log[-3000:]
    launcher = torch.load(tmp_path / "launcher.pt", weights_only=False)[0]
    under_srun = torch.load(tmp_path / "srun.pt", weights_only=False)[0]
    for name, value in launcher.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, under_srun[name]), name


def test_preflight_under_srun_reads_the_job_from_slurm(slurm: None, tmp_path: Path) -> None:
    """``srun lightning-zero preflight`` takes devices and nodes from SLURM's variables, joins through
    Lightning's SLURMEnvironment, and passes on a healthy job (one node of 2 tasks)."""
    preflight = "-m lightning_zero.cli preflight --accelerator cpu --sizes-mb 0.25 --shard-group-size auto"
    state, log = _srun_job(tmp_path, "preflight", f"{preflight} --checkpoint-dir {tmp_path}/ckpt")
    assert state == "COMPLETED", log[-3000:]
    assert "lightning-zero preflight: 2 ranks on 1 host(s)" in log and "OK: no problem found" in log, log
    assert "layout 1x2 (shard_group_size=auto)" in log and "every rank sees every rank's files" in log


def _srun_job(tmp_path: Path, name: str, python_args: str) -> tuple[str, str]:
    """An sbatch job of one node with 2 tasks, each ``srun python {python_args}``: its final state
    and its log."""
    script = tmp_path / f"{name}.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --ntasks-per-node=2\n#SBATCH --nodes=1\n"
        f"#SBATCH --output={tmp_path}/{name}-%j.out\n"
        f"cd {ROOT}\nexport OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore\n"
        f"srun {sys.executable} {python_args}\n"
    )
    submitted = subprocess.run(
        ["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True
    )
    job_id = submitted.stdout.strip().split(";")[0]
    state = wait_for_job(job_id, deadline_s=180)
    return state, (tmp_path / f"{name}-{job_id}.out").read_text()
