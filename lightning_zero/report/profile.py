"""A step profile read back: ``step_profile.json`` found under a run directory, and its figures.

``ZeroStrategy(profile_steps=(first, last))`` makes rank 0 write ``step_profile.json`` (format 1; its
fields: ``docs/strategy.md``, "Step profile") in the Trainer's ``log_dir``. :func:`find_profile` finds
it under a run directory; :class:`Profile` holds the figures a report shows. Every field past those of
format 1 (``throughput``, ``estimate``, ``ranks[i].comm``, ``gather_wait_s``, ``host_s``,
``pipeline_idle_s``) is optional: absent, its figure is ``None`` (or empty) and the report says "not
measured".

"The step" is the mean over the ranks of each rank's mean over the window: under data parallelism
every rank's step includes the wait for the slowest, so the ranks' steps are nearly equal.

Pure Python: no torch, no Lightning (``lightning-zero report`` runs where the run's files are copied).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILE_FILE = "step_profile.json"
"""The file :class:`~lightning_zero.integrations.trainer.step_profile.StepProfiler` writes (a test
checks both names agree; this module imports no torch to read it)."""

PARTS = ("data_wait_s", "forward_s", "backward_s", "pipeline_s", "optimizer_s", "other_s")
"""The parts a step is split into; they add up to ``step_s``."""

PEAK = ("peak_bytes", "peak_kind")
"""The device's or process's peak in ``ranks[i].memory``, beside the engine's figures by kind (whatever
kinds the file holds, in its order: the report names none it does not need)."""

THROUGHPUT = (
    "tokens_per_step",
    "tokens_per_s",
    "tokens_per_s_per_device",
    "flops_per_token",
    "flops_formula",
    "achieved_tflops_per_device",
    "peak_tflops_per_device",
    "peak_source",
    "mfu",
)
"""The optional ``throughput`` fields, in the order the report lists them."""


def label(key: str) -> str:
    """A field's name as the report shows it: ``"grad_shard_bytes"`` -> ``"grad shard"``."""
    return key.removesuffix("_s").removesuffix("_bytes").replace("_", " ")


MOST_RANKS_SHOWN = 8
"""Past this many ranks the report shows three: the first, the fastest and the slowest."""


class ReportError(Exception):
    """No step profile where one was looked for, or one that cannot be read."""


def find_profile(run_dir: Path) -> Path:
    """The ``step_profile.json`` of a run: ``run_dir`` itself (the file), ``run_dir/step_profile.json``,
    or ``run_dir/*/version_*/step_profile.json`` and ``run_dir/version_*/step_profile.json`` (a
    Lightning logger's version directories); the newest (by modification time) if several.

    Raises:
        ReportError: none there, naming ``run_dir`` and the places looked at.
    """
    if run_dir.is_file() and run_dir.name == PROFILE_FILE:
        return run_dir
    patterns = (PROFILE_FILE, f"*/version_*/{PROFILE_FILE}", f"version_*/{PROFILE_FILE}")
    found = [p for pattern in patterns for p in run_dir.glob(pattern) if p.is_file()]
    if not found:
        what = "no such directory" if not run_dir.is_dir() else "none found"
        raise ReportError(
            f"no {PROFILE_FILE} under {run_dir} ({what}); looked for "
            + ", ".join(str(run_dir / p) for p in patterns)
            + ". A fit with ZeroStrategy(profile_steps=(first, last)) writes one in the Trainer's log_dir "
            "(the recipe: strategy.profile_steps=[first,last])"
        )
    return max(found, key=lambda p: p.stat().st_mtime)


