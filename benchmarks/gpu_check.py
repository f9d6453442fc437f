"""One-shot GPU check of lightning-zero: what only a GPU can show, in one prepared run (< 5 minutes).

    PYTHONPATH=. python benchmarks/gpu_check.py [--out DIR] [--steps 20]
    PYTHONPATH=. python benchmarks/gpu_check.py --device cpu --quick     # the same script, tiny, on CPU

Parts (each prints its figures and goes into ``DIR/gpu_check.json``; a part that fails is reported
with its error and the next one runs):

  1. ``parity``: the sharded Adam update on the device at world size 1 on NCCL (collectives are local
     copies there; what runs on the device is the CUDA control tensors, CUDA-event wait timing —
     turned on, read back by ``flush_timings`` and printed as ``comm_wait_s`` with
     ``wait_timer: cuda_events`` — and the fused kernels), ``ShardedAdamW(fused=True)`` against
     ``torch.optim.AdamW(fused=True)`` after 20 steps: stage 2 in fp32 and with bf16 parameters and
     fp32 masters against fp32 AdamW (loose); ``zero3_float32``: the standalone stage-3 optimizer
     (``ZeroConfig(stage=3)``, ``module=model``: forward hooks gather each unit, storage of the full
     buffers freed with ``resize_(0)`` between steps), read through ``opt.full_parameters()``, fp32,
     with the CUDA memory the gathered units take over the sharded state; ``zero3_int8``: the same with
     int8 gradients and int8 parameter gathers (``reduce_dtype``/``gather_dtype``; the quantize and
     dequantize kernels on the device, NCCL's all-to-all), against AdamW loosely.
  2. ``train``: the recipe's GPT at ~125M and ~350M parameters, ``bf16-mixed`` and ``bf16-true``,
     under ``"ddp"``, ``"zero"`` and ``"zero3"`` (one GPU: the CUDA path of the strategy, not its
     communication; for ``zero3`` the CUDA path of gathering and freeing units and what it costs in
     tokens/s against ``zero``): tokens/s, MFU (recipes' FLOP count over the device's dense bf16
     peak), peak CUDA memory during ``fit`` (reset only after the previous configuration's trainer,
     model and optimizer were released, collected and the cache emptied) against each strategy's
     per-parameter formula and against ``lightning-zero estimate``'s figure for the same model
     (``model_state_estimate_gib``), communication wait from CUDA events, then
     ``trainer.test(ckpt_path="best")`` after ``fit``; ``zero`` and ``zero3`` with
     ``profile_steps=(1, steps - 2)``: the step profile's tokens/s and MFU (its peak table by the CUDA
     device's name), exposed communication and gather wait, memory by kind over its estimate, the
     activations included (the recipe module's estimate over the bytes autograd saved:
     ``step_profile``).
  3. ``two_processes``: 2 processes on the one GPU with gloo (NCCL refuses two ranks on one GPU):
     the sharded optimizer's parameters against AdamW on the global batch after 6 steps, fp32, at
     stage 2 and at stage 3 (``zero3``), and stage 3 on the int8 wires (``zero3_int8``, loosely; an
     error there may be gloo's all-to-all refusing CUDA tensors, reported as the case's result).
  4. ``sync_debug``, ``watchdog``, ``max_connections`` (``benchmarks/gpu_nccl_checks.py``): steps of
     every stage under ``torch.cuda.set_sync_debug_mode("error")``; a collective stuck behind a
     kernel ending as ``CommError`` (and a main thread blocked behind it ending with status 75) within
     the timeout, and ``Comm.barrier`` holding the host behind a 1 s kernel (``barrier_host_blocked_s``
     >= ~1: preflight's probe check relies on it); stage 3 with ``CUDA_DEVICE_MAX_CONNECTIONS=1``.
     ~1 minute.

GPU time, estimated for one H200 (no GPU run recorded yet): ~4 minutes in all. ``train`` makes 12
fits of 20 steps of 8×1024 tokens; compute is ~25 ms (125M) and ~70 ms (350M) a step, so each fit
is mostly model construction, Lightning's setup and the best checkpoint written and read back
(~4 GB at 350M, bf16-mixed): ~6 s at 125M, ~15 s at 350M, ~2.2 minutes together. ``parity``: ~10 s
(CUDA initialisation included); ``two_processes``: ~20 s, mostly two process starts with CUDA
initialisation; ``sync_debug`` ~5 s; ``watchdog`` ~25 s (3 s timeouts, a child process blocked
behind a kernel for up to two of them); ``max_connections`` ~15 s (a child running ``parity``).

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
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

SIZES: dict[str, dict[str, Any]] = {  # the recipe's Llama-style GPT (tied embeddings)
    "125M": {"n_layer": 12, "n_head": 12, "d_model": 768, "mlp_hidden": 2048},
    "350M": {"n_layer": 24, "n_head": 16, "d_model": 1024, "mlp_hidden": 2816},
    "tiny": {"n_layer": 2, "n_head": 2, "d_model": 64, "mlp_hidden": 128},
}
STRATEGIES = ("ddp", "zero", "zero3")
Precision = Literal["bf16-mixed", "bf16-true"]
PRECISIONS: tuple[Precision, ...] = ("bf16-mixed", "bf16-true")
BYTES_PER_PARAM = {  # model state held per parameter for the whole run, at world size 1
    # fp32 params + fp32 grads + DDP's bucket copy of the grads (Lightning's "ddp" leaves
    # gradient_as_bucket_view=False: measured on CPU at world size 1, backward added 2x the gradient
    # bytes, 1x with the view) + fp32 Adam moments
    ("bf16-mixed", "ddp"): 4 + 4 + 4 + 8,
    # fp32 params (the shard is the master) + fp32 gradient shard + fp32 moments (ZeRO paper's 16)
    ("bf16-mixed", "zero"): 4 + 4 + 8,
    # stage 3 at N=1 holds what stage 2 holds: the shard is the whole bucket; on top, transiently, the
    # full buffers of the gathered units (the root, i.e. the tied embedding, and at most
    # 1 + prefetch_units blocks): the peak shows them
    ("bf16-mixed", "zero3"): 4 + 4 + 8,
    # torch's AdamW keeps its moments in the parameters' dtype: all bf16, DDP's bucket copy too
    ("bf16-true", "ddp"): 2 + 2 + 2 + 2 + 2,
    # bf16 params + fp32 gradient accumulation + fp32 master + fp32 moments
    ("bf16-true", "zero"): 2 + 4 + 4 + 8,
    ("bf16-true", "zero3"): 2 + 4 + 4 + 8,  # the same as stage 2 at N=1, plus the gathered units
}


def _init_single_process_group(backend: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        store = Path(tempfile.mkdtemp()) / "store"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)


def _backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def _mlp() -> torch.nn.Sequential:
    """Two layers of 131k elements each: both are stage-3 units at the default ``min_unit_numel``."""
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))


def _allocated_mib(device: str) -> float | None:
    return torch.cuda.memory_allocated() / 2**20 if device == "cuda" else None


def part_parity(device: str) -> dict[str, Any]:
    """Sharded AdamW vs torch's fused AdamW on the device: stage 2 in fp32 and bf16 (fp32 masters,
    loosely), stage 3 in fp32."""
    _init_single_process_group(_backend(device))
    return {
        "float32": _parity_one(device, 2, torch.float32),
        "bfloat16": _parity_one(device, 2, torch.bfloat16),
        "zero3_float32": _parity_one(device, 3, torch.float32),
        "zero3_int8": _parity_one(device, 3, torch.float32, reduce_dtype="int8", gather_dtype="int8"),
    }


def _parity_one(device: str, stage: int, dtype: torch.dtype, **wires: Any) -> dict[str, Any]:
    from lightning_zero import ShardedAdamW, ZeroConfig
    from lightning_zero.layout.placeholders import is_freed

    torch.manual_seed(0)
    model, reference = _mlp(), _mlp()
    reference.load_state_dict(model.state_dict())
    model, reference = model.to(device, dtype), reference.to(device)  # before the optimizer binds them
    config = ZeroConfig(stage=stage, bucket_cap_mb=0.25, first_bucket_cap_mb=0.1, **wires)
    opt = ShardedAdamW(
        model.parameters(), lr=1e-3, fused=True, config=config, module=model if stage == 3 else None
    )
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
    placeholders = all(is_freed(p) for p in model.parameters())  # stage 3: units freed
    sharded_mib = _allocated_mib(device)
    with opt.full_parameters():
        gathered_mib = _allocated_mib(device)
        diff = max(
            (a.float() - b).abs().max().item()
            for a, b in zip(model.parameters(), reference.parameters(), strict=True)
        )
    opt.engine.flush_timings()  # adds the CUDA-event waits to comm_stats (synchronises)
    stats = opt.engine.comm_stats
    out: dict[str, Any] = {
        "max_abs_diff_after_20_steps": diff,
        "buckets": len(opt.engine.plan.buckets),
        "collectives": stats.collectives,
        "comm_wait_s": stats.wait_s,  # from CUDA events on cuda, a host timer on cpu
        "wait_timer": "cuda_events" if opt.engine.comm.time_device_waits else "host",
    }
    with torch.profiler.profile() as prof:  # one more step: the named ranges (and NVTX on CUDA)
        model(x.to(dtype)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    names = {e.name for e in prof.events() if e.name.startswith("lightning_zero")}
    out["trace_ranges"] = len(names)
    out["trace_has_buckets"] = any(n.startswith("lightning_zero bucket") for n in names)
    if stage == 3:
        out["placeholders_between_steps"] = placeholders  # every unit freed after the step
        out["param_mib"] = sum(p.numel() for p in reference.parameters()) * dtype.itemsize / 2**20
        # the full buffers given storage again inside full_parameters(): ~param_mib on cuda
        out["gathered_minus_sharded_mib"] = (
            None if gathered_mib is None or sharded_mib is None else gathered_mib - sharded_mib
        )
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


def _strategy(name: str, quick: bool, window: tuple[int, int] | None) -> Any:
    import lightning_zero

    if name == "ddp":
        return "ddp"
    if name == "zero":
        return lightning_zero.ZeroStrategy(log_comm_stats=True, profile_steps=window)
    # units: every block (the tied embedding, held by the embedding and the output layer, and the final
    # norm stay in the root unit); quick: a lower threshold gives the tiny model the same units
    return lightning_zero.ZeroStrategy(
        stage=3, log_comm_stats=True, min_unit_numel=1_000 if quick else 100_000, profile_steps=window
    )


def _profile(root: Path) -> dict[str, Any] | None:
    """The step profile's figures (``step_profile.json`` in the fit's root): its tokens/s and MFU (the
    peak from its table by the device's name), the exposed communication and the gather wait, and each
    memory kind over ``lightning-zero estimate``'s for the same run."""
    path = root / "step_profile.json"
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    rank = report["ranks"][0]
    rates = report["throughput"]
    held = {k: v for k, v in rank["memory"].items() if k in report["estimate"]}
    return {
        **{k: rates[k] for k in ("tokens_per_s", "achieved_tflops_per_device", "mfu", "peak_source")},
        **{k: rank["mean"][k] for k in ("step_s", "comm_exposed_s", "gather_wait_s")},
        "memory_over_estimate": {
            k: v / report["estimate"][k] for k, v in held.items() if report["estimate"][k]
        },
        "peak_kind": rank["memory"]["peak_kind"],
    }


def _release_device_memory(device: str) -> float | None:
    """Collect what the previous configuration left (its trainer, model and optimizer hold reference
    cycles), empty CUDA's cache and reset the peak; returns what is still allocated (MiB)."""
    gc.collect()
    if device != "cuda":
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated() / 2**20


def _train_one(
    size: str, precision: Precision, strategy_name: str, args: argparse.Namespace, root: Path
) -> dict[str, Any]:
    """One fit and one test; the caller releases what they leave before the next configuration."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from recipes.training.throughput import TokenThroughput

    before_mib = _release_device_memory(args.device)  # before anything of this configuration exists
    # quick: a small vocabulary too; a 50304-row bf16 head on CPU costs ~1 s a step
    seq, batch, vocab_size = (64, 2, 512) if args.quick else (1024, 8, 50304)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (batch * (args.steps + 2), seq + 1), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    module = _module(size, seq, vocab_size)
    checkpoint = ModelCheckpoint(dirpath=root / "ckpt", monitor="val/loss", save_top_k=1)
    throughput = TokenThroughput(window=2)  # tokens_per_s and mfu over the last half of the steps
    trainer = L.Trainer(
        accelerator=args.device,
        devices=1,
        strategy=_strategy(strategy_name, args.quick, (1, args.steps - 2) if args.steps >= 3 else None),
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
        "cuda_allocated_before_fit_gib": None if before_mib is None else before_mib / 2**10,
        "model_state_formula_gib": params * BYTES_PER_PARAM[(precision, strategy_name)] / 2**30,
        "model_state_estimate_gib": _estimate_gib(module, params, precision, strategy_name),
        "comm_wait_s_last_step": metrics.get("zero/comm_wait_s"),
        "test_after_fit_best": tested[0] if tested else None,
        "best_checkpoint": Path(checkpoint.best_model_path).name,
        "step_profile": _profile(root),
    }


def _estimate_gib(module: Any, params: int, precision: Precision, strategy_name: str) -> float:
    """What ``lightning-zero estimate`` says for this model at world size 1 (stage 3: one block per
    unit), to read beside the measured peak."""
    from lightning_zero.layout.memory import estimate_rows

    block = sum(p.numel() for p in module.model.blocks[0].parameters())
    rows = estimate_rows(params, 1, precision, 25.0, unit_params=block)
    return rows[{"ddp": "ddp", "zero": "zero2", "zero3": "zero3"}[strategy_name]] / 2**30


def part_train(args: argparse.Namespace) -> dict[str, Any]:
    sizes = ["tiny"] if args.quick else ["125M", "350M"]
    out: dict[str, Any] = {}
    for size in sizes:
        for precision in PRECISIONS:
            for strategy in STRATEGIES:
                key = f"{size}/{precision}/{strategy}"
                with tempfile.TemporaryDirectory() as root:
                    try:
                        out[key] = _train_one(size, precision, strategy, args, Path(root))
                    except Exception:  # noqa: BLE001 - reported; the next configuration runs
                        out[key] = {"error": traceback.format_exc(limit=4)}
                print(key, json.dumps(out[key], default=str), flush=True)
                _release_device_memory(args.device)  # the trainer and model of this one are gone now
            out.update(_ratios(out, f"{size}/{precision}"))
    return out


def _ratios(out: dict[str, Any], prefix: str) -> dict[str, float]:
    """tokens/s of zero over ddp and of zero3 over zero, where both ran."""
    ratios = {}
    for a, b in (("zero", "ddp"), ("zero3", "zero")):
        num, den = (
            out.get(f"{prefix}/{a}", {}).get("tokens_per_s"),
            out.get(f"{prefix}/{b}", {}).get("tokens_per_s"),
        )
        if num and den:
            ratios[f"{prefix}/{a}_vs_{b}_tokens_per_s"] = num / den
    return ratios


def _two_process_worker(rank: int, world_size: int, device: str) -> dict[str, float | str]:
    """ShardedAdamW on ``device`` (both ranks on GPU 0) against AdamW on the global batch, fp32, at
    stage 2 and stage 3; a case that raises (on every rank alike) is reported and the next one runs."""
    out: dict[str, float | str] = {}
    for name, stage in (("zero", 2), ("zero3", 3), ("zero3_int8", 3)):
        try:
            wires = {"reduce_dtype": "int8", "gather_dtype": "int8"} if name.endswith("int8") else {}
            out[name] = _two_process_case(rank, world_size, device, stage, **wires)
        except Exception:  # noqa: BLE001 - reported; the next case runs
            out[name] = traceback.format_exc(limit=4)
    return out


def _two_process_case(rank: int, world_size: int, device: str, stage: int, **wires: Any) -> float:
    import copy

    from lightning_zero import ShardedAdamW, ZeroConfig

    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    model = _mlp().to(dev)
    reference = copy.deepcopy(model)
    config = ZeroConfig(stage=stage, bucket_cap_mb=0.25, first_bucket_cap_mb=0.1, **wires)
    opt = ShardedAdamW(model.parameters(), lr=1e-3, config=config, module=model if stage == 3 else None)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for step in range(6):
        x = torch.randn(16, 256, generator=torch.Generator().manual_seed(step)).to(dev)
        model(x[rank::world_size]).pow(2).mean().backward()
        reference(x).pow(2).mean().backward()  # the mean of the two halves' means
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    with opt.full_parameters():  # stage 3: every unit gathered (a collective: both ranks)
        return max(
            (a - b).abs().max().item()
            for a, b in zip(model.parameters(), reference.parameters(), strict=True)
        )


def part_two_processes(args: argparse.Namespace) -> dict[str, Any]:
    """2 processes on the one device with gloo (NCCL refuses two ranks on one GPU): parity in fp32."""
    from tests.distributed.harness import run_ranks

    per_rank = run_ranks(_two_process_worker, 2, args.device, timeout_s=180)
    return {
        f"{name}_max_abs_diff_vs_adamw_rank{rank}": value
        for name in ("zero", "zero3", "zero3_int8")
        for rank, value in enumerate(result[name] for result in per_rank)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--quick", action="store_true", help="tiny model, vocabulary and batches (a dry run of the script)"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--parts", default="parity,train,two_processes,sync_debug,watchdog,max_connections")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu --quick for a dry run")
    report: dict[str, Any] = {"torch": torch.__version__}
    if args.device == "cuda":
        report["device"] = torch.cuda.get_device_name()
    from benchmarks.gpu_nccl_checks import part_max_connections, part_sync_debug, part_watchdog

    parts = {
        "parity": lambda: part_parity(args.device),
        "train": lambda: part_train(args),
        "two_processes": lambda: part_two_processes(args),
        "sync_debug": lambda: part_sync_debug(args.device, _init_single_process_group),
        "watchdog": lambda: part_watchdog(args.device),
        "max_connections": lambda: part_max_connections(args.device),
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
            "\nsummary (tokens/s: zero over ddp, zero3 over zero):",
            {
                k: round(v, 3)
                for k, v in report["train"].items()
                if k.endswith("tokens_per_s") and isinstance(v, float)
            },
        )


if __name__ == "__main__":
    main()
