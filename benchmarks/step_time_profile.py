"""The step profiler's figures against ``benchmarks/step_time.py``'s own, in the same launches
(``step_time.py --profile``).

Two clocks run in each ``zero*`` launch over the same steps. step_time.py's LightningModule times a
step from its batch start to the next batch start and reads the seconds blocked on collectives over
that interval; its "exposed" is those seconds over the step's collectives timed alone after training.
``ZeroStrategy(profile_steps=...)`` times a step from the previous batch's end to its own batch's end,
split into parts, and reads ``comm_exposed_s`` from its batch start to its batch end. Pooled over every
rank, round and timed step, as medians like step_time.py's, per row:

  * ``profile/bench``: the profiler's ``step_s`` over the benchmark's step (the "measured step");
    ``paired``: the largest ``|ratio - 1|`` of one step against the same step, rank and round;
  * ``named/step``: the five timed parts (data wait, forward, backward, pipeline, optimizer) over
    ``step_s``; ``other_s`` is the rest, so all six add up to ``step_s`` by construction
    (``six - step``: the largest difference, rounding only);
  * ``six/bench``: all six parts over the benchmark's step;
  * exposed: ``comm_exposed_s`` over the collectives timed alone, step_time.py's own computation,
    against step_time.py's figure, and both as shares of the step (``comm_exposed_s / step_s``, the
    wait over the benchmark's step), with the points apart.
"""

from __future__ import annotations

import statistics
from typing import Any

import lightning as L
from step_time_report import WARMUP_STEPS  # this folder

from lightning_zero.integrations.trainer.step_profile import StepProfiler

NAMED = ("data_wait_s", "forward_s", "backward_s", "pipeline_s", "optimizer_s")
SIX = (*NAMED, "other_s")


def profile_figures(trainer: L.Trainer) -> dict[str, Any] | None:
    """This rank's steps of the step profile of the fit just run (every rank holds every rank's), or
    None without a profiler."""
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning
    profiler = next((cb for cb in callbacks if isinstance(cb, StepProfiler)), None)
    if profiler is None or profiler.report is None:
        return None
    mine = next(r for r in profiler.report["ranks"] if r["rank"] == trainer.global_rank)
    return {"window": profiler.report["steps"], "steps": mine["steps"]}


def _pairs(ranks: list[dict[str, Any]]) -> list[tuple[float, float, dict[str, Any]]]:
    """(benchmark step, its wait, the profiler's same step) for every timed step of every rank and round."""
    out = []
    for figures in ranks:
        by_step = {s["step"]: s for s in figures["profile"]["steps"]}
        for i, (step_s, wait_s) in enumerate(zip(figures["step_s"], figures["wait_s"], strict=True)):
            out.append((step_s, wait_s, by_step[WARMUP_STEPS + i]))
    return out


def row_agreement(ranks: list[dict[str, Any]]) -> dict[str, float]:
    """The figures of the module docstring for one row (every rank's figures of every round)."""
    pairs = _pairs(ranks)
    bench = statistics.median(b for b, _, _ in pairs)
    wait = statistics.median(w for _, w, _ in pairs)
    prof = statistics.median(p["step_s"] for _, _, p in pairs)
    exposed = statistics.median(p["comm_exposed_s"] for _, _, p in pairs)
    named = statistics.median(sum(p[k] for k in NAMED) / p["step_s"] for _, _, p in pairs)
    six = statistics.median(sum(p[k] for k in SIX) for _, _, p in pairs)
    alone = statistics.median(r["alone_s"] for r in ranks)
    return {
        "steps_pooled": len(pairs),
        "bench_step_s": bench,
        "profile_step_s": prof,
        "profile_over_bench": prof / bench,
        "paired_max_dev": max(abs(p["step_s"] / b - 1) for b, _, p in pairs),
        "named_over_step": named,
        "six_minus_step_max_s": max(abs(sum(p[k] for k in SIX) - p["step_s"]) for _, _, p in pairs),
        "six_over_bench": six / bench,
        "bench_exposed": wait / alone,
        "profile_exposed": exposed / alone,
        "exposed_points_apart": 100 * (exposed - wait) / alone,
        "bench_wait_share": wait / bench,
        "profile_wait_share": exposed / prof,
        "share_points_apart": 100 * (exposed / prof - wait / bench),
    }


def agreement(rows: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Prints the table for the rows with a step profile (and a timing alone); returns its figures."""
    out = {name: row_agreement(r) for name, r in rows.items() if r[0].get("profile") and r[0]["alone_s"]}
    if not out:
        return out
    print(
        f"\nstep profile against this script's figures (steps {WARMUP_STEPS}.. of every rank and round, "
        "medians)\n"
    )
    header = (
        f"{'strategy':<16}{'steps':>6}{'bench s':>9}{'profile s':>10}{'prof/bench':>11}{'paired':>8}"
        f"{'named/step':>11}{'six-step':>10}{'six/bench':>10}{'exposed b/p':>13}{'pts':>7}"
        f"{'of step b/p':>13}{'pts':>7}"
    )
    print(header)
    print("-" * len(header))
    for name, a in out.items():
        print(
            f"{name:<16}{a['steps_pooled']:>6}{a['bench_step_s']:>9.3f}{a['profile_step_s']:>10.3f}"
            f"{a['profile_over_bench']:>11.3f}{a['paired_max_dev']:>8.1%}{a['named_over_step']:>11.1%}"
            f"{a['six_minus_step_max_s']:>10.1e}{a['six_over_bench']:>10.3f}"
            f"{a['bench_exposed']:>7.0%}/{a['profile_exposed']:<5.0%}{a['exposed_points_apart']:>+7.1f}"
            f"{a['bench_wait_share']:>7.0%}/{a['profile_wait_share']:<5.0%}{a['share_points_apart']:>+7.1f}"
        )
    print(
        "'paired': largest |profile/bench - 1| of one step; 'named': the five timed parts, without "
        "other_s; 'six-step': largest |sum of the six parts - step_s| in s; 'exposed b/p': wait over "
        "the collectives timed alone, benchmark / profile; 'of step': the wait's share of the step"
    )
    return out
