"""The largest GPT (layers at a fixed width) that trains a few steps with 2 ranks, per strategy.

    python benchmarks/largest_model.py [--strategies ddp,zero2,zero3,fsdp2] [--dim 768] [--budget-gib 12]

Each probe is one launch of ``benchmarks/step_time.py``'s training (its model, strategies and
launch: ``--only NAME --layers L``, CPU/gloo, one thread per rank, fp32 AdamW) for ``--steps`` steps.
Per strategy the layer count doubles from ``--start-layers`` until a probe does not fit, then
bisects between the largest that fitted and the smallest that did not (so it assumes that fewer
layers fit whenever more do).

The machine is shared, so the budget is enforced here rather than by the kernel: a watchdog in this
process sums the RSS of the launch's process tree (every rank; psutil if installed, else
``/proc/<pid>/status`` VmRSS) every ``--poll-s`` and kills the whole launch when the sum exceeds
``--budget-gib``: that probe "does not fit". So does one killed by SIGKILL from elsewhere (the
kernel's OOM killer). Any other failure, or a probe past ``--probe-timeout-s``, ends that
strategy's search with its reason. The sum counts what the ranks share (the torch and Lightning
libraries, about 0.4 GB a rank) once per rank.

Printed: each probe as it ends (layers, parameters, fits or why not, the watchdog's peak, seconds),
then the table: strategy, largest layers, parameters, peak RSS per rank at that size (the ranks'
own ru_maxrss, the largest of them) and the ratio of parameters to ddp's largest.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import step_time  # this folder is on sys.path when run as a script
import torch

STRATEGIES = ("ddp", "zero2", "zero3", "fsdp2")
BASE_MODEL = "gpt2"
"""step_time's model whose shape ``--layers``, ``--dim`` and ``--vocab`` replace (all three given)."""


@dataclass(frozen=True, kw_only=True)
class Probe:
    layers: int
    params: int
    fits: bool
    reason: str
    """Either "ok", or why it does not fit or failed."""
    peak_tree_gib: float
    """The largest RSS sum over the launch's processes the watchdog saw."""
    seconds: float
    peak_rank_mb: float | None = None
    """The largest rank's ru_maxrss, where the ranks wrote their figures."""
    step_s: float | None = None
    error: bool = False
    """Failed for a reason other than memory: the search for this strategy stops."""


