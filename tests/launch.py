"""Start every rank of a Lightning (or Fabric) test script at once, as a cluster launcher does.

Lightning's own launcher (``_SubprocessScriptLauncher``) re-runs the command for ranks > 0 only once rank 0
has imported Lightning and reached ``fit``/``launch``: a 2-rank launch pays Lightning's import (about 9 s
on the 2-core test machine) twice, one after the other. The test scripts that only need N ranks (not
Lightning's launcher itself: the recipe, docs, Fabric-launch and fault tests use that one) start here
with what that launcher gives each rank in its environment (``MASTER_ADDR``, ``MASTER_PORT``,
``NODE_RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``), all ranks together. Lightning then sees processes created
externally (``LightningEnvironment``) and every rank runs exactly what it runs under its launcher, which
re-runs the same command with those variables; only the imports overlap.

Each rank is forked from a warm interpreter (``tests.zygote``: Lightning already imported) where the
command allows it, so a launch does not pay the import at all; ``LZ_TEST_ZYGOTE=0`` starts fresh
processes instead.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from lightning_zero.comm import recorder
from tests import zygote

_LAUNCHES = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


ROOT = Path(__file__).resolve().parents[1]


def launch_env(**extra: str) -> dict[str, str]:
    """The environment of a launched test process: this one, one thread per process (2 ranks share the
    machine's 2 cores), no warnings printed and the repository first on the import path (for the
    processes a launched one starts elsewhere), plus ``extra``. One environment for every launch means one
    set of zygotes per pytest process (a zygote is started per startup environment)."""
    paths = [
        str(ROOT),
        *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)],
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join(paths))
    env.update(extra)
    return env


Outcome = tuple[list[int], list[str], list[str]]  # each process's exit status, stdout and stderr


def run_processes(
    commands: Sequence[Sequence[str]],
    envs: Sequence[Mapping[str, str]],
    *,
    cwd: Path,
    timeout: float,
    stop_on_failure: bool = False,
) -> Outcome:
    """Start ``commands[r]`` with ``envs[r]`` as rank slot r, all at once; wait for all, killing all at
    ``timeout`` (and, with ``stop_on_failure``, as soon as one ends with a non-zero status). Returns
    each process's exit status (negative: the signal that ended it), stdout and stderr.

    Raises:
        subprocess.TimeoutExpired: when a process is still running after ``timeout`` seconds.
    """
    return run_launches([(commands, envs)], cwd=cwd, timeout=timeout, stop_on_failure=stop_on_failure)[0]


def run_launches(
    launches: Sequence[tuple[Sequence[Sequence[str]], Sequence[Mapping[str, str]]]],
    *,
    cwd: Path,
    timeout: float,
    stop_on_failure: bool = False,
) -> list[Outcome]:
    """``run_processes`` for several independent launches (``(commands, envs)`` each, with ports and
    directories of their own) at once: their start-ups and their waits (a timeout one of them tests)
    overlap. The deadline starts once every zygote is ready, so it bounds the runs, not the imports.
    With ``stop_on_failure`` a launch stops at its first non-zero status; the others go on.

    Raises:
        subprocess.TimeoutExpired: when a process is still running after ``timeout`` seconds.
    """
    prepared = []
    for commands, envs in launches:
        if any(recorder.ENV_DIR in env for env in envs):  # one name per launch for the collective-order logs
            launch = f"launch-{os.getpid()}-{next(_LAUNCHES)}"
            envs = [dict(env, **{recorder.ENV_LAUNCH: launch}) for env in envs]
        prepared.append((commands, envs))
    if zygote.enabled():  # every slot's zygote of every launch at once, before the deadline starts
        zygote.start_many([(len(envs), envs[0]) for _, envs in prepared])
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        started: list[list[tuple[subprocess.Popen[bytes] | zygote.Forked, Path, Path]]] = []
        try:
            for index, (commands, envs) in enumerate(prepared):
                procs: list[tuple[subprocess.Popen[bytes] | zygote.Forked, Path, Path]] = []
                started.append(procs)
                for rank, (command, rank_env) in enumerate(zip(commands, envs, strict=True)):
                    out, err = Path(logs, f"{index}-{rank}.out"), Path(logs, f"{index}-{rank}.err")
                    with open(out, "w") as out_file, open(err, "w") as err_file:
                        proc = zygote.popen(
                            command, slot=rank, cwd=cwd, env=rank_env, stdout=out_file, stderr=err_file
                        )
                    procs.append((proc, out, err))
            waiting = list(range(len(started)))
            while waiting:
                for index in list(waiting):
                    codes = [proc.poll() for proc, _, _ in started[index]]
                    failed = stop_on_failure and any(code not in (None, 0) for code in codes)
                    if failed or all(code is not None for code in codes):
                        waiting.remove(index)
                        _kill([proc for proc, _, _ in started[index]])
                if waiting and time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(list(prepared[waiting[0]][0][0]), timeout)
                time.sleep(0.02)
        finally:
            for procs in started:
                _kill([proc for proc, _, _ in procs])
        outcomes = []
        for procs in started:
            codes = [proc.returncode for proc, _, _ in procs]
            assert all(code is not None for code in codes)
            outs = [out.read_text() for _, out, _ in procs]
            errs = [err.read_text() for _, _, err in procs]
            outcomes.append((codes, outs, errs))
    return outcomes  # type: ignore[return-value]


def _kill(procs: Sequence[subprocess.Popen[bytes] | zygote.Forked]) -> None:
    """End those still running and collect every exit status."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run_ranks(
    command: Sequence[str],
    world_size: int,
    *,
    cwd: Path,
    env: Mapping[str, str],
    timeout: float,
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` as ranks 0..world_size-1 of one node; wait for all (killing all at ``timeout``).

    Returns rank 0's ``CompletedProcess`` with the first non-zero exit status of any rank (rank 0's
    first) and every rank's output, each under a ``--- rank r ---`` line.

    Raises:
        subprocess.TimeoutExpired: when a rank is still running after ``timeout`` seconds.
    """
    port = str(free_port())
    envs = []
    for rank in range(world_size):
        rank_env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK="0")
        rank_env.update(LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
        envs.append(rank_env)
    codes, outs, errs = run_processes([command] * world_size, envs, cwd=cwd, timeout=timeout)
    status = next((code for code in codes if code != 0), 0)
    stdout = "".join(f"--- rank {r} ---\n{text}" for r, text in enumerate(outs))
    stderr = "".join(f"--- rank {r} ---\n{text}" for r, text in enumerate(errs))
    return subprocess.CompletedProcess(list(command), status, stdout, stderr)


def run_script(
    command: Sequence[str],
    world_size: int,
    *,
    cwd: Path,
    env: Mapping[str, str] | None = None,
    timeout: float,
) -> subprocess.CompletedProcess[str]:
    """``run_ranks`` for ``world_size`` > 1, a plain run of one process otherwise (no variables set)."""
    env = dict(os.environ if env is None else env)
    if world_size > 1:
        return run_ranks(command, world_size, cwd=cwd, env=env, timeout=timeout)
    codes, outs, errs = run_processes([command], [env], cwd=cwd, timeout=timeout)
    return subprocess.CompletedProcess(list(command), codes[0], outs[0], errs[0])
