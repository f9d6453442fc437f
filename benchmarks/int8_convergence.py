"""Convergence of the int8 wire: the default recipe on each wire, validation losses side by side.

    python benchmarks/int8_convergence.py [--steps 250] [--val-every 125] [--variants fp32,int8,int8_ef]
        [--out benchmarks/results/int8] [--plot docs/images/int8_convergence.png] [--json FILE]
        [--smooth 3] [--from-json FILE]

Runs ``python -m recipes.pretrain`` (the CPU demo: tiny GPT, 2 processes, byte-level stdlib) once
per variant from the same seed and data order, so the runs differ by the wire alone, each into its
own run directory under ``--out``; reads ``val/loss`` and ``train/loss`` from the run's metrics.csv
and prints the final validation loss of each variant with its ratio to the fp32 wire's (issue 30's
target: within 1 %). ``--plot`` draws the training loss (logged every 10 steps, averaged over
``--smooth`` points) and the validation points of every variant on one figure; ``--json`` writes the
raw curves, and ``--from-json`` reprints and replots them without running anything.

Variants (recipe overrides on top of the default recipe):
  fp32          strategy=zero (stage 2; gradients on the wire in fp32, the master dtype)
  bf16          strategy.reduce_dtype=bf16
  int8          strategy.reduce_dtype=int8
  int8_ef       strategy.reduce_dtype=int8 strategy.error_feedback=true
  zero3         strategy=zero3
  zero3_int8    strategy=zero3 strategy.reduce_dtype=int8 strategy.gather_dtype=int8 (both wires)
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

VARIANTS: dict[str, list[str]] = {
    "fp32": ["strategy=zero"],
    "bf16": ["strategy=zero", "strategy.reduce_dtype=bf16"],
    "int8": ["strategy=zero", "strategy.reduce_dtype=int8"],
    "int8_ef": ["strategy=zero", "strategy.reduce_dtype=int8", "strategy.error_feedback=true"],
    "zero3": ["strategy=zero3"],
    "zero3_int8": ["strategy=zero3", "strategy.reduce_dtype=int8", "strategy.gather_dtype=int8"],
}
BASELINE = {"fp32": "fp32", "bf16": "fp32", "int8": "fp32", "int8_ef": "fp32", "zero3": "zero3"}
BASELINE["zero3_int8"] = "zero3"


def run(variant: str, steps: int, val_every: int, out: Path) -> dict[str, list[list[float]]]:
    """One recipe run; ``{"train": [[step, loss], ...], "val": [[step, loss], ...]}``."""
    name = f"{variant}_{steps}"
    cmd = [
        sys.executable,
        "-m",
        "recipes.pretrain",
        *VARIANTS[variant],
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={val_every}",
        f"output_root={out}",
        f"run_name={name}",
        "sample.max_new_tokens=0",
    ]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{variant} failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    metrics = sorted((out / name / "logs").glob("version_*/metrics.csv"))[-1]
    curves: dict[str, list[list[float]]] = {"train": [], "val": []}
    with open(metrics) as f:
        for row in csv.DictReader(f):
            for key, column in (("train", "train/loss"), ("val", "val/loss")):
                if row.get(column):
                    curves[key].append([int(row["step"]), float(row[column])])
    print(f"  {variant}: {time.perf_counter() - start:.0f} s, {len(curves['val'])} validations", flush=True)
    return curves


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` points."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(results: dict[str, dict[str, list[list[float]]]], path: Path, title: str, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for variant, curves in results.items():
        steps = [s for s, _ in curves["train"]]
        line = ax.plot(steps, smooth([v for _, v in curves["train"]], window), label=f"{variant} train", lw=1)
        vs = curves["val"]
        color = line[0].get_color()
        ax.plot([s for s, _ in vs], [v for _, v in vs], "o--", color=color, label=f"{variant} val")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(ncol=2, fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--val-every", type=int, default=125)
    parser.add_argument("--variants", default="fp32,int8,int8_ef")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/int8"))
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--from-json", type=Path, default=None, help="a --json file: no runs")
    parser.add_argument("--smooth", type=int, default=3, help="logged training losses averaged in the plot")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variant(s) {unknown}; valid: {sorted(VARIANTS)}")
    missing = sorted({BASELINE[v] for v in variants} - set(variants))
    if missing:
        sys.exit(f"variants {variants} need their baseline(s) {missing} in the same run")
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        args.steps, results = saved["steps"], {v: saved["curves"][v] for v in variants}
    else:
        results = {}
        for variant in variants:
            print(f"{variant} ({args.steps} steps) ...", flush=True)
            results[variant] = run(variant, args.steps, args.val_every, args.out.resolve())
    print(f"\ndefault recipe (tiny GPT, 2 CPU processes), {args.steps} steps, final validation loss\n")
    print(f"{'variant':<12}{'val loss':>10}{'vs base':>9}  base")
    for variant, curves in results.items():
        final = curves["val"][-1][1]
        base = results[BASELINE[variant]]["val"][-1][1]
        print(f"{variant:<12}{final:>10.4f}{final / base:>9.4f}  {BASELINE[variant]}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"steps": args.steps, "curves": results}, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot is not None:
        title = f"default recipe, 2 CPU processes, {args.steps} steps: wire dtypes"
        plot(results, args.plot, title, args.smooth)


if __name__ == "__main__":
    main()
