"""Docs that run: every fenced code block of ``README.md`` and ``docs/*.md`` is executed, or marked.

The rules (also in ``docs/README.md``):

* A fence opens at column 0 with three backticks and a language. The language decides:
  ``python`` runs as a script with the project's Python; ``bash``, ``sh`` and ``console`` run as
  shell commands (``bash -e -o pipefail``); in ``console`` the lines after ``$ `` are the commands
  and every other non-blank line is expected output: the block's output lines, in order, are what
  its commands print on stdout, whole (blank lines and trailing blanks aside), so an output sample
  can neither drift nor silently leave lines out; a line ``...`` alone stands for any lines there
  (none included), the one way to show a part of the output; ``text`` is not
  code (output samples, directory trees, layouts) and is not run. Any other language, or none,
  fails: a block is run unless it says otherwise.
* Markers are HTML comments, one per line, on the lines right above a fence:
  ``<!-- docs: DIRECTIVE ... -->``. A marker that is not directly above a fence, or an unknown
  directive, fails. Directives:

  - ``session NAME``: the blocks of one page with the same session share one working directory and
    run in document order (train, then evaluate the checkpoint). Without it a block runs alone.
  - ``file NAME`` (python): the block is written to ``NAME`` in the session's directory instead of
    being run; a later shell block of the same session must run it (``python NAME``).
  - ``append ARGS`` (shell): ``ARGS`` is appended to every command of the block, before a trailing
    ``# comment``: the test-only overrides that make a minutes-long run take seconds
    (``trainer.max_steps=3``). They are visible in the markdown source, never hidden in this file.
  - ``excerpt PAGE`` (python): not run; every code line of the block (comments and indentation
    aside) must appear in a python block of ``PAGE`` that runs.
  - ``gpu-only: WHY``, ``cluster-only: WHY``, ``network-only: WHY``, ``ci-only: WHY``: not run here,
    for the reason given (a reason is required). ``ci-only`` is for the README's own ``make train``
    / ``make test``, which cannot run inside the test suite they start.

* Every executable block is run or carries one of those not-run markers. Commands recognised as
  needing a cluster (``sbatch``, ``srun``, ``salloc``, ``scancel``, ``scontrol`` at the start of a
  command, ``hydra/launcher=slurm``, ``torchrun --nnodes`` > 1) or a GPU (``recipes.pretrain`` with
  ``trainer=gpu`` or a GPU experiment) must carry ``cluster-only`` / ``gpu-only``: a block without
  its marker fails the page check, and no block runs while the page check fails.
* Relative links of these pages, and their ``#anchors``, resolve (``PENDING`` names a page being
  written; the test fails once it exists, so the allowance cannot go stale).
* Where blocks run: each session gets a fresh temporary directory holding a copy of the repository's
  code (``lightning_zero/``, ``recipes/``, ``conf/``, ``examples/``), i.e. what the root of a fresh
  checkout looks like, so ``python -m recipes.pretrain`` works there and its ``outputs/`` never touch
  the repository. ``python``, ``lightning-zero`` and ``torchrun`` are the project's (its virtual
  environment first on ``PATH``), ``PYTHONPATH`` is that directory, ``OMP_NUM_THREADS=1`` (as the
  other multi-process tests set it). Sessions run two at a time. A block's ``python ...`` is forked
  from a warm interpreter that has imported torch and Lightning where that is exact (``tests.docs.warm``:
  the same argv, paths, streams, output and exit status as a fresh interpreter), else it is the fresh
  interpreter; ``LZ_TEST_ZYGOTE=0`` runs every one fresh.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lightning_zero.comm import recorder
from tests import zygote
from tests.docs.warm import Server, interruptible

ROOT = Path(__file__).resolve().parents[2]
PAGES = [Path("README.md"), *sorted(p.relative_to(ROOT) for p in (ROOT / "docs").glob("*.md"))]
CODE_DIRS = ("lightning_zero", "recipes", "conf", "examples")
RUN_LANGS = {"python", "bash", "sh", "console"}
TEXT_LANGS = {"text"}
NOT_RUN = {"gpu-only", "cluster-only", "network-only", "ci-only"}
BLOCK_TIMEOUT_S = 420
FENCE = re.compile(r"^(\s*)```(.*)$")
# Commands recognised as needing a cluster or a GPU: a block holding one must say so with a marker,
# so that deleting a marker fails the page check instead of submitting a job or failing for lack of
# a GPU.
NEEDS = {
    "cluster-only": re.compile(
        r"(^|[;&|(]\s*)(sbatch|srun|salloc|scancel|scontrol)\s|hydra/launcher=slurm|--nnodes=(?!1\b)\d",
        re.MULTILINE,
    ),
    "gpu-only": re.compile(r"recipes\.pretrain\b.*(trainer=gpu|experiment=\S*(gpu|multinode))"),
}
MARKER = re.compile(r"^<!-- docs: (.*?) -->$")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    directives: list[tuple[str, str]] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def get(self, name: str) -> str | None:
        values = [value for key, value in self.directives if key == name]
        return values[0] if values else None

    @property
    def not_run(self) -> str | None:
        """The not-run kind, if the block carries one."""
        kinds = [key for key, _ in self.directives if key in NOT_RUN]
        return kinds[0] if kinds else None

    @property
    def runs(self) -> bool:
        return (
            self.lang in RUN_LANGS
            and self.not_run is None
            and self.get("excerpt") is None
            and self.get("file") is None
        )


def parse_directive(text: str) -> tuple[str, str]:
    """``"append a=1 b=2"`` -> ``("append", "a=1 b=2")``; ``"gpu-only: why"`` -> ``("gpu-only", "why")``."""
    head, _, rest = text.partition(" ")
    return head.rstrip(":"), rest.strip()


def parse_page(page: Path) -> tuple[list[Block], list[str]]:
    """The fenced blocks of ``page`` with their markers, and the structural problems found."""
    lines = (ROOT / page).read_text().splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    pending: list[tuple[int, str]] = []  # markers on the lines right above the next line
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = MARKER.match(line)
        if marker:
            pending.append((i + 1, marker.group(1)))
            i += 1
            continue
        if line.lstrip().startswith("<!--") and "docs:" in line:
            problems.append(f"{page}:{i + 1}: malformed docs marker (one per line, at column 0)")
        fence = FENCE.match(line)
        if not fence:
            problems += [f"{page}:{n}: docs marker not directly above a fence" for n, _ in pending]
            pending = []
            i += 1
            continue
        start, indent, lang = i, fence.group(1), fence.group(2).strip()
        i += 1
        while i < len(lines) and not lines[i].lstrip().startswith("```"):
            i += 1
        if i == len(lines):
            problems.append(f"{page}:{start + 1}: code fence never closed")
        if indent:
            problems.append(f"{page}:{start + 1}: fences open at column 0 (this one is indented)")
        block = Block(page, start + 1, lang, "\n".join(lines[start + 1 : i]) + "\n")
        block.directives = [parse_directive(text) for _, text in pending]
        pending = []
        blocks.append(block)
        problems += check_block(block)
        i += 1
    problems += [f"{page}:{n}: docs marker not directly above a fence" for n, _ in pending]
    return blocks, problems


def check_block(block: Block) -> list[str]:
    """What is wrong with one block's language and markers."""
    where, problems = block.where, []
    if block.lang not in RUN_LANGS | TEXT_LANGS:
        known = ", ".join(sorted(RUN_LANGS | TEXT_LANGS))
        return [f"{where}: fence language {block.lang!r} is not one of {known}"]
    allowed = {"session", "file", "append", "excerpt", *NOT_RUN}
    for key, value in block.directives:
        if key not in allowed:
            problems.append(f"{where}: unknown docs directive {key!r} (known: {', '.join(sorted(allowed))})")
        elif not value:
            problems.append(f"{where}: docs directive {key!r} needs a value (a name, arguments or a reason)")
    if block.lang in TEXT_LANGS and block.directives:
        problems.append(f"{where}: a text block is never run; it takes no docs markers")
    if block.get("file") is not None and block.lang != "python":
        problems.append(f"{where}: 'file' is for python blocks")
    if block.get("excerpt") is not None and block.lang != "python":
        problems.append(f"{where}: 'excerpt' is for python blocks")
    if block.get("append") is not None and block.lang not in {"bash", "sh", "console"}:
        problems.append(f"{where}: 'append' is for shell blocks")
    exclusive = [k for k, _ in block.directives if k in NOT_RUN | {"excerpt", "file"}]
    if len(exclusive) > 1:
        problems.append(f"{where}: at most one of file / excerpt / a not-run marker, got {exclusive}")
    if block.not_run and any(k in {"session", "append"} for k, _ in block.directives):
        problems.append(f"{where}: a block that is not run takes no session or append")
    if block.lang in RUN_LANGS and block.not_run is None and block.get("excerpt") is None:
        for kind, pattern in NEEDS.items():
            if pattern.search(block.code):
                problems.append(f"{where}: this block needs a {kind} marker (it would not run here)")
    return problems


