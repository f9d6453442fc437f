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

import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests import zygote


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_all(
    command: Sequence[str], envs: Sequence[Mapping[str, str]], *, cwd: Path, timeout: float
) -> tuple[list[int], list[str], list[str]]:
    """Start ``command`` once per environment in ``envs`` (process r in rank slot r), all at once; wait
    for all, killing all at ``timeout``. Returns each process's exit status, stdout and stderr."""
    if zygote.enabled():
        zygote.start(len(envs), envs[0])  # every slot's zygote at once, before the deadline starts
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        procs = []
        for rank, rank_env in enumerate(envs):
            out = open(Path(logs, f"{rank}.out"), "w")  # noqa: SIM115 - closed below, after the wait
            err = open(Path(logs, f"{rank}.err"), "w")  # noqa: SIM115
            procs.append(
                (zygote.popen(command, slot=rank, cwd=cwd, env=rank_env, stdout=out, stderr=err), out, err)
            )
        try:
            for proc, _, _ in procs:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise subprocess.TimeoutExpired(list(command), timeout) from None
        finally:
            for proc, out, err in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                out.close()
                err.close()
        outs = [Path(logs, f"{rank}.out").read_text() for rank in range(len(envs))]
        errs = [Path(logs, f"{rank}.err").read_text() for rank in range(len(envs))]
    codes = [proc.returncode for proc, _, _ in procs]
    assert all(code is not None for code in codes)
    return codes, outs, errs  # type: ignore[return-value]


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
    codes, outs, errs = _run_all(command, envs, cwd=cwd, timeout=timeout)
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
    codes, outs, errs = _run_all(command, [env], cwd=cwd, timeout=timeout)
    return subprocess.CompletedProcess(list(command), codes[0], outs[0], errs[0])