def tree_rss_bytes(pid: int) -> int:
    """RSS of ``pid`` and all its descendants, 0 once it is gone."""
    try:
        import psutil
    except ImportError:
        return _proc_tree_rss_bytes(pid)
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def _proc_tree_rss_bytes(pid: int) -> int:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # after "(comm)": state, ppid
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo.extend(children.get(current, []))
        try:
            status = Path(f"/proc/{current}/status").read_text()
        except OSError:
            continue
        total += sum(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
    return total


def count_params(layers: int, args: argparse.Namespace) -> int:
    with torch.device("meta"):
        model = step_time.GPT(args.vocab, args.dim, layers, args.seq, zero_redundancy=False)
    return sum(p.numel() for p in model.parameters())


def run_probe(name: str, layers: int, args: argparse.Namespace) -> Probe:
    """One launch of ``name`` at ``layers`` layers under the watchdog."""
    out = Path(args.out, f"{name}.layers{layers}")
    out.mkdir(parents=True, exist_ok=True)
    figures = argparse.Namespace(out=str(out), model=BASE_MODEL)
    for rank in range(args.devices):
        step_time.figures_path(figures, name, 0, rank).unlink(missing_ok=True)
    cmd = [sys.executable, step_time.__file__, "--only", name, "--model", BASE_MODEL, "--out", str(out)]
    for flag in ("layers", "dim", "vocab", "seq", "batch", "steps", "devices"):
        cmd += [f"--{flag}", str(layers if flag == "layers" else getattr(args, flag))]
    start = time.perf_counter()
    returncode, killed, peak = watch(cmd, out / "stderr.log", args)
    base = Probe(
        layers=layers,
        params=count_params(layers, args),
        fits=False,
        reason="",
        peak_tree_gib=peak / 2**30,
        seconds=time.perf_counter() - start,
    )
    if killed:  # by the watchdog: only a timeout is an error
        return replace(base, reason=killed, error=killed.startswith("timed out"))
    if returncode == -signal.SIGKILL:
        return replace(base, reason="killed by SIGKILL from elsewhere (the OOM killer?)")
    if returncode:
        reason = step_time.failure_reason(returncode, (out / "stderr.log").read_text(errors="replace"))
        return replace(base, reason=reason, error=True)
    ranks = [json.loads(step_time.figures_path(figures, name, 0, r).read_text()) for r in range(args.devices)]
    return replace(
        base,
        fits=True,
        reason="ok",
        peak_rank_mb=max(r["peak_rss_mb"] for r in ranks),
        step_s=statistics.median(s for r in ranks for s in r["step_s"]),
    )


def watch(cmd: list[str], stderr_path: Path, args: argparse.Namespace) -> tuple[int, str, int]:
    """Runs ``cmd`` in a process group of its own, killing the group past the budget or the timeout.

    Returns:
        (its return code, why the watchdog killed it or "", the largest RSS sum seen in bytes)
    """
    budget, peak, killed = args.budget_gib * 2**30, 0, ""
    start = time.perf_counter()
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(
            cmd, env=step_time.child_env(), stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True
        )
        try:
            while proc.poll() is None and not killed:
                rss = tree_rss_bytes(proc.pid)
                peak = max(peak, rss)
                if rss > budget:
                    killed = f"over budget: {rss / 2**30:.2f} GiB > {args.budget_gib} GiB"
                elif time.perf_counter() - start > args.probe_timeout_s:
                    killed = f"timed out after {args.probe_timeout_s} s"
                else:
                    time.sleep(args.poll_s)
        finally:
            try:  # every rank, and whatever a rank left behind: Lightning starts them in this group
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return proc.returncode, killed, peak


def search(name: str, args: argparse.Namespace) -> tuple[Probe | None, str]:
    """The largest fitting probe of ``name`` (None if even 1 layer does not fit), and how the search
    ended."""
    best: Probe | None = None
    too_many: int | None = None
    layers = args.start_layers
    while too_many is None or too_many - (best.layers if best else 0) > 1:
        if too_many is not None:
            layers = ((best.layers if best else 0) + too_many) // 2
        if layers < 1:
            break
        probe = run_probe(name, layers, args)
        print_probe(name, probe)
        if probe.error:
            return best, f"stopped: {probe.reason}"
        if probe.fits:
            best = probe
            if too_many is None:
                if layers * 2 > args.max_layers:
                    return best, f"--max-layers {args.max_layers} reached"
                layers *= 2
        else:
            too_many = layers
    return best, "ok" if best else "even 1 layer does not fit"


def print_probe(name: str, probe: Probe) -> None:
    rank = f", peak RSS per rank {probe.peak_rank_mb:.0f} MB" if probe.peak_rank_mb else ""
    step = f", step {probe.step_s:.2f} s" if probe.step_s else ""
    print(
        f"  {name}: {probe.layers} layers, {probe.params / 1e6:.1f}M params: "
        f"{'fits' if probe.fits else probe.reason} (watchdog peak {probe.peak_tree_gib:.2f} GiB{rank}{step}, "
        f"{probe.seconds:.0f} s)",
        flush=True,
    )


def report(results: dict[str, tuple[Probe | None, str]], args: argparse.Namespace) -> None:
    print(
        f"\nLargest GPT that trains {args.steps} steps: width {args.dim}, vocab {args.vocab}, "
        f"{args.devices} ranks x 1 thread, gloo, fp32 AdamW, batch {args.batch}x{args.seq} per rank, "
        f"budget {args.budget_gib} GiB summed over the ranks\n"
    )
    header = f"{'strategy':<12}{'layers':>8}{'params':>12}{'peak RSS/rank MB':>18}{'vs ddp':>8}  search"
    print(header)
    print("-" * len(header))
    ddp = results.get("ddp", (None, ""))[0]
    for name, (best, how) in results.items():
        if best is None:
            print(f"{name:<12}{'-':>8}{'-':>12}{'-':>18}{'-':>8}  {how}")
            continue
        ratio = f"{best.params / ddp.params:.2f}" if ddp else ""
        print(
            f"{name:<12}{best.layers:>8}{best.params / 1e6:>11.1f}M{best.peak_rank_mb or float('nan'):>18.0f}"
            f"{ratio:>8}  {how}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1, help="per rank")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--budget-gib", type=float, default=12.0, help="RSS summed over the ranks")
    parser.add_argument("--start-layers", type=int, default=4)
    parser.add_argument("--max-layers", type=int, default=512)
    parser.add_argument("--poll-s", type=float, default=0.1)
    parser.add_argument("--probe-timeout-s", type=float, default=1800.0)
    parser.add_argument("--out", default="benchmarks/results/largest_model")
    args = parser.parse_args()
    names = args.strategies.split(",")
    unknown = [n for n in names if n not in step_time.STRATEGIES]
    if unknown:
        parser.error(f"unknown strategies {unknown}; step_time.py has {', '.join(step_time.STRATEGIES)}")
    results = {}
    for name in names:
        print(f"{name}: searching ...", flush=True)
        reason = step_time.unavailable(name)
        results[name] = (None, f"not run: {reason}") if reason else search(name, args)
    report(results, args)


if __name__ == "__main__":
    main()
