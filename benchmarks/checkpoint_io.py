"""Checkpoint save / load / consolidation cost: lightning-zero directories against Lightning "ddp".

    python benchmarks/checkpoint_io.py [--layers 8] [--dim 512]

A GPT of >= 25M parameters (fp32, AdamW) trains 7 steps on 2 CPU ranks and saves a checkpoint at
the end of steps 3 and 5, from a callback, while training goes on; a fresh launch then loads it.
Printed side by side (rank 0; wall times after a barrier):

  * save (the second of two, the steady state): seconds the training loop is blocked, seconds until
    the checkpoint is committed (an asynchronous save: watched from another thread while the next
    steps run), the peak RSS above the RSS before the save (until the commit; for an asynchronous
    save that includes the working memory of the step that overlaps it), and the duration of the
    training step after the save against the median step without a save nearby;
  * load: seconds from the LightningModule's ``setup`` hook to ``on_train_start`` (strategy setup
    and restore), and the peak RSS then;
  * size on disk;
  * plain ``torch.distributed.checkpoint`` (DCP) under "ddp", for reference: its load figures are the
    restore alone (no Lightning setup), so compare its load time with care;
  * ``lightning-zero consolidate``: seconds and peak RSS of the process, against a plain
    ``torch.load`` of the equivalent single file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

# the checkout this file is in, before an installed lightning_zero (e.g. another worktree's editable
# install), then this folder for step_time
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from step_time import GPT  # noqa: E402

import lightning_zero  # noqa: E402

VARIANTS = {
    "zero (sharded dir)": {"strategy": "zero"},
    "zero (sharded dir, async)": {"strategy": "zero", "async_checkpoint": True},
    "zero (gathered single file)": {"strategy": "zero", "sharded_checkpoint": False},
    "ddp (single file)": {"strategy": "ddp"},
    "ddp + plain DCP": {"strategy": "ddp", "dcp": True},
}


def _status_mb(key: str) -> float:
    return int(re.search(key + r":\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


class Timed(GPT):
    def setup(self, stage: str) -> None:
        self.t_setup = time.perf_counter()
        _reset_peak()

    def on_train_start(self) -> None:
        self.load_s = time.perf_counter() - self.t_setup
        self.load_peak = _status_mb("VmHWM")


class SaveTimer(Callback):
    """Saves at the end of ``SAVE_STEPS`` while training goes on, and times the second save."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.batch_end: dict[int, float] = {}  # step -> time its batch ended (after a save there: returned)
        self.figures: dict[str, float] = {}
        self.watcher: threading.Thread | None = None

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        step = trainer.global_step
        self.batch_end[step] = time.perf_counter()
        if step not in SAVE_STEPS:
            return
        trainer.strategy.barrier()
        before = _status_mb("VmRSS")
        _reset_peak()
        start = time.perf_counter()
        trainer.save_checkpoint(self.path)
        returned = self.batch_end[step] = time.perf_counter()
        self.figures.update(save_blocked_s=returned - start, save_total_s=returned - start)
        self.figures["save_peak_added_mb"] = _status_mb("VmHWM") - before
        if getattr(trainer.strategy, "checkpoint_in_flight", False):
            self.watcher = threading.Thread(target=self._watch, args=(trainer.strategy, start, before))
            self.watcher.start()

    def _watch(self, strategy: Any, start: float, before: float) -> None:
        """The moment the asynchronous save is committed, seen from beside the training loop."""
        while strategy.checkpoint_in_flight:
            time.sleep(0.002)
        self.figures["save_total_s"] = time.perf_counter() - start
        self.figures["save_peak_added_mb"] = _status_mb("VmHWM") - before

    def results(self) -> dict[str, float]:
        """The save figures, the step after the timed save and the median step not after a save."""
        if self.watcher is not None:
            self.watcher.join()
        ends = self.batch_end
        durations = {k: ends[k] - ends[k - 1] for k in ends if k - 1 in ends}
        plain = sorted(d for k, d in durations.items() if k - 1 not in SAVE_STEPS)
        next_step = durations[SAVE_STEPS[-1] + 1]
        return {**self.figures, "next_step_s": next_step, "plain_step_s": plain[len(plain) // 2]}


SAVE_STEPS = (3, 5)
STEPS = 7


def strategy_of(spec: dict[str, Any]) -> Any:
    if spec["strategy"] == "ddp":
        return "ddp"
    return lightning_zero.ZeroStrategy(
        async_checkpoint=spec.get("async_checkpoint", False),
        sharded_checkpoint=spec.get("sharded_checkpoint", True),
    )


def run_variant(name: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    spec = VARIANTS[name]
    path = Path(args.out, re.sub(r"\W+", "_", name) + ".ckpt")
    tokens = torch.randint(0, 8192, (64, 129), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    figures: dict[str, float] = {}
    for phase in ("save", "load"):
        model = Timed(8192, args.dim, args.layers, 128, zero_redundancy=False)
        timer = SaveTimer(path)
        saving_in_fit = phase == "save" and not spec.get("dcp")
        trainer = L.Trainer(
            strategy=strategy_of(spec),
            devices=2,
            accelerator="cpu",
            # load: one step past the saved one, so that on_train_start runs
            max_steps=STEPS if phase == "save" else SAVE_STEPS[-1] + 1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[timer] if saving_in_fit else None,
        )
        trainer.fit(model, data, ckpt_path=str(path) if phase == "load" else None)
        if spec.get("dcp"):
            figures.update(dcp_figures(trainer, model, path))
            break
        if phase == "save":
            figures.update(timer.results())
            figures["params"] = sum(p.numel() for p in model.parameters())
        else:
            figures["load_s"], figures["load_peak_mb"] = model.load_s, model.load_peak
    if trainer.global_rank == 0:
        if spec.get("dcp"):
            path = Path(str(path) + ".1")
        size = (
            sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            if path.is_dir()
            else path.stat().st_size
        )
        figures["size_mb"] = size / 2**20
        Path(args.out, "figures.jsonl").open("a").write(json.dumps({"name": name, **figures}) + "\n")


def dcp_figures(trainer: L.Trainer, model: GPT, path: Path) -> dict[str, float]:
    """torch.distributed.checkpoint save and in-place load of the same model and AdamW state (no
    Lightning loop state), timed like the other variants; load is the restore alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    wrapped, optimizer = trainer.strategy.model, trainer.optimizers[0]
    figures: dict[str, float] = {"params": sum(p.numel() for p in model.parameters())}
    for attempt in range(2):  # the second save is the steady state
        model_state, optim_state = get_state_dict(wrapped, optimizer)
        trainer.strategy.barrier()
        before = _status_mb("VmRSS")
        _reset_peak()
        start = time.perf_counter()
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path) + f".{attempt}")
        trainer.strategy.barrier()
        figures["save_blocked_s"] = figures["save_total_s"] = time.perf_counter() - start
        figures["save_peak_added_mb"] = _status_mb("VmHWM") - before
    figures["next_step_s"] = figures["plain_step_s"] = float("nan")  # saved after fit, not during it
    model_state, optim_state = get_state_dict(wrapped, optimizer)
    _reset_peak()
    start = time.perf_counter()
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path) + ".1")
    set_state_dict(wrapped, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    trainer.strategy.barrier()
    figures["load_s"], figures["load_peak_mb"] = time.perf_counter() - start, _status_mb("VmHWM")
    return figures


def child_peak(cmd: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS MB) of a subprocess."""
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.execv(cmd[0], cmd)
    _, status, usage = os.wait4(pid, 0)
    if status:
        sys.exit(f"{cmd} failed")
    return time.perf_counter() - start, usage.ru_maxrss / 1024


def report(args: argparse.Namespace) -> None:
    rows = [json.loads(line) for line in Path(args.out, "figures.jsonl").read_text().splitlines()]
    print(f"\nGPT {rows[0]['params'] / 1e6:.1f}M parameters, fp32 AdamW, 2 ranks (gloo, 1 thread each)\n")
    print(
        f"{'variant':<30}{'save blocks s':>14}{'save committed s':>17}{'save +RSS MB':>13}"
        f"{'next step s':>12}{'plain step s':>13}{'load s':>8}{'load peak MB':>13}{'size MB':>9}"
    )
    for r in rows:
        print(
            f"{r['name']:<30}{r['save_blocked_s']:>14.2f}{r['save_total_s']:>17.2f}"
            f"{r['save_peak_added_mb']:>13.0f}{r['next_step_s']:>12.2f}{r['plain_step_s']:>13.2f}"
            f"{r['load_s']:>8.2f}{r['load_peak_mb']:>13.0f}{r['size_mb']:>9.0f}"
        )
    src = Path(args.out, "zero_sharded_dir_.ckpt")
    dst = Path(args.out, "consolidated.ckpt")
    dst.unlink(missing_ok=True)
    cons_s, cons_mb = child_peak(
        [sys.executable, "-m", "lightning_zero.cli", "consolidate", str(src), str(dst)]
    )
    single = Path(args.out, "zero_gathered_single_file_.ckpt")
    load_s, load_mb = child_peak(
        [sys.executable, "-c", f"import torch; torch.load({str(single)!r}, weights_only=True)"]
    )
    base_s, base_mb = child_peak(
        [sys.executable, "-c", "import torch, lightning_zero.checkpoint.consolidate"]
    )
    print(
        f"\nconsolidate {src.name} -> {dst.stat().st_size / 2**20:.0f} MB file: "
        f"{cons_s:.2f} s, peak RSS {cons_mb:.0f} MB"
        f"\nplain torch.load of the same state as one file:   {load_s:.2f} s, peak RSS {load_mb:.0f} MB"
        f"\n(python + torch + lightning_zero imported alone:    {base_s:.2f} s, peak RSS {base_mb:.0f} MB)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--out", default="benchmarks/results/checkpoint_io")
    parser.add_argument("--only", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only:
        run_variant(args.only, args)
        return
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "figures.jsonl").unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for name in VARIANTS:
        print(f"{name} ...", flush=True)
        proc = subprocess.run(
            [sys.executable, *sys.argv, "--only", name], env=env, capture_output=True, text=True
        )
        if proc.returncode:
            sys.exit(f"{name} failed:\n{proc.stderr[-4000:]}")
    report(args)


if __name__ == "__main__":
    main()
