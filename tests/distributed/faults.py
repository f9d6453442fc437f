"""Rank processes for the fault-injection tests: a dead or hung peer mid-step, or dead mid-save.

``python -m tests.distributed.faults OUT_DIR FAULT RANK WORLD_SIZE INIT_FILE TIMEOUT_S`` trains a small
model with :class:`~lightning_zero.ShardedAdamW` on a gloo group whose timeout is ``TIMEOUT_S``, and
writes ``OUT_DIR/rank{RANK}.json`` with how it ended (the error, the seconds from the fault to the
end). Rank 1 is the faulty one:

  * ``kill_mid_step``: SIGKILLs itself during backward of step 2 (a reduce-scatter is in flight);
  * ``hang_mid_step``: sleeps ``HANG x TIMEOUT_S`` where step 2's gradient collective would start;
  * ``kill_mid_async_save``: SIGKILLs itself while the background writer writes its shard;
  * ``kill_mid_save``: the same during a blocking save (``save_sharded``);
  * ``kill_mid_load`` / ``hang_mid_load``: every rank saves at step 1 and loads that checkpoint back
    at step 2 (a resume); rank 1 SIGKILLs itself, or sleeps ``HANG x TIMEOUT_S``, while it reads a shard
    file. Rank 0 records whether the checkpoint still verifies (every file's size and sha256);
  * ``kill_mid_pipeline`` / ``error_mid_pipeline``: two pipeline stages, rank 1's forward at step 2
    SIGKILLs itself or raises an error of its own (:func:`run_pipeline`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_zero import ShardedAdamW, ZeroConfig
from lightning_zero.checkpoint import read_meta, save_sharded, verify_files
from lightning_zero.checkpoint.async_save import AsyncCheckpointWriter
from lightning_zero.checkpoint.reshard import ShardFiles, load_sharded, preflight
from tests.distributed.models import TinyNet, batch

FAULT_STEP = 2
HANG = 2.5  # a hang outlasts the survivor's timeout by 1.5 timeouts, a loaded machine's margin


def _arm(fault: str, rank: int, opt: ShardedAdamW, timeout_s: float, marks: dict[str, float]) -> None:
    """Install the fault on rank 1; every rank records when the fault step starts."""
    if rank != 1:
        return
    comm = opt.engine.comm
    original = comm.reduce_scatter

    def reduce_scatter(*args: Any, **kwargs: Any) -> Any:
        if marks.get("step") == FAULT_STEP:
            if fault == "kill_mid_step":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "hang_mid_step" and not marks.get("hung"):  # once, not once per bucket
                marks["hung"] = 1.0
                time.sleep(HANG * timeout_s)
        return original(*args, **kwargs)

    comm.reduce_scatter = reduce_scatter  # type: ignore[method-assign]
    if fault in ("kill_mid_async_save", "kill_mid_save"):
        import lightning_zero.checkpoint.format as checkpoint_format

        write = checkpoint_format._write

        def dying_write(obj: Any, path: Path) -> Any:
            if path.name.startswith("shard-"):
                os.kill(os.getpid(), signal.SIGKILL)
            return write(obj, path)

        checkpoint_format._write = dying_write  # type: ignore[assignment]
    if fault in ("kill_mid_load", "hang_mid_load"):
        read = ShardFiles.__getitem__

        def failing_read(files: ShardFiles, saved_rank: int) -> Any:
            if fault == "kill_mid_load":
                os.kill(os.getpid(), signal.SIGKILL)
            if not marks.get("hung"):  # once: the reads that follow are the ordinary ones
                marks["hung"] = 1.0
                time.sleep(HANG * timeout_s)
            return read(files, saved_rank)

        ShardFiles.__getitem__ = failing_read  # type: ignore[method-assign]


def _resume(opt: ShardedAdamW, path: Path, result: dict[str, Any]) -> None:
    """Load ``path`` back into ``opt`` as a resume does; rank 0 then (also after a failure) records
    the checkpoint's problems, which must be none: a failed load reads, never writes."""
    try:
        meta = read_meta(path)
        preflight(opt.engine, path, meta)
        load_sharded(opt.engine, path, meta)
    finally:
        if opt.engine.comm.rank == 0:
            result["checkpoint_problems"] = verify_files(path, read_meta(path))


