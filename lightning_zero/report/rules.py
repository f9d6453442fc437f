"""The three-line summary of a step profile, and the rule table that picks its third line.

Line 1 is the step (its mean time; tokens/s and MFU when measured), line 2 where it goes (the largest
parts as a share of it), line 3 the one thing to look at first: the first rule of :data:`RULES`, in
order, that fires. The same table is ``docs/report.md``'s "Rules" (``tests/unit/test_report.py``
checks they are equal, word for word), so the docs and the code cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lightning_zero.report.profile import PARTS, Profile, label

COMM_SHARE = 0.30
"""Exposed communication above this share of the step is the first thing to look at."""
DATA_SHARE = 0.10
IMBALANCE = 1.1
BUBBLE_SHARE = 0.20
"""A pipeline stage idle above this share of the step (the bubble, the waits for its neighbours)."""
HOST_SHARE = 0.30
"""On CUDA, the host in lightning-zero's code above this share of the step: the device waits for it."""
MEMORY_FACTOR = 2.0
DEVICE_PEAK = "cuda_max_memory_allocated"
"""The one peak kind compared with the engine's figures: a process's resident set holds Python, torch
and the data loader too, so on a CPU that comparison says nothing about activations."""


def pct(fraction: float) -> str:
    """``0.412`` -> ``"41.2 %"``."""
    return f"{100 * fraction:.1f} %"


def _comm(p: Profile) -> str | None:
    share = p.share("comm_exposed_s")
    if share <= COMM_SHARE:
        return None
    gather = p.mean("gather_wait_s")
    of_it = (
        f" ({pct(p.share('gather_wait_s'))} of the step waiting for parameter all-gathers)" if gather else ""
    )
    return f"exposed communication is {pct(share)} of the step{of_it}"


def _data(p: Profile) -> str | None:
    share = p.share("data_wait_s")
    return f"the data wait is {pct(share)} of the step" if share > DATA_SHARE else None


def _imbalance(p: Profile) -> str | None:
    if p.slowest_over_fastest <= IMBALANCE:
        return None
    return (
        f"rank {p.slowest_rank}'s busy time is {p.slowest_over_fastest:.2f}x rank {p.fastest_rank}'s "
        "(step minus exposed communication)"
    )


def _bubble(p: Profile) -> str | None:
    if not p.pipeline:
        return None
    if p.mean("pipeline_idle_s") is None:  # a profile from before the stages' own work was timed
        return (
            f"the step runs a pipeline schedule ({pct(p.share('pipeline_s'))} of it), whose bubble is idle "
            "time (not measured in this profile)"
        )
    share = p.share("pipeline_idle_s")
    if share <= BUBBLE_SHARE:
        return None
    return (
        f"the pipeline stages are idle {pct(share)} of the step (the bubble, the waits for their neighbours)"
    )


def _host(p: Profile) -> str | None:
    if not p.ranks or any(r.peak_kind != DEVICE_PEAK for r in p.ranks):  # a CPU runs its kernels itself
        return None
    share = p.share("host_s")
    if share <= HOST_SHARE:
        return None
    return f"the host spends {pct(share)} of the step in lightning-zero's code (its waits apart)"


def _memory(p: Profile) -> str | None:
    worst = None
    for rank in p.ranks:
        peak, held = rank.memory.get("peak_bytes", 0), rank.engine_bytes()
        if rank.peak_kind == DEVICE_PEAK and held > 0 and peak > MEMORY_FACTOR * held:
            worst = max(worst or 0.0, peak / held)
    return None if worst is None else f"the device's peak memory is {worst:.1f}x what the engine holds"


@dataclass(frozen=True)
class Rule:
    """One row of the table: its name, when it fires, what to look at; ``finding`` says, with the
    profile's figures, why it fired (None: it does not)."""

    name: str
    when: str
    look: str
    finding: Callable[[Profile], str | None]


RULES = (
    Rule(
        "exposed communication",
        f"`comm_exposed_s` > {COMM_SHARE:.0%} of `step_s`",
        "larger buckets (`bucket_cap_mb`, `first_bucket_cap_mb`), `overlap_comm=True`, `shard_group_size` "
        "(reduce-scatters inside a node), a narrower `reduce_dtype`; at stage 3, when the gather wait "
        "is most of it, `prefetch_units`",
        _comm,
    ),
    Rule(
        "data wait",
        f"`data_wait_s` > {DATA_SHARE:.0%} of `step_s`",
        "the data loader: more `num_workers`, `pin_memory=True`, tokens prepared ahead "
        "(`python -m recipes.prepare`)",
        _data,
    ),
    Rule(
        "unbalanced ranks",
        f"`slowest_over_fastest` > {IMBALANCE}",
        "the slowest rank's node, device or data (its batches' lengths); shards are balanced to within "
        "one element per bucket, so they are not the cause",
        _imbalance,
    ),
    Rule(
        "pipeline bubble",
        f"`pipeline` is true and `pipeline_idle_s` > {BUBBLE_SHARE:.0%} of `step_s` (any share in a "
        "profile without `pipeline_idle_s`)",
        "the bubble, (P-1)/(M+P-1) of the step (`lightning-zero estimate --pipeline-parallel P "
        '--microbatches M`): more `pipeline_microbatches`, `pipeline_schedule="interleaved_1f1b"`',
        _bubble,
    ),
    Rule(
        "host-bound",
        f"`host_s` > {HOST_SHARE:.0%} of `step_s` on CUDA (`peak_kind` {DEVICE_PEAK} on every rank)",
        "the device waits for the host's launches: fewer, larger buckets (`bucket_cap_mb`), at stage 3 "
        "fewer, larger units (`min_unit_numel`), a larger micro-batch (more work per launch), "
        "`torch.compile` for the model's own launches",
        _host,
    ),
    Rule(
        "activations",
        f"`peak_bytes` ({DEVICE_PEAK}) > {MEMORY_FACTOR:g}x the engine's bytes on some rank",
        "activations: activation checkpointing, a smaller micro-batch (and more "
        "`accumulate_grad_batches`), a shorter sequence",
        _memory,
    ),
    Rule("compute-bound", "none of the above", "nothing stands out", lambda p: "compute-bound"),
)
"""Checked in order; the last always fires."""


def first_rule(profile: Profile) -> tuple[Rule, str]:
    """The first rule of :data:`RULES` that fires on ``profile``, and its finding."""
    for rule in RULES:
        finding = rule.finding(profile)
        if finding is not None:
            return rule, finding
    raise AssertionError("the last rule always fires")


def summary(profile: Profile) -> list[str]:
    """Three lines: the step, where it goes, the one thing to look at first."""
    step = profile.mean("step_s") or 0.0
    first, last = profile.steps
    line1 = f"step {step:.4g} s (mean of {len(profile.ranks)} ranks, steps {first}-{last})"
    t = profile.throughput or {}
    if t.get("tokens_per_s") is not None:
        line1 += f"; {t['tokens_per_s']:,.0f} tokens/s"
        line1 += f", MFU {pct(t['mfu'])}" if t.get("mfu") is not None else ", MFU not measured"
    else:
        line1 += "; tokens/s and MFU not measured"
    shares = sorted(((profile.share(p), p) for p in PARTS), reverse=True)
    parts = ", ".join(f"{label(name)} {pct(s)}" for s, name in shares[:3] if s > 0)
    line2 = (
        f"where it goes: {parts}; exposed communication {pct(profile.share('comm_exposed_s'))} (within those)"
    )
    rule, finding = first_rule(profile)
    return [line1, line2, f"look at first: {finding}: {rule.look}"]
