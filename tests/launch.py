"""Start every rank of a Lightning (or Fabric) test script at once, as a cluster launcher does.

Lightning's own launcher (``_SubprocessScriptLauncher``) re-runs the command for ranks > 0 only once rank 0
has imported Lightning and reached ``fit``/``launch``: a 2-rank launch pays Lightning's import (about 9 s
on the 2-core test machine) twice, one after the other. The test scripts that only need N ranks (not
Lightning's launcher itself: the recipe, docs, Fabric-launch and fault tests use that one) start here
with what that launcher gives each rank in its environment (``MASTER_ADDR``, ``MASTER_PORT``,
``NODE_RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``), all ranks together. Lightning then sees processes created
externally (``LightningEnvironment``) and every rank runs exactly what it runs under its launcher, which
re-runs the same command with those variables; only the imports overlap.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        procs = []
        for rank in range(world_size):
            rank_env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK="0")
            rank_env.update(LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
            out = open(Path(logs, f"{rank}.out"), "w")  # noqa: SIM115 - closed below, after the wait
            err = open(Path(logs, f"{rank}.err"), "w")  # noqa: SIM115
            procs.append(
                (subprocess.Popen(list(command), cwd=cwd, env=rank_env, stdout=out, stderr=err), out, err)
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
        stdout = "".join(f"--- rank {r} ---\n{Path(logs, f'{r}.out').read_text()}" for r in range(world_size))
        stderr = "".join(f"--- rank {r} ---\n{Path(logs, f'{r}.err').read_text()}" for r in range(world_size))
    codes = [proc.returncode for proc, _, _ in procs]
    status = next((code for code in codes if code != 0), 0)
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
    return subprocess.run(list(command), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