def _join(rank: int, world_size: int, init_file: str, timeout_s: float) -> None:
    """One thread, and the gloo process group of the ranks, with the test's timeout."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def run(out_dir: Path, fault: str, rank: int, world_size: int, init_file: str, timeout_s: float) -> None:
    _join(rank, world_size, init_file, timeout_s)
    torch.manual_seed(0)
    model = TinyNet()
    config = ZeroConfig(bucket_cap_mb=0.0004, first_bucket_cap_mb=0.0002)
    opt = ShardedAdamW(model.parameters(), lr=1e-2, config=config)
    marks: dict[str, float] = {}
    _arm(fault, rank, opt, timeout_s, marks)
    writer = AsyncCheckpointWriter(timedelta(seconds=timeout_s))
    result: dict[str, Any] = {"error": None}
    try:
        for step in range(4):
            marks["step"] = step
            if step == FAULT_STEP - 1 and fault.endswith("_mid_load"):
                save_sharded(opt.engine, out_dir / "ckpt", {"global_step": step}, {}, 2)
            if step == FAULT_STEP:
                marks["fault_at"] = time.monotonic()
                if fault == "kill_mid_async_save":
                    writer.save(opt.engine, out_dir / "ckpt", {"global_step": step}, {}, 2)
                    writer.wait()
                if fault == "kill_mid_save":
                    save_sharded(opt.engine, out_dir / "ckpt", {"global_step": step}, {}, 2)
                if fault.endswith("_mid_load"):
                    _resume(opt, out_dir / "ckpt", result)
            x, y = batch(step, 0, rank, 4, torch.float32)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    except Exception as err:  # noqa: BLE001 - what a user would see, recorded
        result["error"] = f"{type(err).__name__}: {err}"
        cause: BaseException | None = err
        result["chain"] = []  # the exception and its causes: a caller may act on a CommError in it
        while cause is not None and len(result["chain"]) < 10:
            result["chain"].append(type(cause).__name__)
            cause = cause.__cause__ or cause.__context__
    result["seconds_after_fault"] = time.monotonic() - marks.get("fault_at", time.monotonic())
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


def run_pipeline(
    out_dir: Path, fault: str, rank: int, world_size: int, init_file: str, timeout_s: float
) -> None:
    """Two pipeline stages (one rank each) under torch's 1F1B schedule; at step 2 the second stage's
    forward SIGKILLs its process (``kill_mid_pipeline``: the first stage waits for a gradient that never
    comes) or raises an error of its own (``error_mid_pipeline``: an injected out-of-memory)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_zero.comm.pipeline import ShardedStage, schedule, send_receive_failures

    _join(rank, world_size, init_file, timeout_s)
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("pipeline", "data"))
    torch.manual_seed(rank)
    layer = nn.Linear(4, 4)
    marks: dict[str, float] = {}

    class Faulty(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if rank == 1 and marks.get("step") == FAULT_STEP:
                if fault == "kill_mid_pipeline":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("out of memory (injected)")
            return self.layer(x)

    opt = ShardedAdamW(layer.parameters(), lr=1e-2, device_mesh=mesh["data"], pipeline_group=mesh["pipeline"])
    stage = ShardedStage(Faulty(), rank, world_size, torch.device("cpu"), mesh["pipeline"], opt.no_sync)
    run = schedule("1f1b", stage, 2, torch.nn.functional.mse_loss)
    result: dict[str, Any] = {"error": None}
    try:
        for step in range(4):
            marks["step"] = step
            if step == FAULT_STEP:
                marks["fault_at"] = time.monotonic()
            x, y = torch.randn(4, 4), torch.randn(4, 4)
            with send_receive_failures(f"pipeline rank {rank}'s step"):
                run.step(x) if rank == 0 else run.step(target=y, losses=[])
            opt.step()
            opt.zero_grad()
    except Exception as err:  # noqa: BLE001 - what a user would see, recorded
        result["error"] = f"{type(err).__name__}: {err}"
        result["chain"], result["messages"] = [], []
        cause: BaseException | None = err
        while cause is not None and len(result["chain"]) < 10:
            result["chain"].append(type(cause).__name__)
            result["messages"].append(str(cause))
            cause = cause.__cause__ or cause.__context__
    result["seconds_after_fault"] = time.monotonic() - marks.get("fault_at", time.monotonic())
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    out, fault_name, rank_arg, size_arg, init, timeout_arg = sys.argv[1:7]
    runner = run_pipeline if fault_name.endswith("_mid_pipeline") else run
    runner(Path(out), fault_name, int(rank_arg), int(size_arg), init, float(timeout_arg))
    os._exit(0)  # do not wait in the process group's destructor for a dead peer
