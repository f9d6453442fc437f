"""Fits with ``ModelCheckpoint`` and fault injection, for the asynchronous-save tests.

Run as a script it performs the fits given as JSON in one launch (Lightning's launcher re-runs this
file for rank 1, which then runs the same fits in the same order); every rank writes
``--out-dir/rank<r>.json``: per fit, what a probe callback saw after chosen training steps (the
checkpoint directory's entries, whether a save was still in flight) and the error the fit raised on
that rank, if any (its type, message and the functions it passed through)::

    python -m tests.distributed.async_fit --out-dir DIR --cases '[{"checkpoint_dir": "ck"}]'

Fault injection (case keys, applied to this script's process only; nothing in the library reads them):
``slow_write_s`` makes every shard file write sleep first; ``fail_save=n`` makes rank 1 fail to write
its shard file in the n-th save; ``fail_remove`` makes rank 0's checkpoint removals fail.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from tests.distributed.lit_fit import TinyLit, make_strategy


class Probe(Callback):
    """After each step in ``steps``: the entries of ``directory`` and whether a save is in flight."""

    def __init__(self, directory: str, steps: list[int]) -> None:
        self.directory, self.steps = Path(directory), steps
        self.seen: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step in self.steps:
            entries = sorted(p.name for p in self.directory.iterdir()) if self.directory.is_dir() else []
            self.seen.append(
                {
                    "step": trainer.global_step,
                    "entries": entries,
                    "pending": trainer.strategy.checkpoint_in_flight,
                }
            )


@contextlib.contextmanager
def faults(
    slow_write_s: float = 0.0, fail_save: int | None = None, fail_remove: bool = False
) -> Iterator[None]:
    """Patch the shard writer and the checkpoint removal of this process for one fit."""
    import lightning_zero.checkpoint.format as checkpoint_module

    original_write, original_remove = checkpoint_module._write, TorchCheckpointIO.remove_checkpoint
    shard_saves = {"n": 0}

    def write(obj: Any, path: Path) -> Any:
        if path.name.startswith("shard-"):
            shard_saves["n"] += 1
            time.sleep(slow_write_s)
            if torch.distributed.get_rank() == 1 and shard_saves["n"] == fail_save:
                raise OSError(f"injected: rank 1 cannot write {path.name}")
        return original_write(obj, path)

    def remove(self: TorchCheckpointIO, path: Any) -> None:
        assert torch.distributed.get_rank() == 0  # Lightning removes on rank 0 only
        raise PermissionError(f"injected: rank 0 cannot remove {path}")

    checkpoint_module._write = write
    if fail_remove:
        TorchCheckpointIO.remove_checkpoint = remove  # type: ignore[method-assign]
    try:
        yield
    finally:
        checkpoint_module._write = original_write
        TorchCheckpointIO.remove_checkpoint = original_remove  # type: ignore[method-assign]


def fit(
    checkpoint_dir: str,
    async_checkpoint: bool = True,
    steps: int = 7,
    save_top_k: int = 2,
    save_last: bool | str = False,
    probe_steps: tuple[int, ...] = (),
    slow_write_s: float = 0.0,
    fail_save: int | None = None,
    fail_remove: bool = False,
) -> dict[str, Any]:
    """Fit TinyLit on 2 ranks (float64, identical batches) with a ModelCheckpoint every 2 steps.

    Returns:
        ``{"probes": [...], "error": None | {"type", "message", "functions"}, "global_step": int}``.
    """
    probe = Probe(checkpoint_dir, list(probe_steps))
    trainer = L.Trainer(
        strategy=make_strategy("zero_small_buckets", async_checkpoint=async_checkpoint),
        devices=2,
        accelerator="cpu",
        precision="64-true",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[
            probe,
            ModelCheckpoint(
                checkpoint_dir,
                every_n_train_steps=2,
                save_top_k=save_top_k,
                monitor="step",
                mode="max",
                save_last=save_last,
            ),
        ],
    )
    error = None
    with faults(slow_write_s, fail_save, fail_remove):
        try:
            trainer.fit(TinyLit(unused_every=0, batch_size=6, identical_batches=True))
        except Exception as err:  # noqa: BLE001 - reported to the test, per rank
            functions = [frame.name for frame in traceback.extract_tb(err.__traceback__)]
            error = {"type": type(err).__name__, "message": str(err), "functions": functions}
    return {"probes": probe.seen, "error": error, "global_step": trainer.global_step}


def main() -> None:
    import lightning_zero  # noqa: F401  # registers the strategies

    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--cases", required=True, help="JSON list of keyword-argument dicts for fit()")
    args = parser.parse_args()
    reports = [fit(**case) for case in json.loads(args.cases)]
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    Path(args.out_dir, f"rank{rank}.json").write_text(json.dumps(reports))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
