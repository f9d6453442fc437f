"""Runs a benchmark and keeps its raw output with where it came from.

    python benchmarks/record.py --out docs/results/2026-12-03 --name step_time -- \\
        python benchmarks/step_time.py --rounds 2

The command runs as given (its output is shown as it comes). ``NAME.txt`` in ``--out`` gets a
header (date, commit, machine, library versions, the command, the load average), the command's
whole output (stdout and stderr, interleaved as printed), and a footer (exit status, wall time, the
load average at the end); ``NAME.json`` gets the same facts as fields (the output stays in the
text). The header's first line is the provenance line ``docs/performance.md`` quotes for the
report. Existing files are never overwritten (``--force`` replaces them); the exit status is the
command's (128 + N for a command killed by signal N).

A benchmark's figures are only as good as the conditions they were measured under: the load
average is recorded because this project's machines are shared, and a commit with changes that can
change a figure (uncommitted or new files anywhere outside ``docs/``) is marked ``+dirty``. The
commit is this checkout's: run the benchmarks of the checkout that holds this script.

While the command runs, its output goes to ``NAME.txt.partial`` as well, so a run that is killed
keeps what it printed; a file of the same name that appears during the run (the benchmark's own
``--json``, say) is not replaced: the output then stays in the ``.partial`` file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "lightning", "deepspeed")


def machine() -> str:
    """CPU model, cores and memory of this machine (Linux; the CPU architecture elsewhere)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        meminfo = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()}, {os.cpu_count()} cores"
    cpu = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line), platform.machine()
    )
    memory = next((int(line.split()[1]) for line in meminfo if line.startswith("MemTotal")), 0)
    return f"{cpu}, {os.cpu_count()} cores, {memory / 2**20:.0f} GiB"


def commit() -> str:
    """The checkout's short commit, ``+dirty`` if files outside ``docs/`` differ from it or are new
    (untracked, not ignored); ``unknown`` outside git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--", ".", ":!docs"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if changed else "")


def versions() -> dict[str, str]:
    """Installed versions of the libraries the figures depend on (absent ones left out)."""
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def provenance(command: list[str]) -> dict[str, Any]:
    """Where a measurement comes from: date (UTC), commit, machine, versions, command, load."""
    return {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit(),
        "machine": machine(),
        "versions": versions(),
        "command": shlex.join(command),
        "load_average_start": list(os.getloadavg()),
    }


def provenance_line(facts: dict[str, Any]) -> str:
    """The one-line form ``docs/performance.md`` quotes above a report's table."""
    libs = ", ".join(f"{k} {v}" for k, v in facts["versions"].items())
    return (
        f"Measured {facts['date']} at {facts['commit']} on {facts['machine']}; {libs}: `{facts['command']}`"
    )


def loads(averages: list[float]) -> str:
    """The 1, 5 and 15-minute load averages as printed."""
    return " ".join(f"{x:.2f}" for x in averages)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for NAME.txt and NAME.json")
    parser.add_argument("--name", required=True, help="file name stem, e.g. step_time_small")
    parser.add_argument("--force", action="store_true", help="replace existing NAME.txt / NAME.json")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the benchmark's command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: give it after --, e.g. -- python benchmarks/step_time.py")
    if "/" in args.name or not args.name.strip("."):
        parser.error(f"--name {args.name!r} must be a plain file name stem (no '/'), e.g. step_time_small")
    text, raw = args.out / f"{args.name}.txt", args.out / f"{args.name}.json"
    partial = args.out / f"{args.name}.txt.partial"  # the output so far, kept if this run is killed
    existing = [str(p) for p in (text, raw, partial) if p.exists()]
    if existing and not args.force:
        parser.error(f"{', '.join(existing)} already exist: choose another --name, or --force to replace")
    args.out.mkdir(parents=True, exist_ok=True)
    facts = provenance(command)
    header = [
        provenance_line(facts),
        f"started {facts['started_utc']}, load average " + loads(facts["load_average_start"]),
        "",
    ]
    began = time.perf_counter()
    print("\n".join(header), flush=True)
    with (
        partial.open("w") as kept,
        subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
        ) as child,
    ):
        assert child.stdout is not None
        kept.write("\n".join(header) + "\n")
        for line in child.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            kept.write(line)
            kept.flush()
    status = child.returncode if child.returncode >= 0 else 128 - child.returncode  # a signal: 128+N
    facts["exit_status"] = status
    facts["wall_s"] = round(time.perf_counter() - began, 1)
    facts["load_average_end"] = list(os.getloadavg())
    footer = f"exit status {status}, {facts['wall_s']} s, load average at the end " + loads(
        facts["load_average_end"]
    )
    print(footer)
    with partial.open("a") as kept:
        kept.write("\n" + footer + "\n")
    clash = [str(p) for p in (text, raw) if p.exists()] if not args.force else []
    if clash:  # e.g. the benchmark itself wrote NAME.json: keep both, name where ours went
        print(f"not replacing {', '.join(clash)} (written during the run): the output stays in {partial}")
        return status or 1
    raw.write_text(json.dumps(facts, indent=1) + "\n")
    partial.replace(text)
    print(f"recorded: {text}, {raw}")
    return status


if __name__ == "__main__":
    sys.exit(main())
