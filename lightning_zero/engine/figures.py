"""What an engine reports: communication counters and timings, memory held, skipped steps.

:class:`EngineFigures` is a part of :class:`~lightning_zero.engine.engine.ShardEngine` (its base),
kept apart from the training path: benchmarks, the monitor and tests read these, the step never does.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import torch

from lightning_zero.comm.communicator import Comm
from lightning_zero.comm.groups import CommGroups
from lightning_zero.comm.handles import CommStats
from lightning_zero.comm.host_clock import CLOCK
from lightning_zero.config import ZeroConfig
from lightning_zero.engine.nonfinite import NonFiniteGuard
from lightning_zero.engine.reducer import GradReducer
from lightning_zero.engine.shard_state import ShardState
from lightning_zero.engine.unit_gather import UnitGather
from lightning_zero.layout.buckets import BucketPlan
from lightning_zero.layout.flat import FlatParams
from lightning_zero.layout.memory import PRECISION_BYTES, estimate_components, full_precision


@dataclass(frozen=True)
class EngineMemory:
    """What the engine holds on this rank, for benchmarks and tests."""

    state_bytes: int
    """Optimizer moments and separate master copies."""
    grad_shard_bytes: int
    """The averaged gradient shards."""
    pool_bytes: int
    """Accumulation buffers of the wire pool allocated so far."""
    adopted: int
    """Gradients that became their bucket's accumulation buffer so far (no copy, no pool slot)."""
    allocations_outside_pool: int
    """Accumulation buffers allocated because every pool slot was busy (e.g. ``no_sync``)."""
    peak_accumulating_bytes: int = 0
    """The most bytes of accumulation buffers holding gradients at once so far (full-size, all
    buckets, across ``no_sync`` micro-batches; a few buckets with ``sharded_accumulation``)."""
    param_bytes: int = 0
    """The trainable parameters this rank keeps: the flat buffers (stages 1 and 2: every parameter),
    or this rank's persistent shards (stage 3)."""
    gathered_bytes: int = 0
    """Stage 3: the full buffers of the buckets gathered now (the units held at this moment); 0 below."""


