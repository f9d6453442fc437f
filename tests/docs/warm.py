"""A warm ``python`` for the docs blocks: ``python ...`` in a block forked from an interpreter that has
already imported torch and Lightning, behaving as the fresh interpreter would.

Each recipe command of a docs block is a fresh ``python`` that spends seconds importing torch, Lightning
(and transformers through torchmetrics) before doing anything of its own. A docs session's shell gets a
bash function ``python`` (exported as ``BASH_FUNC_python%%``; ``PATH`` is not changed) that runs this
file as a small client, the *shim*. The shim passes its standard streams (the file descriptors
themselves, over a Unix socket), argv, environment, working directory and ``sys.path`` to the *server*
(started once per test module, :class:`Server`), which forks a child that becomes ``python <argv>``:
the same ``sys.argv``, ``sys.orig_argv``, ``sys.path``, ``__main__`` (its ``__file__``, ``__spec__``,
``__loader__``), streams, uncaught-exception report and exit status, and the interpreter's own shutdown
(threads joined, ``atexit``, finalization, so a crash at exit still shows). The shim exits with the
child's status, or dies of the child's signal. Rank 1 of a Lightning launch is started by Lightning
itself with ``sys.executable``: a fresh interpreter, as without the shim.

Served only where the fork cannot differ from a fresh interpreter; every other command ``exec``s the
real interpreter with the block's own argv and environment:

- ``python script.py ...`` (a regular ``.py`` file), ``python -m module ...``, ``python -c code ...``;
  any interpreter option (``-u``, ``-X``, ``-W``, ...) runs the real interpreter.
- The environment equals the server's except variables read after startup (:data:`_LATE`): what the
  server's imports read at import time (``TORCH*``, ``OMP_*``, ``HF_*``, locale, ``PYTHON*`` flags)
  is the child's. ``PYTHONPATH`` is the exception the shim carries: its ``sys.path`` (computed by a
  real interpreter start with the block's environment) becomes the child's.
- No file of the script's directory or of a ``PYTHONPATH`` entry shadows a module the server imported
  (the fresh interpreter would import the file instead).
- No standard stream is a terminal, and none is closed; ``SIGINT`` is not ignored.
- The server imports third-party packages only, never this project (whose modules read ``LZ_*`` and
  launcher variables at import), prints nothing while importing, and holds one thread. Per-process
  random state is drawn again in the child (Python's ``random``, numpy's global generator, torch's
  default CPU generator, which a fresh interpreter seeds from the OS), after checking that the imports
  drew nothing from torch's.

What still differs: the child's parent is the server and it runs in a session of its own (killed with
its descendants when the shim dies, e.g. at a block's timeout); ``/proc/self/cmdline`` is the server's;
the hash seed is the server's (as random as a fresh one, shared by the commands it serves); variables
the server's imports set (Lightning's ``PYTORCH_NVML_BASED_CUDA_CHECK``, torch's
``TORCHINDUCTOR_CACHE_DIR``) are set from the start, as ``tests.zygote`` sets them; bash, calling a
function, sets ``SHLVL`` and ``_`` as for a function; if a command dies of a signal, bash names the
shim's command line in its message. ``LZ_TEST_ZYGOTE=0`` turns the server off.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

FUNCTION = "BASH_FUNC_python%%"  # bash's name for an exported function ``python``
# Read after startup, never by the server's imports: they may differ between the server and a request.
# PYTEST_CURRENT_TEST (pytest sets it per test) is read by torch.testing._internal and
# transformers.testing_utils, which the server does not import.
_LATE = {"PYTHONPATH", "PWD", "OLDPWD", "SHLVL", "_", "PYTEST_CURRENT_TEST", FUNCTION}
_LATE_PREFIXES = ("LZ_",)  # this project's, read when its modules are imported or run
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _late(key: str) -> bool:
    return key in _LATE or key.startswith(_LATE_PREFIXES)


def _send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = (json.dumps(message) + "\n").encode()
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def _receive(
    sock: socket.socket, pending: bytearray, want_fds: int = 0
) -> tuple[dict[str, Any] | None, list[int]]:
    """One JSON line (None at end of stream) and the file descriptors that came with its first bytes."""
    fds: list[int] = []
    while b"\n" not in pending:
        if want_fds and not fds:
            chunk, fds, _, _ = socket.recv_fds(sock, 1 << 16, want_fds)
        else:
            chunk = sock.recv(1 << 16)
        if not chunk:
            for fd in fds:
                os.close(fd)
            return None, []
        pending += chunk
    line, _, rest = bytes(pending).partition(b"\n")
    pending[:] = rest
    return json.loads(line), fds


# ------------------------------------------------------------------------------------------------ shim


def _real(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """Become the real interpreter with the block's own argv and environment."""
    env = {k: v for k, v in env.items() if k != FUNCTION}
    os.execve(sys.executable, ["python", *argv], env)


