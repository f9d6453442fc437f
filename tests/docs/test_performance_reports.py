"""``docs/performance.md`` is a set of dated reports: every table says where its figures come from.
Superseded figures live in ``docs/performance-history.md``, which the page links.

On ``performance.md`` every table has a provenance line above it, after the heading or table before
it: the line ``benchmarks/record.py`` prints first::

    Measured DATE at COMMIT on MACHINE; python V, torch V, lightning V[, ...]: `COMMAND`

and links its raw results under ``docs/results/DATE/``, which exist. Where a linked ``.txt`` was
written by ``record.py`` (it starts with ``Measured``), the page quotes its first line exactly, so
the page cannot drift from the raw output. The command must name a script in ``benchmarks/``, and
the commit must be one of this repository's. On the history page every table's section names the
commit its figures were recorded in (``Recorded in `COMMIT```).

A report of stage 3 (its section names ``zero3`` or stage 3) measured before a change of stage 3's
schedule (:data:`STAGE3_SCHEDULE_CHANGES`: the commit is not an ancestor of the one measured) says
so with the words ``measured before `COMMIT``` (or ``measured before `A` ... and `COMMIT```, one
sentence) for each such change, so that a reader never takes
such a figure for the current code's.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "performance.md"
HISTORY = ROOT / "docs" / "performance-history.md"
STAGE3_SCHEDULE_CHANGES = {
    "080115d": "the unit that ran last in forward held through the loss",
    "387fc51": "stage 3's gradient buckets launched once a unit's backward is done",
}
STAGE3 = re.compile(r"zero3|stage 3|stage-3", re.IGNORECASE)
PROVENANCE = re.compile(
    r"Measured (?P<date>\d{4}-\d{2}-\d{2}) at (?P<commit>[0-9a-f]{7,40})(?:\+dirty)? on (?P<machine>[^;]+); "
    r"python \S+, torch \S+, lightning [^:`]+: `(?P<command>[^`]+)`"
)
RECORDED = re.compile(r"Recorded in `(?P<commit>[0-9a-f]{7,40})`")
LINK = re.compile(r"\]\((?P<target>results/[^)#\s]+)\)")
HEADING = re.compile(r"^#{2,3} ")
SCRIPT = re.compile(r"(?:^|[\s/])(?P<script>benchmarks/[\w/.-]+\.py)\b")  # any launcher before it


def _flat(lines: list[str]) -> str:
    """A section's text with its line breaks as spaces (a provenance line wraps in the source)."""
    return " ".join(line.strip() for line in lines)


def sections(text: str) -> list[tuple[str, list[str]]]:
    """``(heading, lines)`` for each ``##``/``###`` heading of the page, in order."""
    found: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if HEADING.match(line):
            found.append((line.lstrip("#").strip(), []))
        elif found:
            found[-1][1].append(line)
    return found


def _tables_before(lines: list[str], since_last: bool) -> list[list[str]]:
    """For each table of the section (its first row), the lines above it: back to the section's
    heading, or (``since_last``) back to the end of the table before it."""
    found, start = [], 0
    for i, line in enumerate(lines):
        if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|")):
            found.append(lines[start:i])
        if line.startswith("|") and since_last:
            start = i + 1
    return found