def all_blocks() -> tuple[list[Block], list[str]]:
    blocks: list[Block] = []
    problems: list[str] = []
    for page in PAGES:
        page_blocks, page_problems = parse_page(page)
        blocks += page_blocks
        problems += page_problems
    return blocks, problems


def sessions(blocks: list[Block]) -> dict[str, list[Block]]:
    """Blocks that execute (run, or written as a file), grouped into sessions in document order."""
    groups: dict[str, list[Block]] = {}
    for block in blocks:
        if not (block.runs or block.get("file") is not None):
            continue
        name = block.get("session")
        key = f"{block.page}::{name}" if name else f"{block.where}"
        groups.setdefault(key, []).append(block)
    return groups


def code_lines(code: str) -> list[str]:
    """Lines of python code without comments, indentation and blank lines."""
    return [text for raw in code.splitlines() if (text := split_comment(raw)[0].strip())]


# --- shell commands -------------------------------------------------------------------------------


def split_comment(line: str) -> tuple[str, str]:
    """``'cmd a=1   # why'`` -> ``('cmd a=1', '   # why')``: a ``#`` after whitespace, outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            code = line[:i].rstrip()
            return code, line[len(code) :]
    return line, ""


def shell_script(block: Block) -> str:
    """The block's commands, with its ``append`` arguments added to each."""
    raw = block.code.splitlines()
    if block.lang == "console":
        raw = [line[2:] for line in raw if line.startswith("$ ")]
    extra = block.get("append")
    if not extra:
        return "\n".join(raw) + "\n"
    out: list[str] = []
    logical: list[str] = []
    for line in raw:
        logical.append(line)
        if line.rstrip().endswith("\\"):
            continue
        last = logical[-1]
        code, comment = split_comment(last)
        if code.strip():
            logical[-1] = f"{code} {extra}{comment}"
        out += logical
        logical = []
    out += logical
    return "\n".join(out) + "\n"