def _servable(argv: Sequence[str]) -> bool:
    if not argv:
        return False
    if argv[0] in ("-m", "-c"):
        return len(argv) >= 2 and not (argv[0] == "-m" and argv[1].startswith("-"))
    if argv[0].startswith("-") or not argv[0].endswith(".py"):
        return False
    try:
        return stat.S_ISREG(os.stat(argv[0]).st_mode)
    except OSError:
        return False


def shim(address: str, argv: list[str]) -> None:
    """``python <argv>`` through the server at ``address``, or the real interpreter; never returns."""
    env = dict(os.environ)
    try:
        ttys = [os.isatty(fd) for fd in (0, 1, 2)]
        [os.fstat(fd) for fd in (0, 1, 2)]  # closed: OSError
    except OSError:
        _real(argv, env)
    if not _servable(argv) or any(ttys) or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        _real(argv, env)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
        request = {"argv": argv, "env": env, "cwd": os.getcwd(), "path": sys.path[1:], "umask": os.umask(0)}
        os.umask(request["umask"])
        _send(sock, request, (0, 1, 2))
        pending = bytearray()
        answer, _ = _receive(sock, pending)
    except OSError:
        answer = None
    if answer is None or "pid" not in answer:
        sock.close()
        _real(argv, env)
    pid = answer["pid"]

    def forward(signum: int, frame: Any) -> None:
        os.kill(pid, signum)

    for signum in _FORWARDED:
        signal.signal(signum, forward)
    ended, _ = _receive(sock, pending)
    code = 1 if ended is None else int(ended["exit"])
    if code < 0:  # died of a signal: so does the shim, for the shell's status and message
        for signum in _FORWARDED:
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


# ---------------------------------------------------------------------------------------------- server


def _shadowed(entries: Sequence[str], start: Sequence[str]) -> list[str]:
    """Modules already imported that a file in one of ``entries`` not on the server's path would hide."""
    imported = {name for name in sys.modules if "." not in name} - set(sys.builtin_module_names)
    found = []
    for entry in entries:
        if entry in start:
            continue
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        found += [name for name in names if name.partition(".")[0] in imported]
    return found


def _execute(request: dict[str, Any]) -> None:
    """In the forked child: run the request as ``python <argv>``'s ``__main__``; an uncaught exception is
    reported as the interpreter reports it (its traceback starting where the fresh one's does)."""
    import builtins
    import importlib.machinery
    import types

    argv = request["argv"]
    main = types.ModuleType("__main__")
    main.__annotations__ = {}
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    main.__loader__ = importlib.machinery.BuiltinImporter  # type: ignore[assignment]
    sys.modules["__main__"] = main
    sys.orig_argv = ["python", *argv]
    try:
        if argv[0] == "-m":
            import runpy

            sys.argv = ["-m", *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(argv[1])  # type: ignore[attr-defined]  # what `python -m` calls
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            exec(compile(argv[1], "<string>", "exec", dont_inherit=True), main.__dict__)
        else:
            path = os.path.join(os.getcwd(), argv[0])  # the interpreter's _Py_abspath: joined, not normalized
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
            main.__file__ = path
            main.__cached__ = None  # type: ignore[attr-defined]
            main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)  # type: ignore[assignment]
            with open(path, "rb") as source:
                code = compile(source.read(), path, "exec", dont_inherit=True)
            exec(code, main.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - reported as the interpreter reports it
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        raise SystemExit(130 if isinstance(exc, KeyboardInterrupt) else 1) from None


def _child(
    request: dict[str, Any], fds: list[int], import_env: dict[str, str], open_sockets: list[Any]
) -> None:
    """In the forked child: become the request's process, then leave by SystemExit through the server's
    stack, so that the interpreter shuts down as the fresh one would."""
    for sock in open_sockets:
        sock.close()
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update({k: v for k, v in request["env"].items() if k != FUNCTION})
    os.environ.update(import_env)
    sys.path[:] = ["", *request["path"]]
    import importlib
    import random

    importlib.invalidate_caches()
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.modules["torch"].default_generator.seed()
    _execute(request)
    raise SystemExit(0)


def _refusal(request: dict[str, Any], env: Mapping[str, str], start_path: Sequence[str]) -> str | None:
    """Why the server cannot serve ``request`` exactly (None: it can)."""
    keys = set(env) | set(request["env"])
    differ = sorted(k for k in keys if not _late(k) and env.get(k) != request["env"].get(k))
    if differ:
        return f"environment differs: {differ}"
    argv = request["argv"]
    first = request["cwd"] if argv[0] == "-m" else "" if argv[0] == "-c" else None
    if first is None:
        first = os.path.dirname(os.path.realpath(os.path.join(request["cwd"], argv[0])))
    entries = [os.path.join(request["cwd"], e) if e == "" else e for e in [first, *request["path"]]]
    shadowed = _shadowed(entries, start_path)
    return f"would import {shadowed} from the block's directories" if shadowed else None


def serve(address: str, preload: Sequence[str]) -> None:
    """Import ``preload``, listen at ``address``, fork a child for each request; report on stdout
    ``ready`` (or why not), then one line per request."""
    sys.path.pop(0)  # this file's directory: not on a served command's path
    before = dict(os.environ)
    for name in preload:
        __import__(name)
    import_env = {k: v for k, v in os.environ.items() if before.get(k) != v}
    torch = sys.modules["torch"]
    fresh = torch.Generator()
    fresh.manual_seed(torch.initial_seed())
    problems = []
    if len(os.listdir("/proc/self/task")) != 1:
        problems.append("threads after the imports")
    if not torch.equal(torch.get_rng_state(), fresh.get_state()):
        problems.append("the imports drew from torch's generator")
    if any(name.partition(".")[0] == "lightning_zero" for name in sys.modules):
        problems.append("the imports imported lightning_zero")
    sys.stdout.flush()
    sys.stderr.flush()
    log = Path(os.environ["LZ_WARM_LOG"])
    if log.stat().st_size:
        problems.append(f"the imports printed: {log.read_text()[:500]!r}")
    report = open(os.environ["LZ_WARM_REPORT"], "a", buffering=1)  # noqa: SIM115 - the server's lifetime
    env, start_path = dict(before), list(sys.path)
    if problems:
        report.write(json.dumps({"ready": False, "why": problems}) + "\n")
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(16)
    report.write(json.dumps({"ready": True, "import_env": sorted(import_env)}) + "\n")
    waiting: dict[int, socket.socket] = {}  # child pid -> its shim's connection
    while True:
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid)
            try:
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
            except OSError:
                pass
            conn.close()
        readable, _, _ = select.select([listener, sys.stdin, *waiting.values()], [], [], 0.02)
        if sys.stdin in readable and not os.read(0, 1):
            for pid in waiting:  # the test module is done: nothing it started outlives it
                os.killpg(pid, signal.SIGKILL)
            return
        for pid, conn in list(waiting.items()):
            if conn in readable:  # the shim ended (killed at a block's timeout): so does what it ran
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if listener not in readable:
            continue
        conn, _ = listener.accept()
        request, fds = _receive(conn, bytearray(), want_fds=3)
        why = "no request" if request is None or len(fds) != 3 else _refusal(request, env, start_path)
        if why is not None:
            for fd in fds:
                os.close(fd)
            report.write(json.dumps({"fallback": why}) + "\n")
            _send(conn, {"fallback": why})
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            report.close()
            _child(request, fds, import_env, [listener, conn, *waiting.values()])
        for fd in fds:
            os.close(fd)
        waiting[pid] = conn
        report.write(json.dumps({"served": request["argv"][:2], "pid": pid}) + "\n")
        _send(conn, {"pid": pid})


