"""Tokens/s of the default recipe (CPU demo, 2 processes) under zero, zero1 and ddp, in one run.

    python benchmarks/recipe_throughput.py [--steps 80] [--rounds 2]

Runs ``python -m recipes.pretrain`` with each strategy (interleaved over rounds, each into its own
run directory under ``benchmarks/results/``), reads the logged ``tokens_per_s`` of every step after
the first 10 from the run's metrics.csv and prints the medians side by side with the ratio to ddp.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
from pathlib import Path

STRATEGIES = ("zero", "zero1", "ddp")


def run(strategy: str, steps: int, out: Path, round_index: int) -> list[float]:
    name = f"{strategy}_r{round_index}"
    cmd = [
        sys.executable,
        "-m",
        "recipes.pretrain",
        f"strategy={strategy}",
        f"trainer.max_steps={steps}",
        f"output_root={out}",
        f"run_name={name}",
        "sample.max_new_tokens=0",
    ]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{strategy} failed:\n{proc.stderr[-3000:]}")
    metrics = sorted((out / name / "logs").glob("version_*/metrics.csv"))[-1]
    with open(metrics) as f:
        rows = [r for r in csv.DictReader(f) if r.get("tokens_per_s")]
    return [float(r["tokens_per_s"]) for r in rows if int(r["step"]) >= 10]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/recipe"))
    args = parser.parse_args()
    samples: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    for k in range(args.rounds):
        for strategy in STRATEGIES:
            print(f"round {k + 1}/{args.rounds}: {strategy} ...", flush=True)
            samples[strategy] += run(strategy, args.steps, args.out.resolve(), k)
    ddp = statistics.median(samples["ddp"])
    print(
        f"\ndefault recipe (tiny GPT, 2 CPU processes), {args.steps} steps x {args.rounds} rounds, "
        "median tokens/s of steps >= 10\n"
    )
    print(f"{'strategy':<10}{'tokens/s':>10}{'vs ddp':>8}")
    for strategy, values in samples.items():
        median = statistics.median(values)
        print(f"{strategy:<10}{median:>10.0f}{median / ddp:>8.2f}")


if __name__ == "__main__":
    main()