ELISION = "..."  # an output line alone: any lines here, none included


def output_lines(text: str) -> list[str]:
    """Lines of output as compared: trailing blanks dropped, blank lines left out."""
    return [line.rstrip() for line in text.splitlines() if line.strip()]


def expected_output(block: Block) -> list[str] | None:
    """The output lines a ``console`` block shows; ``None`` for other languages (nothing checked)."""
    if block.lang != "console":
        return None
    return output_lines("\n".join(line for line in block.code.splitlines() if not line.startswith("$ ")))


def output_matches(expected: list[str], printed: list[str]) -> bool:
    """``printed`` is ``expected`` whole, each ``...`` line standing for any run of lines (or none)."""
    pieces: list[list[str]] = [[]]
    for line in expected:
        if line.strip() == ELISION:
            pieces.append([])
        else:
            pieces[-1].append(line)
    head, *middle_and_tail = pieces
    if not middle_and_tail:  # no elision: the whole output, line for line
        return printed == head
    *middle, tail = middle_and_tail
    if printed[: len(head)] != head or len(printed) < len(head) + len(tail):
        return False
    if tail and printed[len(printed) - len(tail) :] != tail:
        return False
    rest = printed[len(head) : len(printed) - len(tail)]
    for piece in middle:  # in order, each at its first place (the leftmost match leaves most room)
        at = next((i for i in range(len(rest) - len(piece) + 1) if rest[i : i + len(piece)] == piece), None)
        if at is None:
            return False
        rest = rest[at + len(piece) :]
    return True


# --- running a session ----------------------------------------------------------------------------


