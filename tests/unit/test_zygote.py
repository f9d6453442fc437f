"""``tests.zygote``: a process forked from a warm interpreter behaves as ``python <command>`` would.

The launched-rank tests trust these processes to be what their command would start fresh: the same
argv, cwd, environment, ``__main__``, output, exit status (threads joined and ``atexit`` run first),
Lightning's rank as ``rank_zero_only.rank``, and one hash seed per rank. A command the zygote cannot
reproduce runs as a plain subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests import zygote
from tests.launch import launch_env, run_ranks, run_script

ENV = launch_env()  # the launched tests' environment

SCRIPT = """
import atexit, os, sys, threading, time
from lightning.fabric.utilities.rank_zero import rank_zero_only
print("argv", sys.argv[1:], "cwd", os.getcwd(), "name", __name__, "var", os.environ.get("LZ_ZYGOTE_VAR"))
print("rank", rank_zero_only.rank, "hash", hash("lightning-zero"), "parent", os.getppid())
print("to stderr", file=sys.stderr)
atexit.register(lambda: print("atexit ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.3), print("thread joined", flush=True))).start()
if sys.argv[1] == "raise":
    raise ValueError("boom")
if sys.argv[1] == "kill":
    os.kill(os.getpid(), 9)
sys.exit(int(sys.argv[1]))
"""


def _fields(stdout: str) -> dict[str, str]:
    words = stdout.split()
    return {key: words[words.index(key) + 1] for key in ("rank", "hash", "parent")}


def test_a_forked_process_runs_like_a_fresh_one(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = dict(ENV, LZ_ZYGOTE_VAR="seen")
    runs = {
        arg: run_script([sys.executable, str(script), arg], 1, cwd=tmp_path, env=env, timeout=120)
        for arg in ("0", "3", "raise", "kill")
    }
    assert [runs[arg].returncode for arg in runs] == [0, 3, 1, -9]
    for arg, run in runs.items():
        assert f"argv ['{arg}'] cwd {tmp_path} name __main__ var seen" in run.stdout, run.stdout
        assert "to stderr" in run.stderr
        assert int(_fields(run.stdout)["parent"]) != os.getpid(), "not forked from a zygote"
    assert runs["0"].stdout.endswith("thread joined\natexit ran\n"), runs["0"].stdout
    assert "ValueError: boom" in runs["raise"].stderr and runs["raise"].stdout.endswith("atexit ran\n")
    assert "atexit ran" not in runs["kill"].stdout


def test_ranks_have_their_own_rank_and_hash_seed(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    run = run_ranks([sys.executable, str(script), "0"], 3, cwd=tmp_path, env=ENV, timeout=120)
    assert run.returncode == 0, run.stderr
    ranks = [_fields(part) for part in run.stdout.split("--- rank ")[1:]]
    assert [r["rank"] for r in ranks] == ["0", "1", "2"]
    seeds = len({r["hash"] for r in ranks})
    fixed = ENV.get("PYTHONHASHSEED", "random") != "random"  # a fixed seed: fresh processes share it too
    assert seeds == (1 if fixed else 3), "ranks share a hash seed that fresh processes would not"
    assert all(int(r["parent"]) != os.getpid() for r in ranks)


def test_startup_settings_and_interpreter_options_are_honoured(tmp_path: Path) -> None:
    """A startup variable (here the hash seed) selects a zygote started with it; an interpreter option
    (``-u``) makes a plain subprocess, a child of this process."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    seeded = dict(ENV, PYTHONHASHSEED="123")
    fresh = subprocess.run(
        [sys.executable, "-c", "print(hash('lightning-zero'))"], env=seeded, capture_output=True, text=True
    )
    forked = run_script([sys.executable, str(script), "0"], 1, cwd=tmp_path, env=seeded, timeout=120)
    assert forked.returncode == 0, forked.stderr
    assert _fields(forked.stdout)["hash"] == fresh.stdout.strip()
    assert int(_fields(forked.stdout)["parent"]) != os.getpid()
    plain = run_script([sys.executable, "-u", str(script), "0"], 1, cwd=tmp_path, env=ENV, timeout=120)
    assert plain.returncode == 0 and int(_fields(plain.stdout)["parent"]) == os.getpid()
    assert zygote.startup_env(seeded) != zygote.startup_env(ENV)
