"""The step profile of the CPU demo against the recipe's own clock, in one run.

    python benchmarks/recipe_profile.py [--first 3] [--last 6] [--out benchmarks/results/recipe_profile]

Runs the default recipe (``python -m recipes.pretrain``: the tiny GPT, 2 CPU processes, ``"zero"``)
with ``strategy.profile_steps=[first,last]`` and ``trainer.max_steps=last+2``, logging every step
(``trainer.log_every_n_steps=1``) with the recipe's throughput averaged over one step
(``callbacks.throughput.window=1``). The recipe's ``tokens_per_s`` at step ``k`` is then rank 0's
tokens of step ``k`` (times the data-parallel ranks) over the time between the ends of steps ``k-1``
and ``k`` on ``TokenThroughput``'s clock; the profile's ``step_s`` of step ``k`` spans the same
interval on its own (the previous batch's end to this batch's end). Printed per step of the window,
for rank 0 (whose figures the logger gets): the recipe's step (rank 0's tokens x the data-parallel
ranks / ``tokens_per_s``), the profile's ``step_s`` and their ratio, the profile's five timed parts
over ``step_s`` (``other_s`` is the rest: the six add up by construction) and ``comm_exposed_s`` over
``step_s``; then the window's sums and the profile's ``tokens_per_s`` against the recipe's.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

NAMED = ("data_wait_s", "forward_s", "backward_s", "pipeline_s", "optimizer_s")
SIX = (*NAMED, "other_s")


def run_recipe(first: int, last: int, out: Path) -> Path:
    """Runs the demo with the profile on; returns its run directory."""
    cmd = [
        sys.executable,
        "-m",
        "recipes.pretrain",
        f"strategy.profile_steps=[{first},{last}]",
        f"trainer.max_steps={last + 2}",
        "trainer.log_every_n_steps=1",
        "callbacks.throughput.window=1",
        f"output_root={out}",
        "run_name=demo",
        "sample.max_new_tokens=0",
    ]
    print(" ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONWARNINGS="ignore"), capture_output=True, text=True)
    print(proc.stdout[-2000:])
    if proc.returncode:
        sys.exit(f"the recipe failed:\n{proc.stderr[-3000:]}")
    return out / "demo"


def recipe_rates(run_dir: Path) -> dict[int, float]:
    """``tokens_per_s`` logged at each step, by step."""
    metrics = sorted(run_dir.glob("logs/version_*/metrics.csv"))[-1]
    with open(metrics) as f:
        return {int(r["step"]): float(r["tokens_per_s"]) for r in csv.DictReader(f) if r.get("tokens_per_s")}


def compare(profile: dict[str, Any], rates: dict[int, float]) -> dict[str, Any]:
    """Prints the per-step table and the window's figures; returns them."""
    rank0 = next(r for r in profile["ranks"] if r["rank"] == 0)
    dp = profile["world_size"]  # the demo: data parallel only
    rows = []
    print(
        f"{'step':>5}{'recipe s':>10}{'profile s':>11}{'prof/recipe':>12}{'named/step':>11}"
        f"{'six-step s':>12}{'exposed/step':>13}"
    )
    for s in rank0["steps"]:
        recipe_s = s["tokens"] * dp / rates[s["step"]]
        row = {
            "step": s["step"],
            "recipe_step_s": recipe_s,
            "profile_step_s": s["step_s"],
            "profile_over_recipe": s["step_s"] / recipe_s,
            "named_over_step": sum(s[k] for k in NAMED) / s["step_s"],
            "six_minus_step_s": sum(s[k] for k in SIX) - s["step_s"],
            "exposed_over_step": s["comm_exposed_s"] / s["step_s"],
        }
        rows.append(row)
        print(
            f"{row['step']:>5}{recipe_s:>10.4f}{s['step_s']:>11.4f}{row['profile_over_recipe']:>12.3f}"
            f"{row['named_over_step']:>11.1%}{row['six_minus_step_s']:>12.1e}{row['exposed_over_step']:>13.1%}"
        )
    window = {
        "recipe_s": sum(r["recipe_step_s"] for r in rows),
        "profile_s": sum(r["profile_step_s"] for r in rows),
        "named_s": sum(sum(s[k] for k in NAMED) for s in rank0["steps"]),
        "profile_tokens_per_s": profile["throughput"]["tokens_per_s"],
        "recipe_tokens_per_s": sum(s["tokens"] * dp for s in rank0["steps"])
        / sum(r["recipe_step_s"] for r in rows),
    }
    w = window
    print(
        f"window (steps {profile['steps'][0]}-{profile['steps'][1]}, rank 0): profile {w['profile_s']:.4f} s"
        f" = {w['profile_s'] / w['recipe_s']:.3f}x the recipe's {w['recipe_s']:.4f} s; the five timed "
        f"parts {w['named_s'] / w['profile_s']:.1%} of the profile's step; tokens/s: profile "
        f"{w['profile_tokens_per_s']:.0f} (slowest rank's clock), recipe {w['recipe_tokens_per_s']:.0f}"
        f" (rank 0's), {w['profile_tokens_per_s'] / w['recipe_tokens_per_s']:.3f}x"
    )
    return {"steps": rows, "window": window}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first", type=int, default=3)
    parser.add_argument("--last", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/recipe_profile"))
    parser.add_argument("--json", type=Path, help="also write the figures and the step profile here")
    args = parser.parse_args()
    if args.first < 1 or args.last < args.first:
        parser.error("need 1 <= --first <= --last (the recipe's rate at a step needs the step before)")
    run_dir = run_recipe(args.first, args.last, args.out.resolve())
    profile = json.loads(next(run_dir.rglob("step_profile.json")).read_text())
    figures = compare(profile, recipe_rates(run_dir))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**figures, "step_profile": profile}, indent=1) + "\n")
        print(f"\nraw figures: {args.json}")


if __name__ == "__main__":
    main()
