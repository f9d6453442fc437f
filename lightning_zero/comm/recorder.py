"""The collective-order recorder: what NCCL requires of the sequence of collectives, checked on gloo.

NCCL enqueues a collective on a stream and matches it with the peers' by *position*: every rank of a
communicator must issue that communicator's collectives in the same order, with the same sizes, or
the job hangs (or sums the wrong tensors). With ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (one hardware queue)
the kernels of different communicators also run one after another, so the way a rank interleaves the
collectives of its groups matters too. gloo is forgiving where NCCL is not (a collective is CPU work
that completes in program order), so a test that passes on gloo proves nothing about either rule
unless the order itself is checked. The rule this package keeps (``docs/architecture.md``): the
sequence of collectives each rank issues, per group and interleaved across groups, is a function of
the program (the step's buckets, units and options), never of timing.

Test mode: with ``LZ_COLLECTIVE_LOG=DIR`` in the environment when a :class:`~lightning_zero.comm.Comm`
is built, every collective it issues is appended, as the caller issues it (the logical collective, as
NCCL would see it: gloo's split reduce-scatter is one entry), to ``DIR/<launch>.rank<R>.jsonl``: one
JSON line ``[role, group ranks, op, numel, dtype, ordered]`` per collective. ``role`` names the group
by what it is for (``world``, ``shard``, ``replicas``, ``background``), so ranks of different shard
groups compare equal; ``ordered`` is false for a group whose collectives run on a thread of their own
(the async checkpoint writer's gloo group), which cannot be interleaved deterministically with the
training thread and need not be (it shares no stream with NCCL's), and for collectives that only some
groups issue by design (:meth:`~lightning_zero.comm.Comm.only_some_groups`: under node-aware sharding
only the first replica group gathers the optimizer state, inside its shard group, while the others,
which hold the same shards, go on to the next collective every rank issues and wait there). ``<launch>`` is
``LZ_COLLECTIVE_LAUNCH``, else ``MASTER_ADDR:MASTER_PORT`` with SLURM's job id and restart count and
torchrun's restart count, so the ranks of one launch meet and a requeued job is a launch of its own.

:func:`compare_logs` (what the test suite runs after every test) then checks two rules and names the
first violation with the ranks, the position and both entries:

  1. **per group**: every member of a process group issued the same sequence of collectives on it;
  2. **interleaved**: every rank issued the same sequence of ``(role, op, numel, dtype)`` over its
     ordered groups (what NCCL with one hardware queue needs, and what a timing-dependent launch
     breaks first). Under pipeline parallelism (a group of role ``pipeline``) the stages run
     different programs (their parameters, so their buckets, differ): the rule holds among the
     ranks of one stage (the same position in their pipeline groups), and rule 1 across stages.

A launch that is meant to fail (a fault test: ``LZ_COLLECTIVE_FAULTS`` set in its environment, or
the whole test marked) is compared up to where its shortest rank stopped.
No entry is written, and nothing is read from the environment per collective, when the variable is
not set at the time a ``Comm`` is built.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

ENV_DIR = "LZ_COLLECTIVE_LOG"
"""Directory of the logs; unset: nothing is recorded."""
ENV_LAUNCH = "LZ_COLLECTIVE_LAUNCH"
"""Name of the launch a process belongs to (default: ``MASTER_ADDR:MASTER_PORT``)."""
ENV_FAULTS = "LZ_COLLECTIVE_FAULTS"
"""Set (to anything) in a launch that fails on purpose: its ranks are compared up to where the first
one stopped (its logs are named ``<launch>+faults``)."""
FAULTS_SUFFIX = "+faults"


@dataclass(frozen=True)
class Entry:
    """One collective as a rank issued it."""

    role: str
    group: tuple[int, ...]
    """Global ranks of the process group, in group-rank order."""
    op: str
    numel: int
    """Elements of the logical collective (-1 for Python objects, whose size may differ by rank)."""
    dtype: str
    ordered: bool = True
    """Issued on the training thread (see the module docstring)."""
    name: str = ""
    """The process group's name (the same on every rank): two groups over the same ranks differ."""

    def describe(self) -> str:
        size = "an object" if self.numel < 0 else f"{self.numel} x {self.dtype}"
        return f"{self.op} of {size} on the {self.role} group {list(self.group)}"


