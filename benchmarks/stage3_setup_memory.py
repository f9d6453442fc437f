"""Peak memory per rank, phase by phase, from building the model to a resume, under ``"zero3"``: the
model built eagerly (every rank holds it whole first, then keeps its shards) against the same model
built on the meta device (``trainer.init_module(empty_init=True)``: initialized one unit at a time
straight into the shards). ``--ranks`` CPU processes (gloo, one thread each), the recipe's GPT.

    python benchmarks/stage3_setup_memory.py [--ranks 4] [--d-model 1024] [--layers 24] [--vocab 32768]

Each mode is one launch of ``--ranks`` processes. In each, the peak resident memory (``VmHWM``,
reset between phases through ``/proc/self/clear_refs``) is read at the end of every phase:

  1. ``build``: the LightningModule constructed (eager: the whole model; deferred: shapes only);
  2. ``setup``: ``fit`` up to ``on_fit_start`` (the strategy's setup: eager broadcasts rank 0's model
     and keeps its shards; deferred initializes unit by unit);
  3. ``first step``: its forward, its backward (the gradients reduced into the shards), its optimizer
     step (``more steps``: the other ``--steps``);
  4. ``save``: ``trainer.save_checkpoint`` (sharded directory);
  5. ``resume``: a new module built the same way and ``fit(ckpt_path=...)``: its build, its setup,
     ``load`` (the checkpoint read into the shards: Lightning restores a strategy that restores after
     setup between ``on_fit_start`` and ``on_train_start``) and its first step.

``--strategy ddp`` runs the same phases under Lightning's ``"ddp"`` (mode ``eager`` only: its model
is built whole); ``benchmarks/largest_lifecycle.py`` launches it under a memory budget
(``--launch MODE``: the ranks of one mode, this process their parent).

Printed per mode: every phase's peak (the largest rank's), beside the figures that bound it: the
process's resident memory before the model (torch and Lightning), the whole model in fp32 (``4Ψ``
bytes), a rank's shards (``16Ψ/N``: parameters, gradients, the two Adam moments, fp32), and the
largest unit's full parameters. The environment sets ``MALLOC_MMAP_THRESHOLD_=1048576`` so that
freed unit buffers return to the system (otherwise glibc keeps buffers below its rising mmap
threshold and RSS shows less of stage 3's saving; docs/performance.md). Figures, not assertions.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout, not another install
MB = 2**20


def _peak_mb() -> float:
    """This process's peak resident memory since the last :func:`_reset_peak`, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # the peak restarts from the current RSS