def _is_commit(commit: str, root: Path) -> bool | None:
    """Whether ``commit`` is in the repository at ``root``; None when git cannot tell (no history)."""
    try:
        shallow = subprocess.run(
            ["git", "rev-parse", "--is-shallow-repository"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    if shallow.stdout.strip() == "true":
        return None
    known = subprocess.run(
        ["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=root, capture_output=True
    )
    return known.returncode == 0  # in this branch's history, not merely an object in the repository


def report_problems(text: str, docs: Path, root: Path, history: bool = False) -> list[str]:
    """Every way the page ``text`` (whose links are relative to ``docs``) fails the rules above;
    ``history``: the page of superseded figures."""
    problems: list[str] = []
    for heading, lines in sections(text):
        flat = _flat(lines)
        for above in _tables_before(lines, since_last=not history):
            quoted = _flat(above)
            if history:
                if not RECORDED.search(quoted):
                    problems.append(
                        f"{heading!r}: a table in the history without 'Recorded in `COMMIT`' above it"
                    )
                continue
            if not PROVENANCE.search(quoted):
                problems.append(
                    f"{heading!r}: a table without a provenance line after the table or heading above it"
                )
        if history:
            problems += _commit_problems(heading, [m["commit"] for m in RECORDED.finditer(flat)], root)
            continue
        lines_found = list(PROVENANCE.finditer(flat))
        if not lines_found:
            continue
        problems += _commit_problems(heading, [m["commit"] for m in lines_found], root)
        problems += _raw_problems(heading, flat, lines_found, docs, root)
        problems += _schedule_problems(heading, flat, [m["commit"] for m in lines_found], root)
    if not history and "](performance-history.md" not in text:
        problems.append("no link to performance-history.md (superseded figures go there)")
    return problems


def _before(change: str, commit: str, root: Path) -> bool | None:
    """Whether ``commit`` was measured before ``change`` (None when git cannot tell)."""
    if _is_commit(change, root) is not True:
        return None
    known = subprocess.run(
        ["git", "merge-base", "--is-ancestor", change, commit], cwd=root, capture_output=True
    )
    return known.returncode == 1


def _schedule_problems(heading: str, flat: str, commits: list[str], root: Path) -> list[str]:
    if not STAGE3.search(heading + " " + flat):
        return []
    return [
        f"{heading!r}: measured at {commit}, before {change} ({why}): say 'measured before `{change}`'"
        for change, why in STAGE3_SCHEDULE_CHANGES.items()
        for commit in sorted(set(commits))
        if _before(change, commit, root) and not re.search(rf"measured before [^.]*`{change}`", flat)
    ]


def _commit_problems(heading: str, commits: list[str], root: Path) -> list[str]:
    return [
        f"{heading!r}: commit {c} is not in this repository" for c in commits if _is_commit(c, root) is False
    ]


def _raw_problems(heading: str, flat: str, found: list[re.Match[str]], docs: Path, root: Path) -> list[str]:
    problems = []
    for match in found:
        script = SCRIPT.search(match["command"])
        if script is None or not (root / script["script"]).is_file():
            problems.append(f"{heading!r}: the command `{match['command']}` names no script in benchmarks/")
    links = [docs / m["target"] for m in LINK.finditer(flat)]
    if not links:
        problems.append(f"{heading!r}: no link to its raw results under results/")
    quoted = {" ".join(m.group(0).split()) for m in found}
    dates = {m["date"] for m in found}
    headers: set[str] = set()
    for path in links:
        if not path.is_file():
            problems.append(f"{heading!r}: raw results {path.relative_to(docs)} do not exist")
            continue
        if path.parent.name not in dates:
            problems.append(
                f"{heading!r}: raw results {path.relative_to(docs)} are not under its date {sorted(dates)}"
            )
        if path.suffix == ".txt":
            first = path.read_text().splitlines()[0] if path.stat().st_size else ""
            if first.startswith("Measured "):
                headers.add(" ".join(first.split()))
                if " ".join(first.split()) not in quoted:
                    problems.append(
                        f"{heading!r}: {path.name} was measured as {first!r}, which the page does not quote"
                    )
    # where the section links raw output record.py wrote, each line it quotes must be one of those
    problems += [
        f"{heading!r}: the line {line!r} quotes no raw output it links"
        for line in quoted - headers
        if headers
    ]
    return problems


def test_performance_page_is_dated_reports() -> None:
    assert report_problems(PAGE.read_text(), PAGE.parent, ROOT) == []


def test_the_history_page_names_each_table_s_commit() -> None:
    assert report_problems(HISTORY.read_text(), HISTORY.parent, ROOT, history=True) == []


GOOD_LINE = (
    "Measured 2026-12-03 at {commit} on AMD EPYC, 2 cores, 24 GiB; python 3.11.7, torch 2.13.0+cpu,\n"
    "lightning 2.6.6: `python benchmarks/step_time.py --model small`"
)


@pytest.fixture
def page(tmp_path: Path) -> tuple[Path, str]:
    """A docs folder with one raw result written by record.py, and a page that quotes it correctly."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    commit = head.stdout.strip() or "0000000"
    line = GOOD_LINE.format(commit=commit)
    raw = tmp_path / "results" / "2026-12-03" / "st.txt"
    raw.parent.mkdir(parents=True)
    raw.write_text(" ".join(line.split()) + "\nstarted ...\n")
    text = f"# P\n\n## Step time\n\n{line}\nRaw: [st.txt](results/2026-12-03/st.txt).\n\n| a |\n| --- |\n"
    text += "\nOlder figures: [history](performance-history.md).\n"
    return tmp_path, text


def test_the_rules_hold_for_a_good_page(page: tuple[Path, str]) -> None:
    docs, text = page
    assert report_problems(text, docs, ROOT) == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda t: t.replace("Measured 2026-12-03", "Measured on 2026-12-03"), "without a provenance line"),
        (
            lambda t: t.replace("| a |\n| --- |\n", "| a |\n| --- |\n\nAnd more.\n\n| c |\n| --- |\n"),
            "without a provenance",
        ),
        (lambda t: t.replace("lightning 2.6.6", "lightning 2.6.7"), "which the page does not quote"),
        (lambda t: t.replace("results/2026-12-03/st.txt", "results/2026-12-03/gone.txt"), "do not exist"),
        (lambda t: t.replace("Raw: [st.txt](results/2026-12-03/st.txt).", ""), "no link to its raw results"),
        (lambda t: t.replace("benchmarks/step_time.py", "benchmarks/no_such.py"), "names no script"),
        (
            lambda t: t.replace(
                "\n\n| a |", "\n\n" + t.split("\n\n")[2].replace("small", "large") + "\n\n| a |"
            ),
            "quotes no raw output it links",
        ),
        (
            lambda t: t.replace("(performance-history.md)", "(performance.md)"),
            "no link to performance-history",
        ),
    ],
)
def test_each_rule_fails_a_page_that_breaks_it(
    page: tuple[Path, str], change: Callable[[str], str], expected: str
) -> None:
    docs, text = page
    problems = report_problems(change(text), docs, ROOT)
    assert any(expected in p for p in problems), problems


def test_an_unknown_commit_is_named(tmp_path: Path) -> None:
    """In a repository of its own (so that it runs wherever git does, history or not in this
    checkout): its own commit passes, one that is not an ancestor of its HEAD is named."""
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    (repo / "benchmarks" / "step_time.py").write_text("")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "one"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    own = subprocess.run([*git, "rev-parse", "--short", "HEAD"], check=True, capture_output=True, text=True)
    text = "# P\n\n## Old\n\nRecorded in `{}`.\n\n| b |\n| --- |\n"
    assert report_problems(text.format(own.stdout.strip()), tmp_path, repo, history=True) == []
    problems = report_problems(text.format("deadbee"), tmp_path, repo, history=True)
    assert problems == ["'Old': commit deadbee is not in this repository"], problems


def test_a_history_table_without_its_commit_fails() -> None:
    text = "# P\n\n## Old\n\nRecorded in `{}`.\n\n| b |\n| --- |\n"
    problems = report_problems(text.replace("Recorded in", "Written in"), ROOT, ROOT, history=True)
    assert any("without 'Recorded in" in p for p in problems), problems


@pytest.mark.parametrize("change", list(STAGE3_SCHEDULE_CHANGES))
def test_a_stage3_report_measured_before_a_schedule_change_says_so(change: str) -> None:
    """A zero3 row measured at f8bcc40 (2026-12-03) predates both changes of stage 3's schedule."""
    if _before(change, "f8bcc40", ROOT) is None:
        pytest.skip("no git history here to order the commits")
    said = " ".join(f"measured before `{c}`" for c in STAGE3_SCHEDULE_CHANGES)
    text = f"{GOOD_LINE.format(commit='f8bcc40')}\n\n`zero3` rows, {said}.\n"
    assert _schedule_problems("Step time", _flat(text.splitlines()), ["f8bcc40"], ROOT) == []
    unsaid = text.replace(f"measured before `{change}`", "")
    problems = _schedule_problems("Step time", _flat(unsaid.splitlines()), ["f8bcc40"], ROOT)
    assert [p for p in problems if change in p], problems