class _Log:
    """One process's open log file (appended to line by line, so a rank that dies keeps what it did)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[str, IO[str]] = {}

    def write(self, directory: str, rank: int, entry: Entry) -> None:
        launch = os.environ.get(ENV_LAUNCH) or (  # a requeued or restarted job is a launch of its own
            f"{os.environ.get('MASTER_ADDR', 'local')}:{os.environ.get('MASTER_PORT', 'none')}"
            f"-{os.environ.get('SLURM_JOB_ID', '')}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"
            f".{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        )
        faults = FAULTS_SUFFIX if os.environ.get(ENV_FAULTS) else ""
        name = f"{_safe(launch)}{faults}.rank{rank}.jsonl"
        line = json.dumps(
            [entry.role, list(entry.group), entry.op, entry.numel, entry.dtype, entry.ordered, entry.name]
        )
        with self._lock:
            key = f"{directory}/{name}/{os.getpid()}"
            out = self._files.get(key)
            if out is None:
                Path(directory).mkdir(parents=True, exist_ok=True)
                out = self._files[key] = open(Path(directory, name), "a", buffering=1)  # noqa: SIM115
            out.write(line + "\n")


_LOG = _Log()


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


class Recorder:
    """Records the collectives of one group (one per :class:`~lightning_zero.comm.Comm`, when on)."""

    def __init__(
        self, directory: str, rank: int, group: Sequence[int], role: str, ordered: bool, name: str = ""
    ) -> None:
        self.directory, self.rank, self.name = directory, rank, name
        self.group, self.role, self.ordered = tuple(group), role, ordered

    def record(self, op: str, numel: int, dtype: object, ordered: bool = True) -> None:
        """Log one collective; ``ordered=False``: issued by some ranks only, by design (compared inside
        its group, left out of the order across groups)."""
        dtype_name = str(dtype).removeprefix("torch.")
        entry = Entry(self.role, self.group, op, numel, dtype_name, self.ordered and ordered, self.name)
        _LOG.write(self.directory, self.rank, entry)


class ListRecorder(Recorder):
    """Records into a list in memory instead of a log file: the sequence of one simulated rank
    (:mod:`lightning_zero.comm.simulated`), whose groups all append to the same list, in the order
    the rank issues their collectives; compare such lists with :func:`compare_ranks`."""

    def __init__(
        self, entries: list[Entry], rank: int, group: Sequence[int], role: str, ordered: bool, name: str = ""
    ) -> None:
        super().__init__("", rank, group, role, ordered, name)
        self.entries = entries

    def record(self, op: str, numel: int, dtype: object, ordered: bool = True) -> None:
        dtype_name = str(dtype).removeprefix("torch.")
        self.entries.append(
            Entry(self.role, self.group, op, numel, dtype_name, self.ordered and ordered, self.name)
        )


def recorder_for(
    rank: int, group: Sequence[int], role: str, ordered: bool = True, name: str = ""
) -> Recorder | None:
    """A :class:`Recorder` when test mode is on (``LZ_COLLECTIVE_LOG`` set), else ``None``."""
    directory = os.environ.get(ENV_DIR)
    return Recorder(directory, rank, group, role, ordered, name) if directory else None


def read_logs(directory: str | Path) -> dict[str, dict[int, list[Entry]]]:
    """``{launch: {rank: entries}}`` of every log in ``directory``."""
    launches: dict[str, dict[int, list[Entry]]] = {}
    for path in sorted(Path(directory).glob("*.rank*.jsonl")):
        launch, _, rank = path.name.removesuffix(".jsonl").rpartition(".rank")
        entries = []
        for line in path.read_text().splitlines():
            if line.strip():
                role, group, op, numel, dtype, ordered, *name = json.loads(line)
                entries.append(Entry(role, tuple(group), op, numel, dtype, ordered, *name))
        launches.setdefault(launch, {})[int(rank)] = entries
    return launches


def _first_difference(
    sequences: Mapping[int, Sequence[Any]], describe: Callable[[Any], str], prefix_only: bool
) -> str | None:
    """The first position where the ranks' sequences differ, named; ``None`` if they agree."""
    ranks = sorted(sequences)
    reference = ranks[0]
    shortest = min(len(s) for s in sequences.values())
    for rank in ranks[1:]:
        mine, theirs = sequences[reference], sequences[rank]
        length = shortest if prefix_only else max(len(mine), len(theirs))
        for position in range(length):
            a = mine[position] if position < len(mine) else None
            b = theirs[position] if position < len(theirs) else None
            if a != b:
                first = "nothing (it stopped)" if a is None else describe(a)
                second = "nothing (it stopped)" if b is None else describe(b)
                return f"collective {position}: rank {reference} issued {first}, rank {rank} issued {second}"
    return None


