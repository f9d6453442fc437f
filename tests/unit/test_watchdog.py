"""The collective watchdog (NCCL's missing ``CommError``), on CPU with an injected collective that never
completes: what NCCL does to a rank whose peer died or hung (``Work.wait()`` returns, the kernel spins).
The NCCL part itself (``abort`` ending the kernels) needs a GPU: ``benchmarks/gpu_check.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero.comm import Comm, CommError
from lightning_zero.comm.backends import SingleProcess
from lightning_zero.comm.watchdog import EXIT_PEER_FAILURE, Watchdog

ROOT = Path(__file__).resolve().parents[2]


class Stuck:
    """A collective whose peer never joins."""

    def wait(self) -> bool:
        return True  # NCCL: a stream wait, returns at once

    def is_completed(self) -> bool:
        return False


class StuckBackend(SingleProcess):
    """Two ranks whose all-reduce never completes; counts aborts."""

    def __init__(self) -> None:
        super().__init__(None, 0, 2, torch.device("cpu"))
        self.aborts = 0

    def all_reduce(self, tensor: torch.Tensor, op: str) -> Any:
        return Stuck()

    def abort(self) -> None:
        self.aborts += 1


def _stuck_comm(watchdog: Watchdog, timeout_s: float) -> tuple[Comm, StuckBackend]:
    backend = StuckBackend()
    comm = Comm(None, backend, role="replicas")
    comm.watch(watchdog, timeout_s)
    return comm, backend


def test_a_collective_that_never_completes_raises_comm_error_in_the_main_thread_within_the_timeout() -> None:
    watchdog = Watchdog(CommError, poll_s=0.05, exit_after=None)
    comm, backend = _stuck_comm(watchdog, timeout_s=0.5)
    start = time.monotonic()
    handle = comm.all_reduce(torch.ones(4), what="gradient all-reduce across replicas")
    comm.wait(handle)  # returns at once, as on NCCL
    with pytest.raises(CommError) as caught:
        while time.monotonic() - start < 10:  # the training thread goes on (forward, backward, ...)
            sum(range(1000))
    waited = time.monotonic() - start
    assert 0.5 <= waited <= 0.5 + 1.0, waited
    message = str(caught.value)
    assert message.startswith("rank 0 of 2 in the replicas group: gradient all-reduce across replicas of 4")
    assert "timeout of 0.5 s" in message, message
    assert backend.aborts == 1  # NCCL: the communicator is aborted so that its kernels end
    with pytest.raises(CommError, match="did not complete"):  # every later collective fails at once
        comm.all_reduce(torch.ones(1))


def test_completed_collectives_are_forgotten_and_never_fire() -> None:
    watchdog = Watchdog(CommError, poll_s=0.02, exit_after=None)
    comm = Comm(None, SingleProcess(None, 0, 2, torch.device("cpu")))
    comm.watch(watchdog, 0.1)
    for _ in range(50):
        comm.wait(comm.all_reduce(torch.ones(2)))  # done at once
    time.sleep(0.3)
    assert watchdog.failure is None and watchdog.pending == 0


def test_a_main_thread_that_never_returns_to_python_is_ended_with_status_75() -> None:
    """The main thread blocked where no exception can reach it (a stream synchronisation on NCCL; a
    long ``time.sleep`` here): one more timeout after the error, the process exits with 75 (the
    recipes' requeue status for a peer failure) and says why, instead of hanging."""
    script = textwrap.dedent(
        """
        import time, torch
        from lightning_zero.comm import Comm, CommError
        from lightning_zero.comm.watchdog import Watchdog
        from tests.unit.test_watchdog import _stuck_comm
        comm, _ = _stuck_comm(Watchdog(CommError, poll_s=0.05), timeout_s=0.5)
        comm.all_reduce(torch.ones(3))
        time.sleep(60)
        """
    )
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == EXIT_PEER_FAILURE, done.stderr[-2000:]
    assert time.monotonic() - start < 30
    assert "rank 0 of 2 in the replicas group: all-reduce of 3 elements did not complete" in done.stderr


class FailedWork:
    """A collective that completed with an error (what torch's own watchdog leaves after aborting a
    timed-out NCCL communicator under TORCH_NCCL_ASYNC_ERROR_HANDLING=2)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def exception(self) -> BaseException:
        return RuntimeError("NCCL communicator was aborted")


def test_a_collective_that_completed_with_an_error_is_not_taken_for_done() -> None:
    watchdog = Watchdog(CommError, poll_s=0.05, exit_after=None)
    watchdog.watch(FailedWork(), "rank 1 of 2: all-reduce of 8 elements", timeout_s=0.3)
    deadline = time.monotonic() + 5
    with pytest.raises(CommError, match="rank 1 of 2: all-reduce of 8 elements did not complete"):
        while time.monotonic() < deadline:
            sum(range(1000))


def test_the_strategies_keep_torchs_nccl_watchdog_from_ending_the_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both strategies set TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (abort, do not end the process) before
    Lightning creates the process group, unless the user chose a value."""
    from lightning.fabric.strategies import DDPStrategy as FabricDDP
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero import ZeroFabricStrategy, ZeroStrategy
    from lightning_zero.comm.watchdog import NCCL_ERROR_HANDLING

    seen = []
    for base in (DDPStrategy, FabricDDP):
        monkeypatch.setattr(
            base, "setup_environment", lambda self: seen.append(os.environ.get(NCCL_ERROR_HANDLING))
        )
    for cls in (ZeroStrategy, ZeroFabricStrategy):
        monkeypatch.delenv(NCCL_ERROR_HANDLING, raising=False)
        cls().setup_environment()
        monkeypatch.setenv(NCCL_ERROR_HANDLING, "1")  # the user's choice is kept
        cls().setup_environment()
    assert seen == ["2", "1", "2", "1"]


class HangingObjectCollective(SingleProcess):
    """A CUDA-like backend (what the watchdog watches) whose object all-gather never returns: torch's
    object collectives synchronise inside the call, so no handle or event exists to watch."""

    def __init__(self) -> None:
        super().__init__(None, 0, 2, torch.device("cuda"))
        self.aborts = 0

    def all_gather_object(self, obj: Any) -> list[Any]:
        end = time.monotonic() + 5.0  # a peer that never sends (bounded: a broken watchdog fails the test)
        while time.monotonic() < end:
            time.sleep(0.01)
        return [obj, obj]

    def abort(self) -> None:
        self.aborts += 1


def test_a_blocking_collective_that_never_returns_is_watched_while_it_lasts() -> None:
    backend = HangingObjectCollective()
    comm = Comm(None, backend)
    comm.watch(Watchdog(CommError, poll_s=0.05, exit_after=None), 0.5)
    start = time.monotonic()
    with pytest.raises(CommError, match="rank 0 of 2: all-gather of a Python object did not complete"):
        comm.all_gather_object({"files": ["shard-0.pt"]})
    assert time.monotonic() - start <= 0.5 + 1.0
    assert backend.aborts == 1