# ---------------------------------------------------------------------------------------------- client


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """SIGINT as a shell started from a terminal has it (Python's handler here, the default in the
    processes started meanwhile), whatever this process inherited: a background job (``cmd &`` in a
    non-interactive shell, a CI runner's) ignores it, and the shim runs the real interpreter for a
    command that ignores SIGINT (the server's children would not). Main thread only."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class Server:
    """One server for the docs sessions of a test module; :meth:`function` is the ``python`` function
    to put in a session's environment (empty when the server is not usable: every command runs fresh)."""

    def __init__(self, env: Mapping[str, str], preload: Sequence[str]) -> None:
        self._dir = tempfile.mkdtemp(prefix="docs-warm-")
        self.address = os.path.join(self._dir, "socket")
        self._log = os.path.join(self._dir, "imports.log")
        self._report = os.path.join(self._dir, "report.jsonl")
        env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        env.update(LZ_WARM_LOG=self._log, LZ_WARM_REPORT=self._report)
        Path(self._report).touch()
        with open(self._log, "w") as log:
            self._proc = subprocess.Popen(
                [sys.executable, __file__, "serve", self.address, ",".join(preload)],
                cwd=self._dir,
                env=env,
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=log,
            )

    def ready(self, timeout_s: float = 300) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._proc.poll() is None:
            lines = self.report()
            if lines:
                return bool(lines[0].get("ready"))
            time.sleep(0.05)
        return False

    def report(self) -> list[dict[str, Any]]:
        """What the server said: ``ready``, then ``served`` or ``fallback`` per command."""
        text = Path(self._report).read_text()
        return [json.loads(line) for line in text.splitlines() if line.endswith("}")]

    def function(self) -> dict[str, str]:
        """Until the server listens (and if it never does), the shim finds no socket and runs the real
        interpreter."""
        command = f'{sys.executable} {__file__} shim {self.address} "$@"'
        return {FUNCTION: f"() {{  {command}\n}}"}

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        for name in ("socket", "imports.log", "report.jsonl"):
            Path(self._dir, name).unlink(missing_ok=True)
        os.rmdir(self._dir)


if __name__ == "__main__":
    if sys.argv[1] == "shim":
        shim(sys.argv[2], sys.argv[3:])
    else:
        serve(sys.argv[2], [name for name in sys.argv[3].split(",") if name])
