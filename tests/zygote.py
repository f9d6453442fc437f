"""Warm interpreters that fork the test suite's launched processes instead of starting fresh ones.

A fresh Python that imports Lightning takes about 9 s of CPU on the 2-core test machine (torch, then
torchmetrics, which imports transformers and matplotlib because the recipes install them, then torch's
compiler stack through ``lightning.fabric.wrappers``). The suite launches dozens of such processes.
A *zygote* is a server process that has imported those third-party packages once (never our own code,
never running a tensor operation) and then forks a child for each request; the child sets the
request's working directory, environment, argv and standard streams and runs the script or module as
``__main__``, exactly as ``python script.py ...`` / ``python -m module ...`` would, then exits like the
interpreter does (non-daemon threads joined, ``atexit`` handlers run, the status of ``SystemExit`` or
1 after printing an uncaught exception).

What a fork cannot reproduce, and how that is kept out of the tests' way:

- Settings read when the interpreter or a package starts (``PYTHON*``, ``OMP_*``, ``TORCH_*``, …:
  see ``_STARTUP_PREFIXES``): a zygote is started per distinct set of them, so a child always has the
  startup of a fresh process with its environment. A request whose command has interpreter options
  (``python -u``, ``-X``) runs as a plain subprocess.
- The hash seed: every fresh process draws its own, which is what lets a rank that iterates a set in
  its own order diverge from the others. Each rank slot (rank 0, 1, 2 of a launch) has its own zygote,
  hence its own seed; ranks of one launch never share one.
- Lightning's ``rank_zero_only.rank``, read from ``RANK``/``LOCAL_RANK``/… at import: set again in the
  child from its environment. Variables Lightning sets at import (``PYTORCH_NVML_BASED_CUDA_CHECK``)
  are put back on top of the child's environment, as its own import would.
- Threads: a fork copies only the calling thread. A zygote that has any thread after its imports
  (OpenBLAS starts one without ``OMP_NUM_THREADS=1``) is not used; the request runs as a subprocess.

``LZ_TEST_ZYGOTE=0`` turns the zygotes off (every launch a fresh subprocess), to compare or to debug.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# Imported by every zygote: the expensive third-party part of what the launched test scripts import.
PRELOAD = ("torch", "lightning.pytorch", "lightning.fabric", "torchmetrics", "omegaconf", "hydra")

# Environment variables read when Python, torch, its BLAS/OpenMP or Lightning start, not later: a child
# must come from a zygote started with the same values (an unset variable counts as a value).
_STARTUP_PREFIXES = (
    "PYTHON",
    "TORCH",
    "PYTORCH",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "LD_",
    "CUDA",
    "POSSIBLE_USER_WARNINGS",
    "MPL",
    "HF_",
    "TRANSFORMERS",
    "HOME",
    "TMPDIR",
    "XDG_",
)


# Under those prefixes, but what a launcher gives each rank and torch reads only when it runs (torchrun's
# ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``, ...), like ``RANK``: a launch with them is
# served by the zygotes of the one without.
_LAUNCH_PREFIXES = ("TORCHELASTIC_",)


def startup_env(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of ``env`` a process reads as it starts (what a zygote must have been started with)."""
    return tuple(
        sorted(
            (k, v)
            for k, v in env.items()
            if k.startswith(_STARTUP_PREFIXES) and not k.startswith(_LAUNCH_PREFIXES)
        )
    )


def enabled() -> bool:
    """Zygotes serve the pytest process only: what a launched process (a benchmark script, a harness run
    inside one) launches in turn starts fresh, and a script run by hand never starts servers."""
    return os.environ.get("LZ_TEST_ZYGOTE", "1") != "0" and "pytest" in sys.modules


# ---------------------------------------------------------------------------------------------- server


def _exit_code(exc: SystemExit) -> int:
    """The status an interpreter ends with on ``exc``, printing a non-integer code as Python does."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _run_child(request: dict[str, Any], import_env: dict[str, str]) -> None:
    """In the forked child: become ``python <argv>`` with the request's streams, cwd and environment;
    never returns."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.update(import_env)
        rank_zero = sys.modules.get("lightning.fabric.utilities.rank_zero")
        if rank_zero is not None:
            rank_zero.rank_zero_only.rank = rank_zero._get_rank() or 0
        argv = request["argv"]
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        with contextlib.suppress(BaseException):
            sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter does at exit
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    """The zygote: import ``PRELOAD``, say ``ready`` (with the thread count), then fork a child for each
    request line on stdin and report each child's pid and, once reaped, its exit status on stdout."""
    pipe_out = os.dup(1)
    os.dup2(2, 1)  # whatever the imports print goes to the log, not into the answers
    before = dict(os.environ)
    for name in PRELOAD:
        __import__(name)
    import_env = {k: v for k, v in os.environ.items() if before.get(k) != v}

    def say(message: dict[str, Any]) -> None:
        os.write(pipe_out, (json.dumps(message) + "\n").encode())

    say({"ready": len(os.listdir("/proc/self/task")), "pid": os.getpid()})
    pending = b""
    while True:
        while True:  # reap
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            say({"pid": pid, "exit": os.waitstatus_to_exitcode(status)})
        readable, _, _ = select.select([0], [], [], 0.02)
        if not readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            return  # the test session closed the pipe
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.close(pipe_out)
                _run_child(request, import_env)
            say({"id": request["id"], "pid": pid})


