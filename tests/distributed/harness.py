"""Run a function on N real gloo ranks (fresh processes), with a deadline, and collect results.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes that join one gloo process
group through a file rendezvous, call ``fn(rank, world_size, *args)`` and send back its (picklable)
return value. Any rank failing, or the deadline passing, kills all ranks and raises with every
rank's traceback, so a distributed bug fails the test instead of hanging CI.

``run_ranks_each(calls, world_size)`` makes several such calls in turn in one launch (a launch costs
seconds of imports per rank); a call that raises is reported as its own error and the next one runs.
"""

from __future__ import annotations

import io
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(
    fn: Callable[..., Any], rank: int, world_size: int, init_file: str, queue: Any, args: tuple
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        buffer = io.BytesIO()  # plain bytes: tensors in a Queue would live in shared memory the child frees
        torch.save(result, buffer)
        queue.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - everything goes back to the test
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """``[fn(0, N, *args), ..., fn(N-1, N, *args)]``, each computed in its own process."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, init_file, queue, args))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: list[str] = []
        try:
            for _ in range(world_size):
                rank, ok, payload = queue.get(timeout=timeout_s)
                if ok:
                    results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
                else:
                    errors.append(f"rank {rank}:\n{payload}")
                    break
        except Exception as exc:  # queue.Empty: a rank hung
            errors.append(
                f"no result within {timeout_s} s ({type(exc).__name__}); got ranks {sorted(results)}"
            )
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
    if errors:
        raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def _each(
    rank: int, world_size: int, calls: list[tuple[Callable[..., Any], tuple]]
) -> list[tuple[bool, Any]]:
    out: list[tuple[bool, Any]] = []
    for fn, args in calls:
        try:
            out.append((True, fn(rank, world_size, *args)))
        except Exception:  # noqa: BLE001 - reported as this call's error; the next call runs
            out.append((False, traceback.format_exc()))
    return out


def run_ranks_each(
    calls: list[tuple[Callable[..., Any], tuple]], world_size: int, timeout_s: float = 600.0
) -> list[list[Any] | RuntimeError]:
    """For each ``(fn, args)``, in order in one launch: ``run_ranks(fn, world_size, *args)``'s list, or
    the RuntimeError it would have raised when a rank raised (returned, for the caller to raise)."""
    per_rank = run_ranks(_each, world_size, calls, timeout_s=timeout_s)
    results: list[list[Any] | RuntimeError] = []
    for i in range(len(calls)):
        errors = [f"rank {r}:\n{per_rank[r][i][1]}" for r in range(world_size) if not per_rank[r][i][0]]
        if errors:
            results.append(RuntimeError("distributed run failed:\n" + "\n".join(errors)))
        else:
            results.append([per_rank[r][i][1] for r in range(world_size)])
    return results


def ranks(runs: dict[str, list[Any] | RuntimeError], name: str) -> list[Any]:
    """The per-rank results of ``runs[name]`` (what ``run_ranks`` returns); its error if a rank raised."""
    result = runs[name]
    if isinstance(result, RuntimeError):
        raise result
    return result