@dataclass
class RankFigures:
    """One rank's means over the window and its memory."""

    rank: int
    mean: dict[str, float]
    """``step_s``, the parts, ``comm_exposed_s`` and, when measured, ``gather_wait_s``, ``host_s`` and
    ``pipeline_idle_s``."""
    memory: dict[str, int]
    """Bytes by kind (the engine's, in the file's order) and ``peak_bytes``."""
    peak_kind: str
    comm: dict[str, dict[str, int]] = field(default_factory=dict)
    """``{"<kind> <group>": {"count": n, "bytes": b}}`` over the window; empty: not measured."""

    def engine_bytes(self) -> int:
        """What the engine holds at most: parameters, gradient shards, optimizer state, the most
        gathered units, and the larger of the wire pool and the accumulation buffers' peak (the
        buffers holding gradients are mostly the pool's slots: not counted twice)."""
        m = self.memory
        held = sum(m.get(k, 0) for k in ("param_bytes", "grad_shard_bytes", "state_bytes"))
        gathered = max(m.get("gathered_peak_bytes", 0), m.get("gathered_bytes", 0))
        return held + gathered + max(m.get("pool_bytes", 0), m.get("peak_accumulating_bytes", 0))

    def rest_bytes(self) -> int | None:
        """The peak less what the engine holds and, when measured, the activations of a micro-batch:
        the rest (on CUDA the allocator's other tensors, such as the forward's temporaries and the
        logits' gradient; on a CPU, whose peak is the process's, Python and torch too); None without a
        peak."""
        peak = self.memory.get("peak_bytes")
        if peak is None:
            return None
        return peak - self.engine_bytes() - max(self.memory.get("activation_bytes", 0), 0)


@dataclass
class Profile:
    """The figures of one ``step_profile.json`` (see the module docstring)."""

    path: Path
    steps: tuple[int, int]
    pipeline: bool
    ranks: list[RankFigures]
    slowest_rank: int
    fastest_rank: int
    slowest_over_fastest: float
    throughput: dict[str, Any] | None = None
    """The optional ``throughput`` fields; None: not measured."""
    estimate: dict[str, int] | None = None
    """The predicted bytes per rank by memory kind; None: not given."""

    def mean(self, name: str) -> float | None:
        """``name``'s mean over the ranks (of each rank's window mean); None if no rank measured it."""
        values = [r.mean[name] for r in self.ranks if name in r.mean]
        return statistics.fmean(values) if values else None

    def share(self, name: str) -> float:
        """``name``'s mean as a fraction of the mean step (0 when not measured)."""
        step = self.mean("step_s") or 0.0
        return (self.mean(name) or 0.0) / step if step > 0 else 0.0

    def memory_kinds(self) -> list[str]:
        """The engine's memory kinds the shown ranks hold, in the file's order, then any other the
        estimate names."""
        held = dict.fromkeys(k for r in self.shown_ranks() for k in r.memory if k not in PEAK)
        return [*held, *sorted(set(self.estimate or {}) - set(held) - set(PEAK))]

    def comm_kinds(self) -> list[str]:
        """Every ``"<kind> <group>"`` some rank shown measured, sorted; empty: not measured."""
        return sorted({key for r in self.shown_ranks() for key in r.comm})

    def shown_ranks(self) -> list[RankFigures]:
        """The ranks the charts and tables show: all up to :data:`MOST_RANKS_SHOWN`, else the first,
        the fastest and the slowest (the summary's means are over every rank)."""
        if len(self.ranks) <= MOST_RANKS_SHOWN:
            return self.ranks
        picked = {self.ranks[0].rank, self.fastest_rank, self.slowest_rank}
        return [r for r in self.ranks if r.rank in picked]


def load_profile(path: Path) -> Profile:
    """Read ``path`` (a ``step_profile.json``).

    Raises:
        ReportError: unreadable, not JSON, or missing a format-1 field (named).
    """
    try:
        data = json.loads(path.read_text())
        ranks = [_rank(r) for r in data["ranks"]]
        first, last = data["steps"]
        profile = Profile(
            path=path,
            steps=(int(first), int(last)),
            pipeline=bool(data.get("pipeline", False)),
            ranks=ranks,
            slowest_rank=int(data["slowest_rank"]),
            fastest_rank=int(data["fastest_rank"]),
            slowest_over_fastest=float(data["slowest_over_fastest"]),
            throughput=data.get("throughput") or None,
            estimate={k: int(v) for k, v in data["estimate"].items()} if data.get("estimate") else None,
        )
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ReportError(f"{path}: not a readable step profile ({type(error).__name__}: {error})") from error
    if not ranks:
        raise ReportError(f"{path}: a step profile without ranks")
    return profile


def _rank(row: dict[str, Any]) -> RankFigures:
    memory = row["memory"]
    return RankFigures(
        rank=int(row["rank"]),
        mean={k: float(v) for k, v in row["mean"].items()},
        memory={k: int(v) for k, v in memory.items() if k != "peak_kind"},
        peak_kind=str(memory.get("peak_kind", "peak")),
        comm={
            k: {"count": int(v["count"]), "bytes": int(v["bytes"])} for k, v in row.get("comm", {}).items()
        },
    )
