"""What an exponential moving average of the weights costs per rank: Lightning's ``EMAWeightAveraging``
under ``"ddp"`` (a whole ``AveragedModel`` on every rank) against the same callback under ``"zero"``
(stage 2) and ``"zero3"`` (the average kept on the shards). ``--ranks`` CPU processes (gloo, one
thread each), the recipe's GPT.

    python benchmarks/weight_average.py [--ranks 4] [--d-model 512] [--layers 8] [--vocab 8192] [--steps 8]

Each (strategy, with or without the callback) is one launch. Per rank it reads: the bytes the
average takes (``AveragedModel``'s parameters and buffers; the engine's ``average_nbytes()``), the
peak resident memory from the start of ``fit`` to its end (``VmHWM``), and the time of each training
step from ``on_train_batch_start`` to the end of ``on_train_batch_end`` (the EMA update included),
the median over the steps after the first two. Printed side by side; the cost of the callback is the
ratio with and without it, in the same run of this script. Figures, not assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout, not another install
from benchmarks.stage3_setup_memory import MB, _free_port, _peak_mb, _reset_peak, gpt_module  # noqa: E402

MODES = ("ddp", "ddp+ema", "zero", "zero+ema", "zero3", "zero3+ema")


def worker(mode: str, args: argparse.Namespace, out: Path) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import EMAWeightAveraging
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_zero  # noqa: F401 - registers "zero", "zero3"
    from lightning_zero.comm import end_process_group

    torch.set_num_threads(1)
    config, Lit = gpt_module(args)
    strategy, _, ema = mode.partition("+")
    step_s: list[float] = []
    figures: dict[str, Any] = {}

    class Measure(L.Callback):  # last in the list: its batch end follows the EMA update
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            _reset_peak()

        def on_train_batch_start(self, *args: Any) -> None:
            self.started = time.perf_counter()

        def on_train_batch_end(self, trainer: L.Trainer, *rest: Any) -> None:
            step_s.append(time.perf_counter() - self.started)

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            figures["peak_mb"] = _peak_mb()
            averaging = [cb for cb in trainer.callbacks if isinstance(cb, EMAWeightAveraging)]
            if averaging and averaging[0]._average_model is not None:  # "ddp": a whole copy
                copy = averaging[0]._average_model.module
                tensors = [*copy.parameters(), *copy.buffers()]
                figures["average_bytes"] = sum(t.numel() * t.element_size() for t in tensors)
            optimizer = getattr(trainer.strategy, "sharded_optimizer", None)
            if optimizer is not None:
                figures["average_bytes"] = optimizer.engine.average_nbytes()
            figures["params"] = pl_module.model.num_params()

    trainer = L.Trainer(
        strategy=strategy,
        devices=args.ranks,
        accelerator="cpu",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*([EMAWeightAveraging(decay=0.999)] if ema else []), Measure()],
    )
    L.seed_everything(0, verbose=False)
    data = TensorDataset(
        torch.randint(0, config.vocab_size, (args.steps * args.ranks, config.max_seq_len + 1))
    )
    trainer.fit(Lit(), DataLoader(data, batch_size=1))
    rank = int(os.environ["LOCAL_RANK"])
    (out / f"{mode}.rank{rank}.json").write_text(json.dumps({"step_s": step_s, **figures}))
    end_process_group()  # a gloo group left to exit-time destructors can abort the process


def launch(mode: str, args: argparse.Namespace, out: Path) -> None:
    base = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        NODE_RANK="0",
        WORLD_SIZE=str(args.ranks),
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=str(ROOT),
    )
    shape = [f"--ranks={args.ranks}", f"--d-model={args.d_model}", f"--layers={args.layers}"]
    shape += [f"--vocab={args.vocab}", f"--seq={args.seq}", f"--steps={args.steps}"]
    command = [sys.executable, __file__, "--worker", mode, "--out", str(out), *shape]
    procs = [
        subprocess.Popen(command, env=dict(base, LOCAL_RANK=str(r)), cwd=ROOT, stdout=subprocess.DEVNULL)
        for r in range(args.ranks)
    ]
    codes = [p.wait(timeout=args.timeout_s) for p in procs]
    if any(codes):
        raise SystemExit(f"{mode}: a rank failed (exit statuses {codes})")


def report(out: Path, args: argparse.Namespace) -> None:
    runs = {
        mode: [json.loads((out / f"{mode}.rank{r}.json").read_text()) for r in range(args.ranks)]
        for mode in MODES
    }
    params = runs["ddp"][0]["params"]
    print(
        f"recipe GPT d_model={args.d_model} layers={args.layers} vocab={args.vocab}: {params / 1e6:.1f}M "
        f"parameters ({4 * params / MB:.0f} MB in fp32), {args.ranks} ranks, EMAWeightAveraging(decay=0.999)"
    )
    print("\n| strategy | average per rank (MB) | peak RSS per rank (MB) | step (ms, median) | vs no EMA |")
    print("| --- | --- | --- | --- | --- |")
    for mode in MODES:
        ranks = runs[mode]
        average = max(r.get("average_bytes", 0) for r in ranks) / MB
        peak = max(r["peak_mb"] for r in ranks)
        step = max(statistics.median(r["step_s"][2:]) for r in ranks) * 1000
        ratio = ""
        if mode.endswith("+ema"):
            plain = runs[mode.removesuffix("+ema")]
            ratio = f"{step / (max(statistics.median(r['step_s'][2:]) for r in plain) * 1000):.2f}"
        print(f"| {mode} | {average:.1f} | {peak:.0f} | {step:.0f} | {ratio} |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--worker", choices=MODES)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args, Path(args.out))
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for mode in MODES:
            launch(mode, args, out)
        report(out, args)


if __name__ == "__main__":
    main()
