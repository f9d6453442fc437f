"""Run a function on N real gloo ranks (separate processes), with a deadline, and collect results.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes (forked from the test session's
zygotes through ``tests.launch``, or fresh ones) that join one gloo process group through a file
rendezvous, call ``fn(rank, world_size, *args)`` and send back its (picklable) return value. Any rank
failing, or the deadline passing, kills all ranks and raises with every rank's traceback, so a
distributed bug fails the test instead of hanging CI.

``run_ranks_each(calls, world_size)`` makes several such calls in turn in one launch (a launch costs
seconds of imports per rank when it cannot fork); a call that raises is reported as its own error and
the next one runs.
"""

from __future__ import annotations

import importlib.util
import pickle
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from tests.launch import launch_env, run_processes

ROOT = Path(__file__).resolve().parents[2]


def _import_file(path: str) -> ModuleType:
    """The script at ``path`` imported as a module (its ``if __name__ == "__main__"`` part not run)."""
    spec = importlib.util.spec_from_file_location("__harness_caller__", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _rank_main(call: str, rank: int, world_size: int, init_file: str, result: str) -> int:
    """One rank: run the pickled ``(fn, args)`` in ``call`` and save ``(ok, value or traceback)``."""
    torch.set_num_threads(1)
    try:
        with open(call, "rb") as f:
            fn, args = pickle.load(f)
        if isinstance(fn, tuple):  # a function of the caller's script: (its file, its name)
            fn = getattr(_import_file(fn[0]), fn[1])
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        outcome: tuple[bool, Any] = (True, fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - everything goes back to the test
        outcome = (False, traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(outcome, result)
    return 0 if outcome[0] else 1


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """``[fn(0, N, *args), ..., fn(N-1, N, *args)]``, each computed in its own process."""
    with tempfile.TemporaryDirectory() as tmp:
        call = Path(tmp, "call.pkl")
        # A function of the script that called us (``__main__``) is found again by file and name, as
        # multiprocessing's spawn would re-import that script.
        main = sys.modules["__main__"]
        ref = (main.__file__, fn.__name__) if fn.__module__ == "__main__" else fn
        call.write_bytes(pickle.dumps((ref, args)))
        init_file, results = Path(tmp, "rendezvous"), [Path(tmp, f"result{r}.pt") for r in range(world_size)]
        commands = [
            [sys.executable, "-m", "tests.distributed.harness", str(call), str(r), str(world_size)]
            + [str(init_file), str(results[r])]
            for r in range(world_size)
        ]
        errors: list[str] = []
        try:
            codes, outs, errs = run_processes(
                commands, [launch_env()] * world_size, cwd=ROOT, timeout=timeout_s, stop_on_failure=True
            )
        except subprocess.TimeoutExpired:
            done = [r for r in range(world_size) if results[r].exists()]
            raise RuntimeError(
                f"distributed run failed:\nno result within {timeout_s} s; got {done}"
            ) from None
        values: dict[int, Any] = {}
        for r in range(world_size):
            try:  # a rank killed while writing (another one failed first) left a partial file
                ok, value = torch.load(results[r], weights_only=False)
            except (FileNotFoundError, RuntimeError, EOFError, pickle.UnpicklingError):
                continue
            if ok:
                values[r] = value
            else:
                errors.append(f"rank {r}:\n{value}")
        if not errors:  # a rank that ended without a result (killed, or crashed in C++)
            errors = [
                f"rank {r} ended with status {codes[r]}:\n{outs[r][-2000:]}{errs[r][-3000:]}"
                for r in range(world_size)
                if r not in values
            ]
    if errors:
        raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
    return [values[r] for r in range(world_size)]


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


if __name__ == "__main__":
    call_file, rank_arg, size_arg, rendezvous, result_file = sys.argv[1:]
    sys.exit(_rank_main(call_file, int(rank_arg), int(size_arg), rendezvous, result_file))