# ---------------------------------------------------------------------------------------------- client


class ZygoteError(RuntimeError):
    """A zygote could not start or stopped answering."""


class _Zygote:
    """One server process and a thread reading its answers."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._log = tempfile.NamedTemporaryFile(prefix="zygote-", suffix=".log", delete=False)  # noqa: SIM115
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote"],
            cwd=ROOT,
            env=dict(env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        self._lock = threading.Condition()
        self._pids: dict[int, int] = {}  # request id -> pid
        self._exits: dict[int, int] = {}  # pid -> exit status
        self._ready: dict[str, Any] | None = None
        self._ids = itertools.count()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            message = json.loads(line)
            with self._lock:
                if "ready" in message:
                    self._ready = message
                elif "exit" in message:
                    self._exits[message["pid"]] = message["exit"]
                else:
                    self._pids[message["id"]] = message["pid"]
                self._lock.notify_all()
        with self._lock:
            self._lock.notify_all()

    def _wait_for(self, what: Any, timeout: float) -> Any:
        with self._lock:
            if not self._lock.wait_for(lambda: what() is not None or self._proc.poll() is not None, timeout):
                raise ZygoteError(f"no answer from the zygote in {timeout} s")
            value = what()
            if value is None:
                raise ZygoteError(f"the zygote ended: {Path(self._log.name).read_text()[-2000:]}")
            return value

    def usable(self) -> bool:
        """Ready (waits for its imports) and single-threaded, so that a fork copies all of it."""
        ready = self._wait_for(lambda: self._ready, timeout=300)
        return bool(ready["ready"] == 1) and self._proc.poll() is None

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, stdout: str, stderr: str) -> int:
        request_id = next(self._ids)
        request = {"id": request_id, "argv": list(argv), "env": dict(env), "cwd": str(cwd)}
        request.update(stdout=stdout, stderr=stderr)
        assert self._proc.stdin is not None
        self._proc.stdin.write((json.dumps(request) + "\n").encode())
        self._proc.stdin.flush()
        return int(self._wait_for(lambda: self._pids.get(request_id), timeout=60))

    def exit_status(self, pid: int) -> int | None:
        with self._lock:
            return self._exits.get(pid)

    def wait(self, pid: int, timeout: float | None) -> int:
        with self._lock:
            if not self._lock.wait_for(lambda: pid in self._exits or self._proc.poll() is not None, timeout):
                raise subprocess.TimeoutExpired(str(pid), timeout or 0)
            if pid not in self._exits:
                raise ZygoteError(f"the zygote ended before process {pid}")
            return self._exits[pid]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self._proc.stdin is not None:
                self._proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10)
        if self._proc.poll() is None:
            self._proc.kill()
        os.unlink(self._log.name)


class Forked:
    """The ``subprocess.Popen`` calls ``tests.launch`` makes, for a child of a zygote."""

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self._zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_status(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.wait(self.pid, timeout)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


_ZYGOTES: dict[tuple[int, tuple[tuple[str, str], ...]], _Zygote | None] = {}


def start(slots: int, env: Mapping[str, str]) -> list[_Zygote | None]:
    """The zygotes of rank slots ``0..slots-1`` for ``env``'s startup settings, started now where new (all
    at once: their imports overlap); None for one that cannot serve (it is closed, and not tried again)."""
    return start_many([(slots, env)])[0]


def start_many(launches: Sequence[tuple[int, Mapping[str, str]]]) -> list[list[_Zygote | None]]:
    """``start`` for several launches (``(slots, env)`` each): every new zygote of all of them is started
    before any is waited for."""
    wanted = [[(slot, startup_env(env)) for slot in range(slots)] for slots, env in launches]
    for keys, (_, env) in zip(wanted, launches, strict=True):
        for key in keys:
            if key not in _ZYGOTES:
                _ZYGOTES[key] = _Zygote(env)
    for key in dict.fromkeys(key for keys in wanted for key in keys):
        zygote = _ZYGOTES[key]
        if zygote is None:
            continue
        try:
            if zygote.usable():
                continue
        except ZygoteError:
            pass
        zygote.close()
        _ZYGOTES[key] = None
    return [[_ZYGOTES[key] for key in keys] for keys in wanted]


def popen(
    command: Sequence[str], *, slot: int, cwd: Path, env: Mapping[str, str], stdout: Any, stderr: Any
) -> subprocess.Popen[bytes] | Forked:
    """Start ``command`` (``[sys.executable, script | -m module, args...]``) as rank slot ``slot``:
    forked from a zygote when possible, else a fresh subprocess. ``stdout``/``stderr`` are open files."""
    argv = list(command[1:])
    plain = (
        not enabled()
        or command[0] != sys.executable
        or not argv
        or (argv[0].startswith("-") and argv[0] != "-m")
        or (argv[0] == "-m" and len(argv) < 2)
    )
    if not plain:
        zygote = start(slot + 1, env)[slot]
        if zygote is not None:
            return Forked(zygote, zygote.spawn(argv, env, cwd, stdout.name, stderr.name))
    return subprocess.Popen(list(command), cwd=cwd, env=dict(env), stdout=stdout, stderr=stderr)


@atexit.register
def _close_all() -> None:
    for zygote in _ZYGOTES.values():
        if zygote is not None:
            zygote.close()


if __name__ == "__main__":
    serve()
