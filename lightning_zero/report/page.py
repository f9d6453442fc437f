"""``write_report``: a step profile as a Markdown page with PNG charts, and its three-line summary.

The page (``step_report.md``) opens with the summary (:func:`~lightning_zero.report.rules.summary`),
then one section per question: the step's parts per rank (milliseconds), throughput, exposed
communication and bytes per collective, memory by kind against the estimate, and every rule of the
table with its finding. A figure the profile does not hold is written "not measured".

The report writes only its own files (:data:`FILES`) into its directory; a file of one of those names
that it did not write (a page without :data:`MARK` on its first line, or a chart that page does not
list) is never replaced: :class:`~lightning_zero.report.profile.ReportError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lightning_zero.report import charts
from lightning_zero.report.profile import (
    PARTS,
    THROUGHPUT,
    Profile,
    ReportError,
    find_profile,
    label,
    load_profile,
)
from lightning_zero.report.rules import RULES, pct, summary

PAGE = "step_report.md"
CHARTS = {
    "step_parts.png": charts.step_parts,
    "comm_share.png": charts.comm_share,
    "memory.png": charts.memory,
    "collectives.png": charts.collectives,
}
FILES = (PAGE, *CHARTS)
MARK = "<!-- lightning-zero report:"
NOT_MEASURED = "not measured"


@dataclass
class Report:
    """What :func:`write_report` wrote."""

    profile: Profile
    page: Path
    charts: list[Path]
    summary: list[str]


def write_report(run_dir: Path, out: Path | None = None) -> Report:
    """Find the step profile under ``run_dir`` (:func:`find_profile`), write the page and its charts
    into ``out`` (default: the profile's directory).

    Raises:
        ReportError: no profile, an unreadable one, or a file in ``out`` of the report's names that the
            report did not write.
        ModuleNotFoundError: matplotlib is missing.
    """
    charts.require_matplotlib()
    profile = load_profile(find_profile(run_dir))
    out = profile.path.parent if out is None else out
    _check_own(out)
    out.mkdir(parents=True, exist_ok=True)
    drawn = [name for name in CHARTS if name != "collectives.png" or profile.comm_kinds()]
    for name in drawn:
        CHARTS[name](profile, out / name)
    lines = summary(profile)
    page = out / PAGE
    page.write_text(markdown(profile, lines, drawn, out))
    return Report(profile, page, [out / name for name in drawn], lines)


def _check_own(out: Path) -> None:
    """Refuse when ``out`` holds a file of the report's names that an earlier report did not write."""
    page = out / PAGE
    head = page.read_text().split("\n", 1)[0] if page.is_file() else ""
    own = set(head.removeprefix(MARK).removesuffix("-->").split()) if head.startswith(MARK) else set()
    foreign = [out / name for name in FILES if (out / name).exists() and name not in own]
    if foreign:
        raise ReportError(
            f"not replacing {', '.join(map(str, foreign))}: not written by lightning-zero report "
            "(choose another directory with --out)"
        )


def markdown(profile: Profile, lines: list[str], drawn: list[str], out: Path) -> str:
    """The page (see the module docstring); ``drawn``: the charts written beside it in ``out``."""
    first, last = profile.steps
    text = [
        f"{MARK} {' '.join([PAGE, *drawn])} -->",
        "# Step profile",
        "",
        f"From `{_where(profile.path, out)}`: optimizer steps {first} to {last}, {len(profile.ranks)} ranks"
        + (", pipeline schedule" if profile.pipeline else "")
        + "."
        + _picked(profile),
        "",
        *(f"> {line}  " for line in lines),
        "",
        *_step(profile),
        *_throughput(profile),
        *_communication(profile, "collectives.png" in drawn),
        *_memory(profile),
        *_rules(profile),
    ]
    return "\n".join(text).rstrip() + "\n"


def _picked(profile: Profile) -> str:
    shown = profile.shown_ranks()
    if len(shown) == len(profile.ranks):
        return ""
    return (
        f" Shown: ranks {', '.join(str(r.rank) for r in shown)} (the first, the fastest, the slowest) of "
        f"{len(profile.ranks)}; every rank's figures are in the JSON, the summary's means are over all."
    )


def _where(path: Path, out: Path) -> str:
    """``path`` as the page names it: relative to the page's directory when it is below it."""
    return (
        str(path.resolve().relative_to(out.resolve()))
        if path.resolve().is_relative_to(out.resolve())
        else str(path)
    )


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return out + ["| " + " | ".join(row) + " |" for row in rows] + [""]


def _ms(seconds: float | None) -> str:
    return NOT_MEASURED if seconds is None else f"{1e3 * seconds:.3f}"


def _mib(nbytes: int | None) -> str:
    return NOT_MEASURED if nbytes is None else f"{nbytes / charts.MIB:.3f}"


SHARES = {
    "comm_exposed_s": "exposed communication",
    "gather_wait_s": "gather wait",
    "pipeline_idle_s": "pipeline idle",
    "host_s": "host in our code",
}
"""Figures that are shares of the parts, not parts, and their columns (pipeline idle: under a pipeline)."""


def _step(profile: Profile) -> list[str]:
    shares = [k for k in SHARES if k != "pipeline_idle_s" or profile.pipeline]
    header = ["rank", "step", *(label(p) for p in PARTS), *(SHARES[k] for k in shares)]
    rows = [
        [str(r.rank), *(_ms(r.mean.get(k)) for k in ("step_s", *PARTS, *shares))]
        for r in profile.shown_ranks()
    ]
    return [
        "## The step (milliseconds, mean over the window)",
        "",
        *_table(header, rows),
        "The parts add up to the step; exposed communication is a share of them (the host waited on "
        "collectives), the wait for parameter all-gathers (stage 3: the units) a share of that. "
        + (
            "Pipeline idle is the share of `pipeline` outside this rank's stages' own work. "
            if profile.pipeline
            else ""
        )
        + "Host in our code is the host's time in lightning-zero's code, its waits apart (on a CPU with the "
        "work that code runs; on CUDA the Python and the launches). By busy "
        f"time (step minus exposed communication) rank {profile.slowest_rank} is the slowest and rank "
        f"{profile.fastest_rank} the fastest: {profile.slowest_over_fastest:.3f}x.",
        "",
        "![where the step goes](step_parts.png)",
        "",
    ]


def _throughput(profile: Profile) -> list[str]:
    t = profile.throughput
    if t is None:
        return ["## Throughput", "", f"{NOT_MEASURED} (the profile has no `throughput`).", ""]
    keys = [*THROUGHPUT, *(k for k in t if k not in THROUGHPUT)]
    rows = [[f"`{k}`", NOT_MEASURED if t.get(k) is None else _value(t[k])] for k in keys]
    return ["## Throughput", "", *_table(["figure", "value"], rows)]


def _value(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _communication(profile: Profile, drawn: bool) -> list[str]:
    ranks = profile.shown_ranks()
    rows = [
        [
            str(r.rank),
            _ms(r.mean["comm_exposed_s"]),
            pct(r.mean["comm_exposed_s"] / (r.mean["step_s"] or 1.0)),
        ]
        for r in ranks
    ]
    text = [
        "## Communication",
        "",
        *_table(["rank", "exposed (ms)", "of the step"], rows),
        "![exposed communication against the rule's line](comm_share.png)",
        "",
        "Bytes per collective kind and group over the window (MiB, count):",
        "",
    ]
    if not drawn:
        return [*text, f"{NOT_MEASURED} (the profile has no `ranks[i].comm`).", ""]
    header = ["collective", *(f"rank {r.rank} MiB" for r in ranks), *(f"rank {r.rank} count" for r in ranks)]
    table = [
        [
            key,
            *(_mib(r.comm[key]["bytes"]) if key in r.comm else NOT_MEASURED for r in ranks),
            *(str(r.comm[key]["count"]) if key in r.comm else NOT_MEASURED for r in ranks),
        ]
        for key in profile.comm_kinds()
    ]
    return [*text, *_table(header, table), "![bytes per collective](collectives.png)", ""]


def _memory(profile: Profile) -> list[str]:
    estimate, ranks = profile.estimate or {}, profile.shown_ranks()
    kinds = [*profile.memory_kinds(), "peak_bytes"]
    header = ["kind", *(f"rank {r.rank}" for r in ranks), "estimate"]
    rows = [[f"`{k}`", *(_mib(r.memory.get(k)) for r in ranks), _mib(estimate.get(k))] for k in kinds]
    rows.append(["the engine holds", *(_mib(r.engine_bytes()) for r in ranks), ""])
    rows.append(["the rest of the peak", *(_mib(r.rest_bytes()) for r in ranks), ""])
    return [
        "## Memory (MiB)",
        "",
        *_table(header, rows),
        f'`peak_bytes` is `{ranks[0].peak_kind}`; "the engine holds" adds parameters, gradient '
        "shards, optimizer state, the most gathered units and the larger of the wire pool and the "
        'accumulation buffers\' peak; "the rest of the peak" is the peak less that and the activations '
        "(the allocator's other tensors on CUDA; on a CPU the process's Python and torch too)."
        + ("" if estimate else f" Estimate: {NOT_MEASURED} (the profile has no `estimate`)."),
        "",
        "![memory by kind against the estimate](memory.png)",
        "",
    ]


def _rules(profile: Profile) -> list[str]:
    rows, fired = [], False
    for number, rule in enumerate(RULES, 1):
        finding = rule.finding(profile)
        status = "-" if finding is None else ("**first**: " if not fired else "also: ") + finding
        fired = fired or finding is not None
        rows.append([str(number), rule.name, rule.when, status])
    return [
        "## Rules, in order",
        "",
        "The first rule that fires is the summary's last line (what to change: `docs/report.md`).",
        "",
        *_table(["#", "rule", "fires when", "here"], rows),
    ]
