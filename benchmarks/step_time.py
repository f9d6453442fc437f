"""Step time, memory and traffic of zero3/2/1, ddp and the peers (FSDP2, FSDP, DeepSpeed), in one go.

    python benchmarks/step_time.py [--model small|large|gpt2|both] [--steps 20] [--devices 2]

Each strategy trains the same GPT-like model (fp32) on the same random tokens with Lightning on
CPU/gloo, one process per rank with one thread each, as a separate launch, strategies interleaved.
Models: ``small`` (17M: 6 layers, width 384, vocab 8192) and ``large`` (47M: 4 layers, width 512,
vocab 32768, untied output layer: embedding and head each larger than a 25 MB bucket). Each rank
writes its figures; this script prints them side by side:

  * median step time (wall time between consecutive batch starts, steps after the first 3, so an
    all-gather left in flight into the next forward is counted) and its ratio to "ddp";
  * exposed communication: seconds per step this rank blocked on collectives, over the time the
    same collectives take alone (measured after training with nothing else running);
  * optimizer-state bytes and gradient bytes held per rank after a step;
  * elements sent per step, counted at the collectives (DDP through a counting comm hook,
    ZeroRedundancyOptimizer's broadcasts through torch.distributed, the peers FSDP2, FSDP and
    DeepSpeed at torch.distributed's all-reduce, all-gather, reduce-scatter and broadcast: a ring's
    share per rank), over the minimum 2Ψ(N−1)/N, and for the rows that shard parameters over
    3Ψ(N−1)/N (a gather in forward, another in backward, a reduce-scatter);
  * RSS per rank when training starts (after setup) and at its peak (ru_maxrss), and the peak's
    saving against ddp over the theoretical one (Adam state and gradients cut to 1/N, and no DDP
    bucket copy of the gradients);
  * the peak of the heap in use during training (glibc's ``mallinfo2``: bytes allocated and not
    freed, sampled every millisecond by a thread, up to ``on_train_end``: zero3's teardown, which
    gathers the full model back, comes after), the analogue of ``torch.cuda.max_memory_allocated``: RSS also
    counts memory glibc keeps after a free, which depends on the allocation history, not on what
    the strategy holds. Its saving against ddp over the same theoretical one is printed too.
A row whose launch fails (or whose library is missing: DeepSpeed is optional, ``pip install
deepspeed==0.19.8``) is printed as "not run: <reason>" and the other rows still run; "n/c" marks a
figure not counted for that row.

The peers on CPU need workarounds: ``benchmarks/peers.py``.
Figures, not assertions: these machines are noisy, so compare ratios from one run.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, not another install

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.strategies import DeepSpeedStrategy  # noqa: E402
from peers import CPUDeepSpeedStrategy, CPUFSDPStrategy, count_collectives  # noqa: E402  # this folder
from step_time_report import WARMUP_STEPS, figures_path, report  # noqa: E402  # this folder
from torch import nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_zero  # noqa: E402

STRATEGIES = (
    "zero3",
    "zero3-bf16",
    "zero3-int8",
    "zero3-keep",
    "fsdp2",
    "fsdp2-keep",
    "fsdp-full",
    "fsdp-grad-op",
    "deepspeed3",
    "deepspeed2",
    "zero2",
    "zero2-bf16",
    "zero2-int8",
    "zero2-2x2",
    "zero3-2x2",
    "zero2-overlap",
    "zero2-5MB",
    "zero2-nonfinite",
    "zero2-fused",
    "zero1",
    "ddp",
    "ddp-fused",
    "ddp+ZeroRedundancyOptimizer",
)
"""``zero2-overlap``: with ``overlap_param_gather`` (the all-gather left in flight into the next
forward). ``zero2-5MB``: 5 MiB buckets (at 25 MiB a 68 MB model is three buckets).
``zero2-nonfinite``: with ``skip_nonfinite_steps`` (a min/max pass per bucket before it is sent, one
small all-reduce and one host synchronisation per step). ``-bf16`` / ``-int8``: gradients on the wire as
bf16 / int8 blocks (``reduce_dtype``; the rows without a suffix send fp32), ``zero3-int8`` with int8
parameter gathers too (``gather_dtype``); their bytes per step are printed against the fp32 row's.
``-fused``: ``AdamW(fused=True)`` (the others
use torch's default AdamW; the sharded update runs the kernel family the user's optimizer asks for).
``zero3``: parameters sharded too; units: each block, the embedding and the output layer (the default
policy), the rest (position table, final norm) the root (``-keep``: ``reshard_after_forward=False``).
``fsdp2``: torch's ``fully_shard`` on every block and the root through Lightning's
``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)``, ``reshard_after_forward=True``
(``-keep``: ``False``, FSDP2's ZeRO-2). ``fsdp-full``: FSDP1 ``ShardingStrategy.FULL_SHARD``, one unit
per block (``auto_wrap_policy={Block}``) and the root; ``fsdp-grad-op``: ``SHARD_GRAD_OP`` (parameters
kept gathered from forward to backward, like ``-keep``). Both with Lightning's default
``use_orig_params=True``, under which ``configure_optimizers`` sees flattened 1-D parameter shards (a
``p.ndim >= 2`` weight-decay rule would put every weight in the no-decay group; this model's
optimizer has one group). ``deepspeed3`` / ``deepspeed2``: Lightning's ``DeepSpeedStrategy(stage=3 / 2)``
with its defaults and the model's own AdamW."""
MODELS = {
    "small": {"layers": 6, "dim": 384, "vocab": 8192},
    "large": {"layers": 4, "dim": 512, "vocab": 32768},
    "gpt2": {"layers": 12, "dim": 768, "vocab": 32768},
}
BOTH = ("small", "large")
"""What ``--model both`` (the default) runs. ``gpt2`` (135M: GPT-2 small's shape, untied output layer)
is run on its own: about 10 s per step and 3 GB per rank under ddp on a CPU core, so memory only,
with few steps (``--model gpt2 --steps 6 --rounds 1``)."""


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


class HeapPeak:
    """Peak bytes of heap in use (glibc ``mallinfo2``: ``uordblks + hblkhd``), sampled by a daemon
    thread every ``interval_s``; ``peak_mb`` is None where glibc's ``mallinfo2`` is missing."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.peak = 0
        try:
            self._mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
            self._mallinfo2.restype = _MallInfo2
        except (OSError, AttributeError):
            self._mallinfo2 = None
            return
        threading.Thread(target=self._sample, args=(interval_s,), daemon=True).start()

    def _sample(self, interval_s: float) -> None:
        while True:
            info = self._mallinfo2()
            self.peak = max(self.peak, info.uordblks + info.hblkhd)
            time.sleep(interval_s)

    @property
    def peak_mb(self) -> float | None:
        return self.peak / 2**20 if self._mallinfo2 is not None else None


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(L.LightningModule):
    reads_parameters_between_steps = False  # its batch hooks only time: overlap_param_gather need not wait

    def __init__(
        self,
        vocab: int,
        dim: int,
        layers: int,
        seq: int,
        zero_redundancy: bool,
        fused: bool = False,
        fsdp2_reshard: bool | None = None,
    ) -> None:
        super().__init__()
        self.fsdp2_reshard = fsdp2_reshard
        self.heap: HeapPeak | None = None
        self.emb, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, max(1, dim // 64)) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.zero_redundancy = zero_redundancy
        self.fused = fused
        self.step_s: list[float] = []
        self.wait_s: list[float] = []
        self.counted = {"elements": 0}

    def configure_model(self) -> None:
        if self.fsdp2_reshard is None:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=self.fsdp2_reshard)
        fully_shard(self, mesh=mesh, reshard_after_forward=self.fsdp2_reshard)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        mask = torch.triu(torch.full((idx.shape[1],) * 2, float("-inf")), diagonal=1)
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.zero_redundancy:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=self.fused or None)

    def on_fit_start(self) -> None:
        wrapper = self.trainer.strategy.model
        if isinstance(wrapper, nn.parallel.DistributedDataParallel):
            counted = self.counted

            def counting_allreduce(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations

                n = dist.get_world_size()
                counted["elements"] += 2 * bucket.buffer().numel() * (n - 1) // n
                return default_hooks.allreduce_hook(state, bucket)

            wrapper.register_comm_hook(None, counting_allreduce)
            if self.zero_redundancy:  # its parameter sync is python-level dist.broadcast
                original = dist.broadcast

                def counting_broadcast(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                    counted["elements"] += (
                        tensor.numel() * (dist.get_world_size() - 1) // dist.get_world_size()
                    )
                    return original(tensor, *args, **kwargs)

                dist.broadcast = counting_broadcast

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        opt = getattr(self.trainer.strategy, "sharded_optimizer", None)
        started = getattr(self, "_t0", None)  # None at the first batch of a launch, a resume's too
        if batch_idx > 0 and started is not None:  # the previous step up to now, any gather in flight
            self.step_s.append(now - started)
            if opt is not None:
                opt.engine.flush_timings()
                self.wait_s.append(opt.engine.comm_wait_s())
        self._t0 = now
        self.counted["elements"] = 0
        if opt is not None:
            opt.engine.reset_comm_stats()

    def on_train_start(self) -> None:
        self.setup_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def on_train_end(self) -> None:  # before the strategy tears the sharded optimizer down
        self.train_heap_mb = self.heap.peak_mb if self.heap is not None else None  # training only
        self.figures = optimizer_and_grad_bytes(self.trainer, self)
        opt = getattr(self.trainer.strategy, "sharded_optimizer", None)
        self.inter = (  # hybrid sharding: sent across the replica groups in the last step, and the formula's
            (opt.engine.replica_comm_stats.elements_sent, opt.engine.min_replica_elements_per_step())
            if opt is not None
            else None
        )  # read before collectives_alone_s sends more
        engine = None if opt is None else opt.engine
        self.bytes_sent = None if engine is None else engine.comm_stats.bytes_sent
        if engine is not None:
            self.bytes_sent += engine.replica_comm_stats.bytes_sent
        quantized = opt is not None and "int8" in (opt.config.reduce_dtype, opt.config.gather_dtype)
        # the int8 wire's collectives (all-to-all, byte rows) are not the ones timed alone: no "exposed"
        self.alone_s = collectives_alone_s(opt) if opt is not None and not quantized else None
        self.min_elements = opt.engine.min_elements_per_step() if opt is not None else None


def optimizer_and_grad_bytes(trainer: L.Trainer, model: GPT) -> tuple[int, int | None, int]:
    """(optimizer state bytes, gradient bytes or None where not counted, elements sent in the last
    step) on this rank."""
    opt = getattr(trainer.strategy, "sharded_optimizer", None)
    if opt is not None:
        grads = sum(g.numel() * g.element_size() for g in opt.engine.reducer.grad_shards)
        return opt.engine.memory().state_bytes, grads, opt.engine.comm_stats.elements_sent
    inner = trainer.optimizers[0]
    inner = getattr(inner, "optim", inner)  # ZeroRedundancyOptimizer keeps the local optimizer in .optim
    inner = getattr(inner, "optimizer", inner)  # DeepSpeed's ZeRO optimizers wrap the model's
    state = sum(
        _local_bytes(t)
        for s in inner.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.ndim > 0
    )
    grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    if isinstance(trainer.strategy, DeepSpeedStrategy):  # its gradients live in its own buffers
        return state, None, model.counted["elements"]
    return state, grads, model.counted["elements"]


def _local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of ``tensor`` (an FSDP2 DTensor: its local shard)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def collectives_alone_s(opt: Any, repeats: int = 3) -> float:
    """Seconds one step's gradient and parameter collectives take with nothing else running."""
    opt.wait_for_params()
    engine, stage = opt.engine, opt.config.stage
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for b, bucket in enumerate(engine.plan.buckets):
            wire = torch.zeros(bucket.padded_numel, dtype=engine.config.wire_dtype(bucket.dtype))
            grad = engine.reducer.grad_shards[b]
            grad = grad if grad.dtype == wire.dtype else torch.empty(grad.numel(), dtype=wire.dtype)
            comm = engine.comm
            comm.wait(comm.reduce_scatter(grad, wire) if stage >= 2 else comm.all_reduce(wire))
            replicas = engine.groups.replicas  # hybrid sharding: the shard's all-reduce across groups
            if replicas.world_size > 1:
                replicas.wait(replicas.all_reduce(grad))
            full = torch.empty(bucket.padded_numel)  # stage 3's full buffers hold no storage here
            gathers = 2 if stage == 3 and bucket.unit != 0 and opt.config.reshard_after_forward else 1
            for _ in range(gathers):
                comm.wait(comm.all_gather(full, engine.flat.shard(bucket)))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def model_shape(args: argparse.Namespace) -> dict[str, int]:
    """``args.model``'s shape with ``--layers``, ``--dim``, ``--vocab`` laid over it."""
    overrides = {k: getattr(args, k) for k in ("layers", "dim", "vocab") if getattr(args, k) is not None}
    return {**MODELS[args.model], **overrides}


def make_model(name: str, shape: dict[str, int], seq: int) -> GPT:
    return GPT(
        shape["vocab"],
        shape["dim"],
        shape["layers"],
        seq,
        zero_redundancy=name.endswith("Optimizer"),
        fused=name.endswith("fused"),
        fsdp2_reshard=(not name.endswith("keep")) if name.startswith("fsdp2") else None,
    )


def make_strategy(name: str, args: argparse.Namespace) -> Any:
    """The Trainer's ``strategy`` for the row ``name`` of STRATEGIES."""
    if name.startswith("ddp"):
        return "ddp"
    if name.startswith("zero"):
        cap = 5.0 if name.endswith("5MB") else args.bucket_cap_mb
        wire = {"bf16": "bf16", "int8": "int8"}.get(name.rsplit("-", 1)[-1])
        stage3 = {"reshard_after_forward": not name.endswith("keep")}  # units: blocks, embedding, head
        return lightning_zero.ZeroStrategy(
            stage=int(name[4]),
            shard_group_size=2 if name.endswith("2x2") else None,  # 4 ranks: 2 groups of 2
            bucket_cap_mb=cap,
            overlap_param_gather=name.endswith("overlap"),
            skip_nonfinite_steps=3 if name.endswith("nonfinite") else 0,
            reduce_dtype=wire,
            gather_dtype="int8" if name == "zero3-int8" else None,
            **(stage3 if name.startswith("zero3") else {}),
        )
    if name.startswith("fsdp2"):
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    if name.startswith("fsdp-"):
        from torch.distributed.fsdp import ShardingStrategy

        full = name == "fsdp-full"
        sharding = ShardingStrategy.FULL_SHARD if full else ShardingStrategy.SHARD_GRAD_OP
        return CPUFSDPStrategy(sharding_strategy=sharding, auto_wrap_policy={Block})
    if name.startswith("deepspeed"):
        return CPUDeepSpeedStrategy(stage=int(name[-1]))
    raise ValueError(f"unknown strategy row {name!r}")


def unavailable(name: str, devices: int = 2) -> str | None:
    """Why the row ``name`` cannot run in this environment, or None."""
    if name.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed not installed (pip install deepspeed==0.19.8)"
    if name.endswith("2x2") and devices != 4:
        return f"2 shard groups of 2 ranks need --devices 4, not {devices}"
    return None


def child_env(mmap_threshold: int | None = None) -> dict[str, str]:
    """The environment of every launch: one thread per rank, DeepSpeed's CPU accelerator.

    ``mmap_threshold`` fixes glibc's mmap threshold at that many bytes (``MALLOC_MMAP_THRESHOLD_``,
    which also turns its dynamic threshold off), the same for every row: freed buffers above it go
    back to the system at once, so RSS follows what is allocated (see docs/performance.md).
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", DS_ACCELERATOR="cpu")
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    return env


def failure_reason(returncode: int, stderr: str) -> str:
    """One line saying why a launch failed: the last exception line of its stderr, else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", line)]
    if errors:
        return errors[-1][:300]
    if returncode < 0:
        return f"killed by signal {-returncode}"
    return f"exit code {returncode}: {lines[-1][:300] if lines else 'no output'}"


def run_one(name: str, args: argparse.Namespace) -> None:
    """One launch of the row ``name`` (this process is rank 0; Lightning starts the others): trains
    and writes this rank's figures to ``figures_path``."""
    heap = HeapPeak()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    shape = model_shape(args)
    tokens = torch.randint(
        0, shape["vocab"], (args.steps * args.batch * args.devices, args.seq + 1), generator=g
    )
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    model = make_model(name, shape, args.seq)
    model.heap = heap
    params = sum(p.numel() for p in model.parameters())  # before a wrapper shards them
    if name.startswith(("fsdp", "deepspeed")):
        count_collectives(model.counted)
    trainer = L.Trainer(
        strategy=make_strategy(name, args),
        devices=args.devices,
        accelerator="cpu",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=args.batch))
    state_b, grad_b, sent = model.figures
    skip = min(WARMUP_STEPS, len(model.step_s) - 1)  # at least one step is kept
    figures = {
        "min_elements": model.min_elements,
        "inter_elements": model.inter,
        "step_s": model.step_s[skip:],
        "wait_s": model.wait_s[skip:],
        "alone_s": model.alone_s,
        "opt_state_bytes": state_b,
        "grad_bytes": grad_b,
        "elements_sent": sent,
        "bytes_sent": getattr(model, "bytes_sent", None),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "setup_rss_mb": model.setup_rss_mb,
        "peak_heap_mb": model.train_heap_mb,
        "params": params,
    }
    figures_path(args, name, args.round, trainer.global_rank).write_text(json.dumps(figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", choices=[*MODELS, "both"], default="both")
    parser.add_argument("--layers", type=int, help="overrides the model's layer count")
    parser.add_argument("--dim", type=int, help="overrides the model's width")
    parser.add_argument("--vocab", type=int, help="overrides the model's vocabulary size")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument(
        "--bucket-cap-mb", type=float, default=25.0, help="for zero1/zero2 (DDP keeps its 25)"
    )
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        metavar="BYTES",
        help="fix glibc's mmap threshold for every row (e.g. 1048576); default: glibc's dynamic one",
    )
    parser.add_argument("--out", default="benchmarks/results/step_time")
    parser.add_argument(
        "--json", type=Path, help="also write every rank's raw figures, by model and row, to this file"
    )
    parser.add_argument("--rounds", type=int, default=2, help="runs of every strategy, interleaved")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    parser.add_argument("--only", choices=STRATEGIES, help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only:
        run_one(args.only, args)
        return
    Path(args.out).mkdir(parents=True, exist_ok=True)
    models = list(BOTH) if args.model == "both" else [args.model]
    not_run: dict[str, dict[str, str]] = {model: {} for model in models}
    for model in models:
        for k in range(args.rounds):
            for name in args.strategies.split(","):
                if name in not_run[model]:
                    continue
                print(f"{model}, round {k + 1}/{args.rounds}: {name} ...", flush=True)
                args.model = model
                for stale in range(args.devices):  # a failed launch must not report an older run
                    figures_path(args, name, k, stale).unlink(missing_ok=True)
                reason = unavailable(name, args.devices) or launch(
                    [sys.executable, *sys.argv, "--model", model, "--only", name, "--round", str(k)],
                    args.mmap_threshold,
                )
                if reason:
                    print(f"  not run: {reason}", flush=True)
                    not_run[model][name] = reason
    raw = {}
    for model in models:
        args.model = model
        raw[model] = {"rows": report(args, not_run[model]), "not_run": not_run[model]}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(raw, indent=1) + "\n")
        print(f"\nraw figures: {args.json}")


def launch(cmd: list[str], mmap_threshold: int | None = None) -> str | None:
    """Runs one launch to its end; why it failed, or None."""
    env = child_env(mmap_threshold)
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return failure_reason(proc.returncode, proc.stderr) if proc.returncode else None


if __name__ == "__main__":
    main()
