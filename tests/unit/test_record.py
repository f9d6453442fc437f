"""``benchmarks/record.py``: a benchmark's raw output kept with its provenance, nothing overwritten."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORD = [sys.executable, str(ROOT / "benchmarks" / "record.py")]


def _record(out: Path, name: str, *command: str, force: bool = False) -> subprocess.CompletedProcess[str]:
    args = [*RECORD, "--out", str(out), "--name", name, *(["--force"] if force else []), "--", *command]
    return subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_the_output_is_kept_with_its_provenance_and_the_exit_status(tmp_path: Path) -> None:
    done = _record(tmp_path, "r", sys.executable, "-c", "print('figure 1.23'); raise SystemExit(3)")
    assert done.returncode == 3
    lines = (tmp_path / "r.txt").read_text().splitlines()
    facts = json.loads((tmp_path / "r.json").read_text())
    assert lines[0].startswith(
        f"Measured {facts['date']} at {facts['commit']} on {facts['machine']}; python "
    )
    assert "torch " in lines[0] and lines[0].endswith("`")
    assert "figure 1.23" in lines and lines[-1].startswith("exit status 3, ")
    assert facts["exit_status"] == 3 and facts["command"].startswith(sys.executable)
    assert not (tmp_path / "r.txt.partial").exists()


def test_existing_results_are_never_replaced(tmp_path: Path) -> None:
    (tmp_path / "r.json").write_text("mine")
    refused = _record(tmp_path, "r", sys.executable, "-c", "print(1)")
    assert refused.returncode == 2 and "already exist" in refused.stderr
    assert (tmp_path / "r.json").read_text() == "mine" and not (tmp_path / "r.txt").exists()
    # a file of the same name written by the benchmark during the run is not replaced either
    writes = f"open({str(tmp_path / 's.json')!r}, 'w').write('the benchmark'); print('done')"
    clash = _record(tmp_path, "s", sys.executable, "-c", writes)
    assert clash.returncode == 1 and "not replacing" in clash.stdout
    assert (tmp_path / "s.json").read_text() == "the benchmark"
    assert "done" in (tmp_path / "s.txt.partial").read_text().splitlines()
    assert _record(tmp_path, "r", sys.executable, "-c", "print(2)", force=True).returncode == 0
    assert json.loads((tmp_path / "r.json").read_text())["exit_status"] == 0


def test_a_command_killed_by_a_signal_keeps_its_output(tmp_path: Path) -> None:
    kill = "import os, signal; print('before', flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    done = _record(tmp_path, "k", sys.executable, "-c", kill)
    assert done.returncode == 128 + 9
    assert "before" in (tmp_path / "k.txt").read_text().splitlines()