def compare_ranks(
    launch: str, ranks: Mapping[int, list[Entry]], prefix_only: bool = False, sampled: bool = False
) -> list[str]:
    """The violations of the two rules (module docstring) in one launch's logs, each named.

    ``sampled``: ``ranks`` holds some ranks of the world only (simulated ones): a group is compared
    among its members found there (otherwise a member without a log issued nothing)."""
    problems: list[str] = []
    groups = {(e.role, e.group, e.name) for entries in ranks.values() for e in entries}  # a communicator each
    for role, group, name in sorted(groups, key=lambda g: (g[1], g[0], g[2])):
        key = (role, group, name)
        present = [r for r in group if r in ranks or not sampled]
        members = {r: [e for e in ranks.get(r, []) if (e.role, e.group, e.name) == key] for r in present}
        per_group = {r: [(e.op, e.numel, e.dtype) for e in seq] for r, seq in members.items()}

        def say_op(item: tuple[str, int, str], role: str = role, group: tuple[int, ...] = group) -> str:
            return Entry(role, group, *item).describe()

        found = _first_difference(per_group, say_op, prefix_only)
        if found:
            problems.append(f"launch {launch}, process group {list(group)} ({role}): {found}")
    interleaved = {
        r: [(e.role, e.op, e.numel, e.dtype) for e in entries if e.ordered] for r, entries in ranks.items()
    }

    def say_role(item: tuple[str, str, int, str]) -> str:
        role, op, numel, dtype = item
        size = "an object" if numel < 0 else f"{numel} x {dtype}"
        return f"{op} of {size} on its {role} group"

    by_stage: dict[int | None, dict[int, list[tuple[str, str, int, str]]]] = {}
    for rank, sequence in interleaved.items():
        by_stage.setdefault(_stage(rank, ranks[rank]), {})[rank] = sequence
    for stage, alike in sorted(by_stage.items(), key=lambda s: -1 if s[0] is None else s[0]):
        if len(alike) > 1:
            found = _first_difference(alike, say_role, prefix_only)
            if found:
                among = "" if stage is None else f" (pipeline stage {stage})"
                problems.append(f"launch {launch}, order across groups{among}: {found}")
    return problems


def _stage(rank: int, entries: list[Entry]) -> int | None:
    """The pipeline stage of ``rank``: its position in its ``pipeline`` group (``None``: no pipeline)."""
    for entry in entries:
        if entry.role == "pipeline":
            return entry.group.index(rank)
    return None


def compare_logs(directory: str | Path, prefix_only: bool = False) -> list[str]:
    """Every violation in the logs of ``directory`` (an empty list: every launch is consistent)."""
    problems: list[str] = []
    for launch, ranks in read_logs(directory).items():
        if len(ranks) > 1:
            problems.extend(compare_ranks(launch, ranks, prefix_only or launch.endswith(FAULTS_SUFFIX)))
    return problems


def entries_of(directory: str | Path) -> Iterable[tuple[str, int, list[Entry]]]:
    """``(launch, rank, entries)`` for every log in ``directory`` (for tests that assert on them)."""
    for launch, ranks in read_logs(directory).items():
        for rank, entries in sorted(ranks.items()):
            yield launch, rank, entries
