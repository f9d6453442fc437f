"""One-shot GPU check of lightning-zero: what only a GPU can show, in one prepared run (< 5 minutes).

    PYTHONPATH=. python benchmarks/gpu_check.py [--out DIR] [--steps 20]
    PYTHONPATH=. python benchmarks/gpu_check.py --device cpu --quick     # the same script, tiny, on CPU

Parts (each prints its figures and goes into ``DIR/gpu_check.json``; a part that fails is reported
with its error and the next one runs):

  1. ``parity``: the sharded Adam update on the device, world size 1 on NCCL (the CUDA control
     tensors, CUDA-event wait timing, turned on and read back, and fused kernels), against
     ``torch.optim.AdamW(fused=True)`` in fp32 after 20 steps; and bf16 parameters with fp32
     masters against fp32 AdamW (loose).
  2. ``train``: the recipe's GPT at ~125M and ~350M parameters, ``bf16-mixed`` and ``bf16-true``,
     under ``"ddp"`` and ``"zero"`` (one GPU: the CUDA path of the strategy, not its communication):
     tokens/s, MFU (recipes' FLOP count over the device's dense bf16 peak), peak CUDA memory (reset
     after the previous configuration is freed) against each strategy's per-parameter formula,
     communication wait from CUDA events, then ``trainer.test(ckpt_path="best")`` after ``fit``.
  3. ``two_processes``: 2 processes on the one GPU with gloo (NCCL refuses two ranks on one GPU):
     the sharded optimizer's parameters against AdamW on the global batch after 6 steps, fp32.

Figures, not assertions; quote ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

SIZES = {  # the recipe's Llama-style GPT (tied embeddings)
    "125M": {"n_layer": 12, "n_head": 12, "d_model": 768, "mlp_hidden": 2048},
    "350M": {"n_layer": 24, "n_head": 16, "d_model": 1024, "mlp_hidden": 2816},
    "tiny": {"n_layer": 2, "n_head": 2, "d_model": 64, "mlp_hidden": 128},
}
BYTES_PER_PARAM = {  # model state per parameter at world size 1 (ZeRO paper's accounting)
    ("bf16-mixed", "ddp"): 4 + 4 + 8,  # fp32 params + fp32 grads + fp32 Adam moments
    ("bf16-mixed", "zero"): 4 + 4 + 8,  # the same, grads in the flat buffer
    # torch's AdamW keeps its moments in the parameters' dtype: all bf16
    ("bf16-true", "ddp"): 2 + 2 + 2 + 2,
    # bf16 params + fp32 gradient accumulation + fp32 master + fp32 moments
    ("bf16-true", "zero"): 2 + 4 + 4 + 8,
}


def _init_single_process_group(backend: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        store = Path(tempfile.mkdtemp()) / "store"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)


def part_parity(device: str) -> dict[str, Any]:
    """Sharded AdamW vs torch's fused AdamW on the device, fp32; bf16 with fp32 masters, loosely."""
    from lightning_zero import ShardedAdamW, ZeroConfig

    _init_single_process_group("nccl" if device == "cuda" else "gloo")
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
        reference = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
        reference.load_state_dict(model.state_dict())
        model, reference = model.to(device, dtype), reference.to(device)
        config = ZeroConfig(bucket_cap_mb=0.25, first_bucket_cap_mb=0.1)
        opt = ShardedAdamW(model.parameters(), lr=1e-3, config=config, param_order=model.parameters())
        if device == "cuda":
            opt.engine.time_device_waits()  # CUDA-event wait timing, read back below
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True)
        for step in range(20):
            g = torch.Generator(device=device).manual_seed(step)
            x = torch.randn(32, 256, generator=g, device=device)
            model(x.to(dtype)).float().pow(2).mean().backward()
            reference(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        diff = max(
            (a.float() - b).abs().max().item()
            for a, b in zip(model.parameters(), reference.parameters(), strict=True)
        )
        opt.engine.flush_timings()
        stats = opt.engine.comm_stats
        out[str(dtype).removeprefix("torch.")] = {
            "max_abs_diff_after_20_steps": diff,
            "buckets": len(opt.engine.plan.buckets),
            "collectives": stats.collectives,
            "comm_wait_s": stats.wait_s,  # from CUDA events on cuda, a host timer on cpu
        }
    return out


def _module(size: str, seq: int, vocab_size: int) -> Any:
    from recipes.training.model import GPTConfig
    from recipes.training.module import OptimConfig, PretrainModule

    class Module(PretrainModule):
        def test_step(self, batch: Any, batch_idx: int) -> None:
            inputs, targets = batch
            self.log("test/loss", self._loss(self(inputs), targets), sync_dist=True)

    config = GPTConfig(vocab_size=vocab_size, max_seq_len=seq, **SIZES[size])
    return Module(config, OptimConfig(lr=3e-4, warmup_steps=5))


def _train_one(
    size: str, precision: str, strategy_name: str, args: argparse.Namespace, root: Path
) -> dict[str, Any]:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_zero
    from recipes.training.throughput import TokenThroughput

    # quick: a small vocabulary too; a 50304-row bf16 head on CPU costs ~1 s a step
    seq, batch, vocab_size = (64, 2, 512) if args.quick else (1024, 8, 50304)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (batch * (args.steps + 2), seq + 1), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    module = _module(size, seq, vocab_size)
    strategy: Any = lightning_zero.ZeroStrategy(log_comm_stats=True) if strategy_name == "zero" else "ddp"
    checkpoint = ModelCheckpoint(dirpath=root / "ckpt", monitor="val/loss", save_top_k=1)
    throughput = TokenThroughput(window=2)  # tokens_per_s and mfu over the last half of the steps
    trainer = L.Trainer(
        accelerator=args.device,
        devices=1,
        strategy=strategy,
        precision=precision,
        max_steps=args.steps,
        limit_val_batches=2,
        val_check_interval=args.steps,
        log_every_n_steps=max(1, args.steps // 4),
        logger=False,
        callbacks=[checkpoint, throughput],
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
    )
    if args.device == "cuda":  # the previous configuration's trainer and model are freed first
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if args.device == "cuda" else None
    start = time.perf_counter()
    trainer.fit(module, DataLoader(data, batch_size=batch), DataLoader(data, batch_size=batch))
    wall = time.perf_counter() - start
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else None
    params = module.model.num_params()
    tested = trainer.test(module, DataLoader(data, batch_size=batch), ckpt_path="best", verbose=False)
    return {
        "params": params,
        "tokens_per_s": metrics.get("tokens_per_s"),
        "mfu": metrics.get("mfu"),
        "fit_wall_s": wall,
        "peak_cuda_gib": None if peak is None else peak / 2**30,
        "cuda_allocated_before_fit_gib": None if before is None else before / 2**30,
        "model_state_formula_gib": params * BYTES_PER_PARAM[(precision, strategy_name)] / 2**30,
        "comm_wait_s_last_step": metrics.get("zero/comm_wait_s"),
        "test_after_fit_best": tested[0] if tested else None,
        "best_checkpoint": Path(checkpoint.best_model_path).name,
    }


def part_train(args: argparse.Namespace) -> dict[str, Any]:
    sizes = ["tiny"] if args.quick else ["125M", "350M"]
    out: dict[str, Any] = {}
    for size in sizes:
        for precision in ("bf16-mixed", "bf16-true"):
            for strategy in ("ddp", "zero"):
                key = f"{size}/{precision}/{strategy}"
                with tempfile.TemporaryDirectory() as root:
                    try:
                        out[key] = _train_one(size, precision, strategy, args, Path(root))
                    except Exception:  # noqa: BLE001 - reported; the next configuration runs
                        out[key] = {"error": traceback.format_exc(limit=4)}
                print(key, json.dumps(out[key], default=str), flush=True)
                if args.device == "cuda":
                    torch.cuda.empty_cache()
        for precision in ("bf16-mixed", "bf16-true"):
            ddp, zero = out.get(f"{size}/{precision}/ddp", {}), out.get(f"{size}/{precision}/zero", {})
            if ddp.get("tokens_per_s") and zero.get("tokens_per_s"):
                out[f"{size}/{precision}/zero_vs_ddp_tokens_per_s"] = (
                    zero["tokens_per_s"] / ddp["tokens_per_s"]
                )
    return out


def _two_process_worker(rank: int, world_size: int, device: str) -> float:
    """ShardedAdamW on ``device`` (both ranks on GPU 0) against AdamW on the global batch, fp32."""
    import copy

    from lightning_zero import ShardedAdamW, ZeroConfig

    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).to(dev)
    reference = copy.deepcopy(model)
    config = ZeroConfig(bucket_cap_mb=0.25, first_bucket_cap_mb=0.1)
    opt = ShardedAdamW(model.parameters(), lr=1e-3, config=config, param_order=model.parameters())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for step in range(6):
        x = torch.randn(16, 256, generator=torch.Generator().manual_seed(step)).to(dev)
        model(x[rank::world_size]).pow(2).mean().backward()
        reference(x).pow(2).mean().backward()  # the mean of the two halves' means
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    return max(
        (a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters(), strict=True)
    )


def part_two_processes(args: argparse.Namespace) -> dict[str, Any]:
    """2 processes on the one device with gloo (NCCL refuses two ranks on one GPU): parity in fp32."""
    from tests.distributed.harness import run_ranks

    diffs = run_ranks(_two_process_worker, 2, args.device, timeout_s=180)
    return {"max_abs_diff_vs_adamw_rank0": diffs[0], "max_abs_diff_vs_adamw_rank1": diffs[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--quick", action="store_true", help="tiny model, vocabulary and batches (a dry run of the script)"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--parts", default="parity,train,two_processes")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu --quick for a dry run")
    report: dict[str, Any] = {"torch": torch.__version__}
    if args.device == "cuda":
        report["device"] = torch.cuda.get_device_name()
    parts = {
        "parity": lambda: part_parity(args.device),
        "train": lambda: part_train(args),
        "two_processes": lambda: part_two_processes(args),
    }
    for name in args.parts.split(","):
        start = time.perf_counter()
        try:
            report[name] = parts[name]()
        except Exception:  # noqa: BLE001 - one broken part must not hide the others
            report[name] = {"error": traceback.format_exc(limit=6)}
        report[f"{name}_s"] = time.perf_counter() - start
        print(
            f"== {name} ({report[f'{name}_s']:.0f} s)\n{json.dumps(report[name], indent=1, default=str)}",
            flush=True,
        )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    if "train" in report:
        print(
            "\nsummary (zero tokens/s over ddp):",
            {
                k: round(v, 3)
                for k, v in report["train"].items()
                if k.endswith("tokens_per_s") and isinstance(v, float)
            },
        )


if __name__ == "__main__":
    main()