def gpt_module(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(config, Lit)``: the recipe's GPT (tied embeddings) of ``args``'s shape (``vocab``, ``seq``,
    ``layers``, ``d_model``; heads of 64) and a LightningModule class holding it (next-token loss,
    AdamW), built when called (under the strategy's init context, if any)."""
    import lightning as L
    import torch
    import torch.nn.functional as F

    from recipes.training.model import GPT, GPTConfig

    config = GPTConfig(
        vocab_size=args.vocab,
        max_seq_len=args.seq,
        n_layer=args.layers,
        n_head=args.d_model // 64,
        d_model=args.d_model,
        tie_embeddings=True,
    )

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = GPT(config)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            tokens = batch[0]
            logits = self.model(tokens[:, :-1])
            return F.cross_entropy(logits.reshape(-1, config.vocab_size), tokens[:, 1:].reshape(-1))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return config, Lit


def worker(mode: str, args: argparse.Namespace, out: Path) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_zero
    from lightning_zero.comm import end_process_group

    torch.set_num_threads(1)
    config, Lit = gpt_module(args)
    phases: dict[str, float] = {}
    figures: dict[str, Any] = {"before_model_mb": _peak_mb()}

    def phase(name: str) -> None:
        phases[name] = _peak_mb()
        _reset_peak()

    class Phases(L.Callback):
        def __init__(self, prefix: str) -> None:
            self.prefix = prefix

        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            phase(f"{self.prefix}setup")

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            if self.prefix:
                phase(f"{self.prefix}load")
            self.first = trainer.global_step + 1

        def on_before_backward(self, trainer: L.Trainer, *rest: Any) -> None:
            if trainer.global_step == self.first - 1:
                phase(f"{self.prefix}first step: forward")

        def on_after_backward(self, trainer: L.Trainer, *rest: Any) -> None:
            if trainer.global_step == self.first - 1:
                phase(f"{self.prefix}first step: backward")

        def on_train_batch_end(self, trainer: L.Trainer, *rest: Any) -> None:
            if trainer.global_step == self.first:
                phase(f"{self.prefix}first step: optimizer step")
                optimizer = getattr(trainer.strategy, "sharded_optimizer", None)
                if optimizer is not None:
                    engine = optimizer.engine
                    figures["units"] = [sum(b.padded_numel for b in u.buckets) for u in engine.units.units]
                    figures["init_peak_elements"] = engine.init_peak_elements

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            if trainer.global_step > self.first:
                phase(f"{self.prefix}more steps")

    def fit(prefix: str, max_steps: int, ckpt: str | None) -> L.Trainer:
        zero3 = lightning_zero.ZeroStrategy(stage=3)
        strategy = zero3 if args.strategy == "zero3" else args.strategy
        trainer = L.Trainer(
            strategy=strategy,
            devices=args.ranks,
            accelerator="cpu",
            max_steps=max_steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[Phases(prefix)],
        )
        L.seed_everything(0, verbose=False)
        _reset_peak()
        if mode == "deferred":
            with trainer.init_module(empty_init=True):
                module = Lit()
        else:
            module = Lit()
        phase(f"{prefix}build")
        data = TensorDataset(torch.randint(0, config.vocab_size, (4 * args.ranks, config.max_seq_len + 1)))
        trainer.fit(module, DataLoader(data, batch_size=1), ckpt_path=ckpt)
        return trainer

    started = time.perf_counter()
    trainer = fit("", args.steps, None)
    figures["params"] = trainer.lightning_module.model.num_params()
    _reset_peak()
    ckpt = str(out / f"ckpt_{mode}")
    trainer.save_checkpoint(ckpt)
    phase("save")
    del trainer  # the first run's model and shards go before the resume's are built
    gc.collect()
    _reset_peak()
    fit("resume: ", args.steps + 1, ckpt)
    figures["seconds"] = time.perf_counter() - started
    rank = int(os.environ["LOCAL_RANK"])
    (out / f"{mode}.rank{rank}.json").write_text(json.dumps({"phases": phases, **figures}))
    end_process_group()  # a gloo group left to exit-time destructors can abort the process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(mode: str, args: argparse.Namespace, out: Path) -> None:
    port = str(_free_port())
    base = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
        NODE_RANK="0",
        WORLD_SIZE=str(args.ranks),
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        MALLOC_MMAP_THRESHOLD_="1048576",
        PYTHONPATH=str(ROOT),
    )
    command = [sys.executable, __file__, "--worker", mode, "--out", str(out)] + _shape_args(args)
    command += [f"--strategy={args.strategy}", f"--steps={args.steps}"]
    procs = [
        subprocess.Popen(command, env=dict(base, LOCAL_RANK=str(r)), cwd=ROOT, stdout=subprocess.DEVNULL)
        for r in range(args.ranks)
    ]
    codes = [p.wait(timeout=args.timeout_s) for p in procs]
    if any(codes):
        raise SystemExit(f"{mode}: a rank failed (exit statuses {codes})")


def _shape_args(args: argparse.Namespace) -> list[str]:
    return [
        f"--ranks={args.ranks}",
        f"--d-model={args.d_model}",
        f"--layers={args.layers}",
        f"--vocab={args.vocab}",
        f"--seq={args.seq}",
    ]


def report(out: Path, args: argparse.Namespace) -> None:
    runs = {}
    for mode in ("eager", "deferred"):
        ranks = [json.loads((out / f"{mode}.rank{r}.json").read_text()) for r in range(args.ranks)]
        runs[mode] = ranks
    first = runs["deferred"][0]
    params, units = first["params"], first["units"]
    full_mb = 4 * params / MB
    print(
        f"recipe GPT d_model={args.d_model} layers={args.layers} vocab={args.vocab}: {params / 1e6:.1f}M "
        f"parameters ({full_mb:.0f} MB in fp32), {args.ranks} ranks, stage 3"
    )
    print(
        f"bounds per rank: shards 16Ψ/N = {16 * params / args.ranks / MB:.0f} MB; largest unit "
        f"{4 * max(units[1:], default=0) / MB:.0f} MB (0: every block joined the root, under "
        f"min_unit_numel), root unit {4 * units[0] / MB:.0f} MB; before the model "
        f"{max(r['before_model_mb'] for r in runs['eager']):.0f} MB (torch, Lightning)"
    )
    print(
        f"deferred init held at most {first['init_peak_elements'] / 1e6:.1f}M elements of full buckets "
        "at once "
        f"({4 * first['init_peak_elements'] / MB:.0f} MB)"
    )
    names = list(runs["eager"][0]["phases"])
    print("\n| phase | eager: peak RSS per rank (MB) | deferred | deferred / eager |")
    print("| --- | --- | --- | --- |")
    for name in names:
        eager = max(r["phases"][name] for r in runs["eager"])
        deferred = max(r["phases"][name] for r in runs["deferred"])
        print(f"| {name} | {eager:.0f} | {deferred:.0f} | {deferred / eager:.2f} |")
    for mode in ("eager", "deferred"):
        overall = max(max(r["phases"].values()) for r in runs[mode])
        seconds = max(r["seconds"] for r in runs[mode])
        print(f"{mode}: peak over every phase {overall:.0f} MB per rank, {seconds:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps before the save")
    parser.add_argument("--strategy", choices=("zero3", "ddp"), default="zero3")
    parser.add_argument("--worker", choices=("eager", "deferred"))
    parser.add_argument("--launch", choices=("eager", "deferred"), help="only launch this mode's ranks")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args, Path(args.out))
        return
    if args.launch:
        launch(args.launch, args, Path(args.out))
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for mode in ("eager", "deferred"):
            launch(mode, args, out)
        report(out, args)


if __name__ == "__main__":
    main()
