"""The parts of ``benchmarks/gpu_check.py`` for issue 28 (right on NCCL): what only a GPU can show.

* ``sync_debug``: training steps of stages 1, 2 and 3 (accumulation under ``no_sync``, clipping) at
  world size 1 under ``torch.cuda.set_sync_debug_mode("error")``: any host synchronisation in the
  hot path raises and is reported with its traceback (on CPU: the suite's counter of what would
  synchronise, ``tests/distributed/host_syncs.py``). Expected: none, as the table in
  ``docs/strategy.md`` says for these options.
* ``watchdog``: a collective that never completes, injected behind a long-running CUDA kernel (a
  peer that never joins leaves NCCL's kernel spinning the same way), on a ``Comm`` watched with a
  3 s timeout: the main thread, doing host work, must get a ``CommError`` naming the collective
  within the timeout plus the watchdog's poll, and the group's abort must have been called. Then the
  same in a child process whose main thread is blocked in ``torch.cuda.synchronize()`` behind that
  kernel: the watchdog must end it with exit status 75 within two timeouts.
* ``max_connections``: the ``parity`` part again in a child process with
  ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (one hardware queue: kernels of different streams serialise),
  stage 3 included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
WATCHDOG_TIMEOUT_S = 3.0


def part_sync_debug(device: str, init_process_group: Any) -> dict[str, Any]:
    """Host synchronisations in steps of each stage (none expected with the default options);
    ``init_process_group(backend)`` starts the world-size-1 group if none is there."""
    init_process_group("nccl" if device == "cuda" else "gloo")
    return {f"stage{stage}": _sync_debug_one(device, stage) for stage in (1, 2, 3)}


def _sync_debug_one(device: str, stage: int) -> dict[str, Any]:
    from lightning_zero import ShardedAdamW, ZeroConfig
    from tests.distributed.host_syncs import HostSyncs

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).to(
        device
    )
    units = {"min_unit_numel": 1000} if stage == 3 else {}
    config = ZeroConfig(stage=stage, bucket_cap_mb=0.25, first_bucket_cap_mb=0.1, **units)
    opt = ShardedAdamW(
        model.parameters(), lr=1e-3, fused=True, config=config, module=model if stage == 3 else None
    )

    def step(seed: int) -> None:
        for micro in range(2):
            x = torch.randn(
                32, 256, device=device, generator=torch.Generator(device).manual_seed(seed + micro)
            )
            loss = model(x).pow(2).mean()
            if micro == 0:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()

    step(0)  # warm-up: plans, pools and cached indices are built once
    out: dict[str, Any] = {"error": None}
    with HostSyncs() as counted:
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            for seed in range(1, 4):
                step(100 * seed)
        except RuntimeError as err:  # the synchronising call, named by torch
            out["error"] = f"{err}"[:2000]
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    out["counted_per_step"] = counted.total / 3
    out["counted"] = dict(counted.count)
    return out


def _sleep_cycles_per_s() -> float:
    """``torch.cuda._sleep`` spins for a number of GPU clock cycles: how many make a second."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / (start.elapsed_time(end) / 1000.0)


class _KernelBehind:
    """A collective's handle whose completion is an event behind a kernel that runs for ``seconds``
    (CUDA), or that never completes (CPU)."""

    def __init__(self, device: str, seconds: float) -> None:
        self.event = None
        if device == "cuda":
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                torch.cuda._sleep(int(seconds * _sleep_cycles_per_s()))
                self.event = torch.cuda.Event()
                self.event.record(stream)

    def wait(self) -> bool:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)  # NCCL's wait: the stream waits
        return True

    def is_completed(self) -> bool:
        return bool(self.event.query()) if self.event is not None else False


