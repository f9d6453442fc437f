"""Run a function on N real gloo ranks (fresh processes), with a deadline, and collect results.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes that join one gloo process
group through a file rendezvous, call ``fn(rank, world_size, *args)`` and send back its (picklable)
return value. Any rank failing, or the deadline passing, kills all ranks and raises with every
rank's traceback, so a distributed bug fails the test instead of hanging CI.
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