def environment(workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(workdir)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("LOCAL_RANK", None)  # never inherit a launcher's rank from the pytest process
    return env


def make_workdir() -> Path:
    workdir = Path(tempfile.mkdtemp(prefix="docs-"))
    for name in CODE_DIRS:
        shutil.copytree(ROOT / name, workdir / name, ignore=shutil.ignore_patterns("__pycache__"))
    return workdir


def run_command(command: list[str], workdir: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run one block; on a timeout its whole process group (launched ranks included) is killed."""
    proc = subprocess.Popen(
        command,
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\n(killed after {BLOCK_TIMEOUT_S} s)"
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def run_session(blocks: list[Block], python: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
    """Run the blocks in order; returns the failures (empty when all passed) and the time per block.
    ``python``: the environment's ``python`` function (:meth:`tests.docs.warm.Server.function`).

    The session's launches log their collectives into a directory of its own, compared when the
    session ends (tests/conftest.py's check): sessions run in the background, two at a time, while
    the tests before theirs finish, and a check after another test would see a launch still running
    (a rank past a broadcast whose receiver has not logged it yet) and remove its logs."""
    workdir = make_workdir()
    env = environment(workdir)
    env.update(python or {})
    env[recorder.ENV_DIR] = str(workdir / "collectives")
    timings: list[str] = []
    try:
        failures, timings = _run_blocks(blocks, workdir, env, timings)
        problems = recorder.compare_logs(workdir / "collectives")
        if problems and not failures:
            failures = [
                "ranks issued different collective sequences (NCCL would hang or mix up tensors):",
                *problems,
            ]
        return failures, timings
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run_blocks(
    blocks: list[Block], workdir: Path, env: dict[str, str], timings: list[str]
) -> tuple[list[str], list[str]]:
    """The blocks in order, up to the first that fails."""
    for index, block in enumerate(blocks):
        name = block.get("file")
        if name is not None:
            (workdir / name).write_text(block.code)
            later = " ".join(b.code for b in blocks[index + 1 :] if b.lang != "python")
            if name not in later:
                return [f"{block.where}: no later block of its session runs the file {name}"], timings
            continue
        if block.lang == "python":
            script = workdir / f"_docs_block_{block.line}.py"
            script.write_text(block.code)
            command = [sys.executable, script.name]
        else:
            command = ["bash", "-e", "-o", "pipefail", "-c", shell_script(block)]
        start = time.perf_counter()
        proc = run_command(command, workdir, env)
        timings.append(f"{block.where}: {time.perf_counter() - start:.1f} s")
        shown = shlex.join(command) if block.lang == "python" else command[-1]
        report = (
            f"--- ran:\n{shown}\n--- stdout (tail):\n{proc.stdout[-3000:]}\n"
            f"--- stderr (tail):\n{proc.stderr[-5000:]}"
        )
        if proc.returncode != 0:
            return [f"{block.where}: exit status {proc.returncode}\n{report}"], timings
        expected = expected_output(block)
        if expected is not None and not output_matches(expected, output_lines(proc.stdout)):
            diff = difflib.unified_diff(expected, output_lines(proc.stdout), "shown", "printed", lineterm="")
            why = "the output shown is not what was printed (a line `...` stands for lines left out)"
            return [f"{block.where}: {why}\n" + "\n".join(diff) + f"\n{report}"], timings
    return [], timings


def cost(blocks: list[Block]) -> int:
    """Processes a session starts, roughly: each costs seconds of imports (torch, Lightning)."""
    commands = 0
    for block in blocks:
        if block.lang == "python":
            commands += block.get("file") is None
        else:
            lines = shell_script(block).splitlines()
            commands += sum(1 for line in lines if split_comment(line)[0].strip() and not line.endswith("\\"))
    return commands


BLOCKS, PROBLEMS = all_blocks()
SESSIONS = sessions(BLOCKS)


@pytest.fixture(scope="module")
def running(request: pytest.FixtureRequest) -> dict[str, Future]:
    """Start every selected session, two at a time, the longest first; tests wait for their own."""
    wanted = [
        item.callspec.params["session"]
        for item in request.session.items
        if item.originalname == "test_session" and hasattr(item, "callspec")
    ]
    if PROBLEMS:  # a damaged marker could let a cluster command run: fix the pages first
        wanted = []
    # SIGINT as from a terminal while the sessions run (a CI job may ignore it, and the shim then runs
    # every command fresh); a command before the warm interpreter is ready runs fresh (no socket yet)
    with interruptible():
        warm = Server(environment(ROOT), zygote.PRELOAD) if wanted and zygote.enabled() else None
        python = warm.function() if warm is not None else {}
        pool = ThreadPoolExecutor(max_workers=2)
        futures = {
            key: pool.submit(run_session, SESSIONS[key], python)
            for key in sorted(wanted, key=lambda k: -cost(SESSIONS[k]))
        }
        yield futures
        pool.shutdown(wait=True, cancel_futures=True)
        if warm is not None:
            served = sum("served" in line for line in warm.report())
            fallbacks = [line for line in warm.report() if "fallback" in line]
            print(f"warm python: {served} served, not: {fallbacks}")
            warm.close()


def test_every_block_is_run_or_marked() -> None:
    """Fence languages and markers follow the rules above; nothing is silently left out."""
    assert PAGES and BLOCKS, "no pages or no code blocks found"
    assert not PROBLEMS, "\n".join(PROBLEMS)


def test_excerpts_appear_in_a_run_block() -> None:
    """An excerpt (the README's three lines) is the text of a block that runs, line by line."""
    excerpts = [b for b in BLOCKS if b.get("excerpt") is not None]
    assert excerpts, "the README's Trainer snippet should be an excerpt of a page that runs it"
    for block in excerpts:
        target = Path(block.get("excerpt") or "")
        sources = [b for b in BLOCKS if b.page == target and b.lang == "python" and (b.runs or b.get("file"))]
        assert sources, f"{block.where}: no python block that runs in {target}"
        known = {line for b in sources for line in code_lines(b.code)}
        missing = [line for line in code_lines(block.code) if line not in known]
        assert not missing, f"{block.where}: lines not found in a run block of {target}: {missing}"


LINK = re.compile(r"\]\(([^)\s]+)\)")
PENDING: dict[Path, str] = {}  # page -> why it may be linked before it exists


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    lines = (ROOT / page).read_text().splitlines()
    in_fence, found = False, set()
    for line in lines:
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def test_links_resolve() -> None:
    """Relative links point at pages that exist, and anchors at headings they have."""
    problems = [
        f"{page}: remove it from PENDING, it exists now" for page in PENDING if (ROOT / page).exists()
    ]
    for page in PAGES:
        in_fence = False
        for number, line in enumerate((ROOT / page).read_text().splitlines(), 1):
            if line.startswith("```"):
                in_fence = not in_fence
            if in_fence:
                continue
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue  # https:, mailto:
                path, _, anchor = target.partition("#")
                linked = Path(os.path.normpath(page.parent / path)) if path else page
                if linked in PENDING:
                    continue
                if not (ROOT / linked).exists():
                    problems.append(f"{page}:{number}: {target}: no such file")
                elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                    problems.append(f"{page}:{number}: {target}: no such heading in {linked}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("session", list(SESSIONS))
def test_session(session: str, running: dict[str, Future]) -> None:
    """The session's blocks run, in document order, with exit status 0."""
    assert not PROBLEMS, "not run: the page check failed (test_every_block_is_run_or_marked)"
    failures, timings = running[session].result()
    print("\n".join(timings))
    assert not failures, "\n".join(failures + ["--- time per block:", *timings])


@pytest.mark.parametrize(
    ("shown", "matches"),
    [
        (["a", "b", "c"], True),
        (["a", "c"], False),  # a line left out silently
        (["a", "b"], False),
        (["b", "c"], False),
        (["a", "b", "c", "d"], False),
        (["a", "...", "c"], True),
        (["...", "c"], True),
        (["a", "..."], True),
        (["...", "b", "..."], True),
        (["a", "b", "...", "c"], True),  # an elision may stand for no line
        (["a", "...", "b", "...", "c"], True),
        (["a", "...", "c", "...", "b"], False),  # out of order
        (["...", "d"], False),
    ],
)
def test_output_is_compared_whole(shown: list[str], matches: bool) -> None:
    """A console block's output is what its commands print, whole: only a ``...`` line elides."""
    assert output_matches(shown, ["a", "b", "c"]) is matches
