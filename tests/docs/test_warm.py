"""``tests.docs.warm``: ``python ...`` in a docs block, served by the warm server, prints, reports and
ends exactly as the fresh interpreter does; what it cannot serve exactly runs the real interpreter."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import zygote
from tests.docs.warm import Server, interruptible

PROBE = r"""
import json, os, sys
mine = ("json", "os", "sys", "re", "SET_BY_IMPORTS")
shown = {k: re.sub(" at 0x[0-9a-f]+", "", repr(v)) for k, v in globals().items() if k not in mine + ("mine",)}
# what the server's imports set is set in a served command from the start; bash sets SHLVL and _
# differently for a function (warm.py)
env = {k: v for k, v in os.environ.items() if k not in (*SET_BY_IMPORTS, "SHLVL", "_")}
streams = [(s.line_buffering, s.write_through, s.encoding, s.errors) for s in (sys.stdout, sys.stderr)]
print(json.dumps(dict(
    main=shown, argv=sys.argv, orig_argv=sys.orig_argv, path=sys.path, executable=sys.executable,
    flags=repr(sys.flags), warnoptions=sys.warnoptions, cwd=os.getcwd(), env=env, streams=streams,
    main_module=re.sub(" at 0x[0-9a-f]+", "", repr(sys.modules["__main__"])), umask=os.umask(0o22),
    stdin=sys.stdin.read(),
), indent=1, sort_keys=True))
print("to stderr", file=sys.stderr)
"""

ENDINGS = r"""
import atexit, sys, threading, time
class Late:
    def __del__(self):
        print("finalized", flush=True)
late = Late()  # a module global: destroyed at interpreter shutdown
atexit.register(lambda: print("atexit", flush=True))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined", flush=True))).start()
how = sys.argv[1]
print("start", how, flush=True)
if how == "exit3":
    sys.exit(3)
if how == "message":
    sys.exit("a message")
if how == "raise":
    def inner():
        raise ValueError("boom")
    inner()
if how == "signal":
    import os, signal
    os.kill(os.getpid(), signal.SIGTERM)
"""


# as a docs session's (tests/docs/test_docs.py environment()): one thread, the project's python first
ENV = dict(
    os.environ, OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with interruptible():  # as from a terminal, however pytest was started (a CI job ignores SIGINT)
        served = Server(ENV, zygote.PRELOAD)
        assert served.ready(), Path(served._log).read_text()
        yield served
        served.close()


def _run(script: str, tmp: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _both(script: str, tmp: Path, server: Server) -> tuple[subprocess.CompletedProcess[str], ...]:
    env = dict(ENV)
    env["PYTHONPATH"] = str(tmp / "lib")
    (tmp / "lib").mkdir(exist_ok=True)
    fresh = _run(script, tmp, env)
    served = len(server.report())
    warm = _run(script, tmp, dict(env, **server.function()))
    assert [line for line in server.report()[served:] if "served" in line], server.report()[served:]
    return fresh, warm


def _same(fresh: subprocess.CompletedProcess[str], warm: subprocess.CompletedProcess[str]) -> None:
    pids = re.compile(r"\b\d{3,}\b")  # bash's message names a pid
    assert warm.returncode == fresh.returncode
    assert warm.stdout.splitlines() == fresh.stdout.splitlines()
    assert pids.sub("N", warm.stderr) == pids.sub("N", fresh.stderr)


@pytest.mark.parametrize(
    "command",
    [
        "python probe.py a 'b c'",
        "python -m pkg.probe x",
        'python -c "$(cat probe.py)" y',
        "cd sub && python ../probe.py",
    ],
)
def test_a_served_command_sees_what_a_fresh_interpreter_sees(
    command: str, tmp_path: Path, server: Server
) -> None:
    source = f"import re\nSET_BY_IMPORTS = {server.report()[0]['import_env']!r}\n{PROBE}"
    (tmp_path / "probe.py").write_text(source)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "probe.py").write_text(source)
    (tmp_path / "sub").mkdir()
    fresh, warm = _both(f"echo input | ({command}) 2>&1 | cat", tmp_path, server)
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    _same(fresh, warm)


@pytest.mark.parametrize("how", ["normal", "exit3", "message", "raise", "signal"])
def test_a_served_command_ends_as_a_fresh_interpreter_ends(how: str, tmp_path: Path, server: Server) -> None:
    (tmp_path / "endings.py").write_text(ENDINGS)
    script = f"status=0; python endings.py {how} || status=$?; echo status $status"
    fresh, warm = _both(script, tmp_path, server)
    assert ("finalized" in fresh.stdout or how == "signal") and "status" in fresh.stdout, fresh
    _same(fresh, warm)


def test_what_cannot_be_served_exactly_runs_the_real_interpreter(tmp_path: Path, server: Server) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "hydra.py").write_text("print('shadowed')\n")  # a preloaded module, hidden
    (tmp_path / "probe.py").write_text("import hydra, os\nprint(os.environ.get('TORCH_X'))\n")
    env = dict(ENV, PYTHONPATH=str(tmp_path / "lib"), **server.function())
    before = len(server.report())
    script = "python probe.py; TORCH_X=1 python -c 'import os; print(os.environ[\"TORCH_X\"])'"
    done = _run(script, tmp_path, env)
    assert done.stdout.split() == ["shadowed", "None", "1"], done
    assert [line.get("fallback", "")[:11] for line in server.report()[before:]] == [
        "would impor",
        "environment",
    ]
