"""The model that :mod:`step_time` times, and what it reads off each strategy: a GPT LightningModule
that records its step times, communication waits and elements sent, the optimizer-state and gradient
bytes a rank holds, the collectives of one step timed alone, and the heap's peak.

Imported by ``step_time.py`` and the benchmarks that train the same model (``checkpoint_io.py``,
``nonfinite_cost.py``, ``largest_model.py``, ``stage3_accumulation.py``), through ``step_time``.
"""

from __future__ import annotations

import ctypes
import resource
import statistics
import threading
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


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
        self.batch_marks: dict[str, float] = {}  # the engine's counters at the last batch start

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
                self.wait_s.append(opt.engine.comm_wait_s() - self.batch_marks["wait_s"])
        self._t0 = now
        self.counted["elements"] = 0
        if opt is not None:  # not reset: a step profiler reads the same counters across this hook
            self.batch_marks = comm_marks(opt.engine)

    def on_train_start(self) -> None:
        self.setup_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def on_train_end(self) -> None:  # before the strategy tears the sharded optimizer down
        self.train_heap_mb = self.heap.peak_mb if self.heap is not None else None  # training only
        self.figures = optimizer_and_grad_bytes(self.trainer, self)
        opt = getattr(self.trainer.strategy, "sharded_optimizer", None)
        engine = None if opt is None else opt.engine
        last = (
            None if engine is None else last_step_sent(engine, self.batch_marks)
        )  # before collectives_alone_s
        self.inter = (  # hybrid sharding: sent across the replica groups in the last step, and the formula's
            (last["replica_elements"], engine.min_replica_elements_per_step()) if last is not None else None
        )
        self.bytes_sent = None if last is None else last["bytes"] + last["replica_bytes"]
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
        sent = last_step_sent(opt.engine, model.batch_marks)["elements"]
        return opt.engine.memory().state_bytes, grads, sent
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


def comm_marks(engine: Any) -> dict[str, float]:
    """The engine's communication counters now. The model reads its figures as differences from the
    marks of the last batch start instead of resetting the counters there: a reset inside a profiled
    step (a LightningModule's batch-start hook runs after the callbacks') would cut the step profile's
    wait and collective tally short."""
    stats, replicas = engine.comm_stats, engine.replica_comm_stats
    return {
        "wait_s": engine.comm_wait_s(),
        "elements": stats.elements_sent,
        "bytes": stats.bytes_sent,
        "replica_elements": replicas.elements_sent,
        "replica_bytes": replicas.bytes_sent,
    }


def last_step_sent(engine: Any, marks: dict[str, float]) -> dict[str, float]:
    """What the engine's counters grew by since ``marks`` (:func:`comm_marks` at the last batch start)."""
    return {k: v - marks[k] for k, v in comm_marks(engine).items()}


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
            again = stage == 3 and not engine.units.held_through_backward(bucket.unit)  # gathered in backward
            gathers = 2 if again else 1
            for _ in range(gathers):
                comm.wait(comm.all_gather(full, engine.flat.shard(bucket)))
        times.append(time.perf_counter() - start)
    return statistics.median(times)
