"""The table and notes ``benchmarks/step_time.py`` prints from its launches' figures (one JSON file
per row, round and rank), and where those files are."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

WARMUP_STEPS = 3
"""Steps left out of the step time (at least one step is kept)."""


def figures_path(args: argparse.Namespace, name: str, round_: int, rank: int) -> Path:
    return Path(args.out, f"{args.model}.{name}.round{round_}.rank{rank}.json")


def state_stage(name: str) -> int:
    """What the row ``name`` shards at its peak, as a ZeRO stage: 0 (nothing), 1 (optimizer state),
    2 (and gradients; also the rows that keep parameters gathered from forward to backward), 3."""
    if name == "ddp+ZeroRedundancyOptimizer" or name == "zero1":
        return 1
    if name.startswith(("zero3", "fsdp2", "fsdp-full", "deepspeed3")) and not name.endswith("keep"):
        return 3
    return 0 if name.startswith("ddp") else 2


def states_mb(params: int, n: int, stage: int) -> float:
    """Model states per rank (fp32 parameters, gradients, Adam's two moments) by the ZeRO paper's count."""
    sharded = {0: 0, 1: 8, 2: 12, 3: 16}[stage]  # bytes per parameter cut to 1/N
    return ((16 - sharded) * params + sharded * params / n) / 2**20


def load_rows(args: argparse.Namespace, not_run: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    """Every rank's figures of every round, by row; a row with a missing file goes to ``not_run``."""
    rows = {}
    for name in args.strategies.split(","):
        paths = [figures_path(args, name, k, r) for k in range(args.rounds) for r in range(args.devices)]
        missing = [p for p in paths if not p.exists()]
        if name not in not_run and missing:
            not_run[name] = f"no figures in {missing[0]}"
        if name not in not_run:
            rows[name] = [json.loads(p.read_text()) for p in paths]
    return rows


def report(args: argparse.Namespace, not_run: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    """Prints the model's table; returns every rank's raw figures of every round, by row."""
    rows = load_rows(args, not_run)
    if not rows:
        print(f"\nGPT {args.model}: no row ran")
        for name, reason in not_run.items():
            print(f"{name:<30}not run: {reason}")
        return rows
    params = next(iter(rows.values()))[0]["params"]
    n = args.devices
    ddp = rows.get("ddp")
    ref = {
        "step_s": statistics.median(s for r in ddp for s in r["step_s"]) if ddp else None,
        "rss": max(r["peak_rss_mb"] for r in ddp) if ddp else None,
        "heap": max(r["peak_heap_mb"] or 0.0 for r in ddp) if ddp else None,
        "theory_mb": (8 * params * (n - 1) / n + 4 * params * (n - 1) / n + 4 * params) / 2**20,
    }
    print(
        f"\nGPT {args.model}, {params / 1e6:.1f}M params, {n} ranks x 1 thread, gloo, fp32, batch "
        f"{args.batch}x{args.seq} per rank, {args.steps} steps x {args.rounds} rounds, strategies "
        f"interleaved (median of steps {WARMUP_STEPS + 1}..)"
        + (f", MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}" if args.mmap_threshold is not None else "")
        + "\n"
    )
    header = (
        f"{'strategy':<30}{'step s':>8}{'vs ddp':>8}{'exposed':>9}{'opt state MB':>14}{'grads MB':>10}"
        f"{'sent/step':>12}{'vs min':>8}{'vs 3Ψ':>8}{'start RSS':>10}{'peak RSS MB':>13}{'states MB':>11}"
        f"{'RSS-states':>12}{'saved/theory':>14}{'peak heap MB':>14}{'saved/theory':>14}"
    )
    print(header)
    print("-" * len(header))
    for name in args.strategies.split(","):
        if name in not_run:
            print(f"{name:<30}not run: {not_run[name]}")
        else:
            print(row_line(name, rows[name], ref, params, n))
    notes(rows, ref, params, n)
    return rows


def row_line(name: str, ranks: list[dict[str, Any]], ref: dict[str, Any], params: int, n: int) -> str:
    """One row of the table; "n/c": not counted for this row, blank: no ddp row to compare with."""
    med = statistics.median(s for r in ranks for s in r["step_s"])
    r0 = ranks[0]
    rss = max(r["peak_rss_mb"] for r in ranks)
    exposed = "n/a"
    if r0.get("alone_s"):
        waits = statistics.median(w for r in ranks for w in r["wait_s"])
        alone = statistics.median(r["alone_s"] for r in ranks)
        exposed = f"{waits / alone:.0%}"
    vs_ddp = f"{med / ref['step_s']:.2f}" if ref["step_s"] else ""
    heap = max(r["peak_heap_mb"] or 0.0 for r in ranks)
    saved = heap_saved = ""
    if ref["rss"] is not None and not name.startswith("ddp"):
        saved = f"{(ref['rss'] - rss) / ref['theory_mb']:.0%}"
        heap_saved = f"{(ref['heap'] - heap) / ref['theory_mb']:.0%}" if heap else ""
    grads = "n/c" if r0["grad_bytes"] is None else f"{r0['grad_bytes'] / 2**20:.1f}"
    sent, ring = r0["elements_sent"], params * (n - 1) / n
    states = states_mb(params, n, state_stage(name))
    return (
        f"{name:<30}{med:>8.3f}{vs_ddp:>8}{exposed:>9}{r0['opt_state_bytes'] / 2**20:>14.1f}{grads:>10}"
        f"{sent / 1e6:>11.2f}M{sent / (2 * ring):>8.2f}{sent / (3 * ring):>8.2f}"
        f"{max(r['setup_rss_mb'] for r in ranks):>10.0f}{rss:>13.0f}{states:>11.0f}{rss - states:>12.0f}"
        f"{saved:>14}{heap or float('nan'):>14.0f}{heap_saved:>14}"
    )


def hybrid(rows: dict[str, list[dict[str, Any]]], params: int) -> None:
    """The traffic of the hybrid rows inside and across groups; what it means on a cluster is
    ``docs/clusters.md``'s table (``scripts/memory_chart.py``: one model size, one computation)."""
    names = [name for name in rows if name.endswith("2x2")]
    for name in names:
        sent, formula = rows[name][0]["inter_elements"]
        inside = rows[name][0]["elements_sent"]
        print(
            f"{name}: inside each group of 2: {inside / 1e6:.2f}M elements per step (1.00x is "
            f"{rows[name][0]['min_elements'] / 1e6:.2f}M); across the 2 groups: {sent / 1e6:.2f}M = "
            f"{sent / formula:.2f}x 2(Ψ/G)(R−1)/R = {formula / 1e6:.2f}M (Ψ = {params / 1e6:.1f}M)"
        )
    if names:
        print(
            "loopback on one machine cannot show bandwidth; the bytes leaving each node of a cluster "
            "per step: docs/clusters.md#node-aware-sharding (python scripts/memory_chart.py)"
        )


def wires(rows: dict[str, list[dict[str, Any]]]) -> None:
    """The rows with another wire dtype against the same stage's fp32 row: bytes sent per step (all
    of a rank's collectives, counted at the calls) and step time."""
    for name, ranks in rows.items():
        base = name.rsplit("-", 1)[0]
        if not name.endswith(("-bf16", "-int8")) or base not in rows:
            continue
        sent, fp32 = ranks[0]["bytes_sent"], rows[base][0]["bytes_sent"]
        step = statistics.median(s for r in ranks for s in r["step_s"])
        step_fp32 = statistics.median(s for r in rows[base] for s in r["step_s"])
        print(
            f"{name}: {sent / 1e6:.2f} MB sent per step per rank = {sent / fp32:.3f}x {base}'s "
            f"{fp32 / 1e6:.2f} MB; step time {step / step_fp32:.2f}x {base}'s"
        )


def notes(rows: dict[str, list[dict[str, Any]]], ref: dict[str, Any], params: int, n: int) -> None:
    print(f"\nminimum elements sent per rank and step: 2Ψ(N−1)/N = {2 * params * (n - 1) // n / 1e6:.2f}M")
    for name, ranks in rows.items():
        if name.startswith("zero3"):
            own = ranks[0]["min_elements"]
            print(
                f"{name}: its schedule's elements per step, (2Ψ + every unit but the root and the last "
                f"gathered again in backward)(N−1)/N = {own / 1e6:.2f}M; "
                f"sent {ranks[0]['elements_sent'] / own:.2f}x that"
            )
    hybrid(rows, params)
    wires(rows)
    if "zero2" in rows:
        zero2_rss = max(r["peak_rss_mb"] for r in rows["zero2"])
        param_mb = 4 * params * (n - 1) / n / 2**20
        for name, ranks in rows.items():
            if name.startswith(("zero3", "fsdp", "deepspeed3")):
                rss = max(r["peak_rss_mb"] for r in ranks)
                print(
                    f"{name}: peak RSS {zero2_rss - rss:+.0f} MB below zero2's, "
                    f"{(zero2_rss - rss) / param_mb:.0%} of the parameter saving 4Ψ(N−1)/N "
                    f"= {param_mb:.0f} MB"
                )
    print(
        f"theoretical RSS saving against ddp: Adam state and gradients to 1/N, no DDP bucket copy = "
        f"{ref['theory_mb']:.0f} MB; 'exposed' = time blocked on collectives per step / their time alone;"
        f" 'states' = fp32 parameters, gradients and Adam moments per rank by the ZeRO paper's count for"
        f" what the row shards at its peak (16Ψ ddp, 8Ψ+8Ψ/N stage 1, 4Ψ+12Ψ/N stage 2 and rows keeping"
        f" parameters gathered through backward, 16Ψ/N stage 3); 'vs 3Ψ' = sent / 3Ψ(N−1)/N (stage 3's"
        f" schedule); 'peak heap' = bytes allocated and not yet freed (glibc mallinfo2), without what"
        f" glibc keeps (DeepSpeed's counts its 2e8-element buckets, allocated whole but only touched"
        f" as far as used); 'n/c' = not counted (DeepSpeed's gradients live in its own buffers)"
    )