class EngineFigures:
    """Figures of an engine's parts (the attributes :class:`ShardEngine` sets)."""

    comm: Comm
    groups: CommGroups
    world: Comm
    config: ZeroConfig
    guard: NonFiniteGuard
    plan: BucketPlan
    reducer: GradReducer
    state: ShardState
    units: UnitGather | None
    flat: FlatParams

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for inf/NaN gradients (``skip_nonfinite_steps``) since the engine was
        built; the same on every rank. Steps skipped by fp16 loss scaling are not counted."""
        return self.guard.skipped_steps

    @property
    def comm_stats(self) -> CommStats:
        """Elements and bytes sent and time waited since the counters were last reset, inside the
        shard group (all of it under flat sharding; under hybrid sharding the small control
        collectives over all ranks, masks and flags, are counted on the world's group, not here)."""
        return self.comm.stats

    @property
    def replica_comm_stats(self) -> CommStats:
        """The same for the all-reduces across replica groups (hybrid sharding; zero under flat)."""
        return self.groups.replicas.stats

    def _comms(self) -> list[Comm]:
        """The distinct communicators (one under flat sharding, three under hybrid)."""
        return list({id(c): c for c in (self.comm, self.groups.replicas, self.world)}.values())

    def reset_comm_stats(self) -> None:
        """Zero every counter of :attr:`comm_stats` and :attr:`replica_comm_stats`."""
        for comm in self._comms():
            comm.stats.reset()

    def comm_wait_s(self, since_start: bool = False) -> float:
        """Seconds blocked on collectives since the counters were reset (:meth:`reset_comm_stats`), over
        every group; ``since_start``: since the engine was built, whatever was reset (what a reader of
        differences over a window reads: another reader may reset the counters inside it)."""
        if since_start:
            return sum(comm.stats.waits_since_start_s[0] for comm in self._comms())
        return sum(comm.stats.wait_s for comm in self._comms())

    def comm_gather_wait_s(self, since_start: bool = False) -> float:
        """Of :meth:`comm_wait_s` (with the same ``since_start``), the seconds blocked on parameter
        all-gathers (stage 3's unit gathers; stages 1 and 2: the gathers after the optimizer step)."""
        if since_start:
            return sum(comm.stats.waits_since_start_s[1] for comm in self._comms())
        return sum(comm.stats.gather_wait_s for comm in self._comms())

    def start_collective_tally(self) -> None:
        """Count the collectives and bytes this rank sends, by kind and group, until
        :meth:`stop_collective_tally` (off, the default, it costs one test per collective)."""
        for comm in self._comms():
            comm.stats.start_tally()

    def stop_collective_tally(self) -> dict[str, tuple[int, int]]:
        """Stop the tally; returns ``"<kind> <group>" -> (collectives, bytes sent)`` since it started,
        bytes at the ring-algorithm cost :attr:`comm_stats` counts (kinds:
        :attr:`~lightning_zero.comm.CommStats.tally`; groups: ``world`` (flat sharding: every
        collective), ``shard`` and ``replicas`` (node-aware sharding))."""
        out: dict[str, tuple[int, int]] = {}
        for comm in self._comms():
            for kind, (count, nbytes) in comm.stats.stop_tally().items():
                before = out.get(f"{kind} {comm.role}", (0, 0))
                out[f"{kind} {comm.role}"] = (before[0] + count, before[1] + nbytes)
        return out

    def estimated_memory(self, precision: str) -> dict[str, int]:
        """What ``lightning-zero estimate`` predicts this rank holds
        (:func:`~lightning_zero.layout.memory.estimate_components`) for this engine's parameters (this
        rank's stage and tensor shard: the estimate's ``Ψ / (T·P)``), stage, shard group size, bucket
        size and, at stage 3, largest unit besides the root, keyed as :meth:`memory`'s figures:
        ``param_bytes``, ``grad_shard_bytes``, ``state_bytes``, ``peak_accumulating_bytes`` (its
        gradient buckets in flight) and ``gathered_peak_bytes`` (its gathered units, plus the root unit,
        which the command leaves out, not knowing it, and stage 3 holds for the whole step; stages 1
        and 2: 0)."""
        numel = sum(b.numel for b in self.plan.buckets)
        by_unit: dict[int, int] = {}
        for b in self.plan.buckets:
            by_unit[b.unit] = by_unit.get(b.unit, 0) + b.numel
        unit = max((n for u, n in by_unit.items() if u != 0), default=0) if self.units is not None else 0
        parts = estimate_components(
            numel,
            self.comm.world_size,
            precision,
            self.config.bucket_cap_mb,
            unit,
            self.config.prefetch_units,
        )[f"zero{self.config.stage}"]
        kinds = {
            "param_bytes": "parameters",
            "grad_shard_bytes": "gradients",
            "state_bytes": "optimizer state",
            "peak_accumulating_bytes": "gradient buckets",
            "gathered_peak_bytes": "gathered units",
        }
        estimate = {kind: round(parts[name]) for kind, name in kinds.items()}
        if self.units is not None:
            estimate["gathered_peak_bytes"] += (
                by_unit.get(0, 0) * PRECISION_BYTES[full_precision(precision)][0]
            )
        return estimate

    def time_device_waits(self, on: bool = True) -> bool:
        """Measure communication waits with CUDA events (NCCL, where a host timer reads ~0); they are
        added to :attr:`comm_stats` by :meth:`flush_timings`. ``on=False`` stops it (read what was
        recorded first: :meth:`flush_timings`).

        Returns:
            whether it was on before the call.
        """
        before = self.comm.time_device_waits
        for comm in self._comms():
            comm.time_device_waits = on
        return before

    def time_host(self, on: bool = True) -> bool:
        """Time the host in lightning-zero's code on this thread (the process's clock, shared by every
        engine: :mod:`lightning_zero.comm.host_clock`), read by :meth:`host_s`; ``on=False`` stops it.

        Returns:
            whether it was on before the call.
        """
        if on:
            return CLOCK.start()
        was = CLOCK.on
        CLOCK.stop()
        return was

    def host_s(self) -> float:
        """Seconds the host spent in lightning-zero's code, less its waits on collectives, while
        :meth:`time_host` was on (never reset: read differences)."""
        return CLOCK.seconds

    def synchronize_device(self) -> None:
        """Wait until this rank's device has run the work queued so far (CUDA; nothing on a CPU, where
        work runs as it is issued): for host timers that must include it, e.g. the step profiler's
        phase boundaries. Never called by the step itself."""
        if self.comm.device.type == "cuda":
            torch.cuda.synchronize(self.comm.device)

    def peak_memory_bytes(self) -> tuple[int, str]:
        """The most memory this rank has held: the device's peak of allocated bytes (CUDA), else the
        process's peak resident set (which counts everything the process holds, Python included).

        Returns:
            the bytes and what they are: ``"cuda_max_memory_allocated"`` or ``"process_max_rss"``.
        """
        if self.comm.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.comm.device), "cuda_max_memory_allocated"
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return peak if sys.platform == "darwin" else peak * 1024, "process_max_rss"

    def flush_timings(self) -> None:
        """Add the device-measured waits so far to :attr:`comm_stats` (synchronises the device)."""
        for comm in self._comms():
            comm.flush_timings()

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        """Every rank's ``values`` (e.g. its step time), in rank order. All ranks; one small collective."""
        return self.world.all_gather_floats(values)

    def min_elements_per_step(self) -> int:
        """The elements a rank must send per step at stage 2 or 3: ``2·Ψ·(N−1)/N`` (padded Ψ), plus at
        stage 3 with ``reshard_after_forward`` the backward's second gather of every unit but the root
        and the one that ran last in the last forward (both stay gathered from their forward to their
        backward): a step whose forward ends at another unit sends that unit's gather once more."""
        numel = 2 * sum(b.padded_numel for b in self.plan.buckets)
        if self.units is not None:
            numel += sum(
                b.padded_numel for b in self.plan.buckets if not self.units.held_through_backward(b.unit)
            )
        return numel * (self.comm.world_size - 1) // self.comm.world_size

    def min_replica_elements_per_step(self) -> int:
        """The elements a rank sends across replica groups per step (hybrid sharding, every stage): an
        all-reduce of its gradient shard, ``2·(Ψ/G)·(R−1)/R`` (padded Ψ, ``G`` ranks per shard group,
        ``R`` replica groups); 0 under flat sharding."""
        replicas, group = self.groups.replicas.world_size, self.comm.world_size
        return sum(2 * ((b.padded_numel // group) * (replicas - 1) // replicas) for b in self.plan.buckets)

    def memory(self) -> EngineMemory:
        """What this rank holds (see :class:`EngineMemory`)."""
        grads = self.reducer.grad_shards
        return EngineMemory(
            state_bytes=self.state.nbytes(),
            grad_shard_bytes=sum(g.numel() * g.element_size() for g in grads),
            pool_bytes=self.reducer.pool.nbytes(),
            adopted=self.reducer.adopted,
            allocations_outside_pool=self.reducer.allocations_outside_pool,
            peak_accumulating_bytes=self.reducer.peak_accumulating_bytes,
            param_bytes=self._param_bytes(),
            gathered_bytes=self.gathered_bytes(),
        )

    def gathered_bytes(self) -> int:
        """Stage 3: the bytes of the full buffers gathered now (0 below stage 3)."""
        if not self.flat.sharded:
            return 0
        return sum(_nbytes(self.flat.bucket(b)) for b in self.plan.buckets if self.flat.is_gathered(b))

    def gathered_peak_bytes(self, reset: bool = False) -> int:
        """Stage 3: the most bytes of full buffers gathered at once since the last reset (the engine's
        high-water mark, kept at each gather; 0 below stage 3). ``reset``: then start again from what
        is gathered now."""
        if not self.flat.sharded:
            return 0
        peak = self.flat.gathered_peak_nbytes
        if reset:
            self.flat.reset_gathered_peak()
        return peak

    def _param_bytes(self) -> int:
        held = self.flat.shards if self.flat.sharded else list(self.flat.buffers.values())
        return sum(_nbytes(t) for t in held)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