def stuck_comm(device: str, seconds: float) -> tuple[Any, Any]:
    """A 2-rank ``Comm`` (role ``replicas``) whose all-reduce never completes within ``seconds``."""
    from lightning_zero.comm import Comm
    from lightning_zero.comm.backends import SingleProcess

    class Stuck(SingleProcess):
        aborts = 0

        def all_reduce(self, tensor: torch.Tensor, op: str) -> Any:
            return _KernelBehind(device, seconds)

        def abort(self) -> None:
            Stuck.aborts += 1

    backend = Stuck(None, 0, 2, torch.device(device))
    return Comm(None, backend, role="replicas"), backend


BARRIER_KERNEL_S = 1.0


def barrier_blocks(device: str) -> dict[str, Any]:
    """``Comm.barrier`` behind an all-reduce whose kernel runs ``BARRIER_KERNEL_S``: on CUDA the host
    must wait for it (waiting for a handle only orders the stream; preflight's probe check relies
    on the barrier), so ``barrier_host_blocked_s`` is at least ~1 s there; on CPU the injected
    collective has no kernel and it is ~0."""
    comm, _ = stuck_comm(device, BARRIER_KERNEL_S)
    start = time.monotonic()
    comm.barrier("injected barrier")
    return {"barrier_host_blocked_s": time.monotonic() - start, "barrier_kernel_s": BARRIER_KERNEL_S}


def part_watchdog(device: str) -> dict[str, Any]:
    from lightning_zero.comm import CommError
    from lightning_zero.comm.watchdog import Watchdog

    timeout = WATCHDOG_TIMEOUT_S
    out_barrier = barrier_blocks(device)
    comm, backend = stuck_comm(device, 10 * timeout)
    comm.watch(Watchdog(CommError, poll_s=0.2, exit_after=None), timeout)
    tensor = torch.ones(4, device=device)
    start = time.monotonic()
    out: dict[str, Any] = {"timeout_s": timeout, "raised": None, **out_barrier}
    try:
        comm.wait(comm.all_reduce(tensor, what="injected all-reduce"))  # returns at once on CUDA
        while time.monotonic() - start < 6 * timeout:  # the host goes on (next forward, backward, ...)
            torch.ones(8, device=device).add_(1.0)
            time.sleep(0.001)
    except CommError as err:
        out["raised"] = str(err)
    out["seconds_to_comm_error"] = time.monotonic() - start
    out["aborts"] = type(backend).aborts
    if device == "cuda":
        torch.cuda.synchronize()  # let the sleeping kernel end before the next part
    child = _blocked_child(device, timeout)
    out.update(child)
    return out


_BLOCKED = """
import sys, time, torch
sys.path.insert(0, {root!r})
from benchmarks.gpu_nccl_checks import stuck_comm
from lightning_zero.comm import CommError
from lightning_zero.comm.watchdog import Watchdog
comm, _ = stuck_comm({device!r}, {kernel_s})
comm.watch(Watchdog(CommError, poll_s=0.2), {timeout})
comm.wait(comm.all_reduce(torch.ones(4, device={device!r}), what="injected all-reduce"))
if {device!r} == "cuda":
    torch.cuda.synchronize()  # blocked in C++ behind the stuck kernel: no exception can reach it
else:
    time.sleep({kernel_s})
print("not ended by the watchdog")
"""


def _blocked_child(device: str, timeout: float) -> dict[str, Any]:
    code = _BLOCKED.format(root=str(ROOT), device=device, kernel_s=10 * timeout, timeout=timeout)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return {
        "blocked_child_exit_status": done.returncode,
        "blocked_child_seconds": time.monotonic() - start,
        "blocked_child_said": done.stderr.strip().splitlines()[-1:] if done.stderr else [],
    }


def part_max_connections(device: str) -> dict[str, Any]:
    """``parity`` in a child with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (stage 3 included)."""
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "gpu_check.py"),
                "--device",
                device,
                "--parts",
                "parity",
            ]
            + ["--out", out],
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1"),
            cwd=ROOT,
        )
        report_file = Path(out, "gpu_check.json")
        report = json.loads(report_file.read_text()) if report_file.exists() else {}
    parity = report.get("parity", {"error": done.stderr[-2000:]})
    return {"exit_status": done.returncode, "parity": parity}
