"""``lightning-zero report``: a step profile's page and charts hold the profile's figures.

The charts are read back as pixels: bars are drawn edge-free, without antialiasing, in fixed colours
on white (``lightning_zero/report/charts.py``), so a segment's height or a bar's length in pixels over
another's is the ratio of their figures (within a few %, a pixel of rounding at each end). The page's
tables are parsed and compared with the JSON at their printed precision. The rule the summary names
is checked on one crafted profile per rule, and the docs' rule table (``docs/report.md``) against the
code's. Every profile here is made by hand; ``tests/distributed/test_step_profile.py`` runs
:func:`check_report` on the ones a 2-rank fit writes.
"""

from __future__ import annotations

import ast
import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_zero import cli
from lightning_zero.report import PROFILE_FILE, RULES, ReportError, charts, find_profile, write_report
from lightning_zero.report.page import FILES, PAGE
from lightning_zero.report.profile import PARTS

ROOT = Path(__file__).resolve().parents[2]
MEMORY = [
    f"{kind}_bytes" for kind in "param grad_shard state pool peak_accumulating gathered gathered_peak".split()
]
"""The engine's kinds as the profiler writes them (the report takes whatever kinds the file holds)."""
MIB = 2**20
TOLERANCE = 0.03  # of the largest bar


def rank_row(rank: int, scale: float = 1.0) -> dict[str, Any]:
    mean = {
        "data_wait_s": 0.02 * scale,
        "forward_s": 0.30 * scale,
        "backward_s": 0.45 * scale,
        "pipeline_s": 0.0,
        "optimizer_s": 0.15 * scale,
        "other_s": 0.08 * scale,
    }
    mean["step_s"] = sum(mean.values())
    mean["comm_exposed_s"] = 0.05 * scale
    memory = {k: (i + 1) * 3 * MIB + rank * MIB // 2 for i, k in enumerate(MEMORY)}
    memory.update(peak_bytes=900 * MIB, peak_kind="process_max_rss")
    steps = [{"step": s, **mean} for s in (1, 2)]
    return {"rank": rank, "mean": mean, "steps": steps, "memory": memory}


def profile_json(**top: Any) -> dict[str, Any]:
    """A format-1 profile of 2 ranks (rank 1 a little slower), ``top`` laid over its top level."""
    data = {
        "format": 1,
        "steps": [1, 2],
        "pipeline": False,
        "world_size": 2,
        "ranks": [rank_row(0), rank_row(1, 1.05)],
        "slowest_rank": 1,
        "fastest_rank": 0,
        "slowest_over_fastest": 1.05,
    }
    return {**data, **top}


def with_optional(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with every optional field: throughput, estimate, gather waits, collectives."""
    data = copy.deepcopy(data)
    data["throughput"] = {
        "tokens_per_step": 16384,
        "tokens_per_s": 18000.5,
        "tokens_per_s_per_device": 9000.25,
        "flops_per_token": 6.5e7,
        "flops_formula": "6N + 12 L d s",
        "achieved_tflops_per_device": 0.585,
        "peak_tflops_per_device": None,
        "peak_source": "unknown device",
        "mfu": None,
    }
    data["estimate"] = {  # a subset of the kinds, and one the profile does not measure
        "param_bytes": 4 * MIB,
        "grad_shard_bytes": 5 * MIB,
        "state_bytes": 10 * MIB,
        "activation_bytes": 7 * MIB,
    }
    for index, rank in enumerate(data["ranks"]):
        rank["mean"]["gather_wait_s"] = rank["mean"]["comm_exposed_s"] * (0.4 + 0.2 * (index % 2))
        rank["mean"]["host_s"] = 0.0625 * (index + 1)
        rank["memory"]["activation_bytes"] = (6 + index) * MIB
        rank["comm"] = {
            "reduce_scatter data": {"count": 8, "bytes": (40 + index) * MIB},
            "all_gather data": {"count": 8, "bytes": 20 * MIB},
            "all_reduce data": {"count": 2, "bytes": MIB},
        }
    return data


def write_profile(folder: Path, data: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / PROFILE_FILE).write_text(json.dumps(data))
    return folder


# reading the charts back ------------------------------------------------------------------------------


def shown(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The ranks a report shows: all of up to 8, else the first, the fastest and the slowest."""
    ranks = data["ranks"]
    picked = {ranks[0]["rank"], data["fastest_rank"], data["slowest_rank"]}
    return ranks if len(ranks) <= 8 else [r for r in ranks if r["rank"] in picked]


def pixels(path: Path) -> np.ndarray:
    import matplotlib.image

    return (matplotlib.image.imread(str(path))[..., :3] * 255).round().astype(np.uint8)  # (H, W, 3)


def where(image: np.ndarray, color: str) -> np.ndarray:
    rgb = [int(color[i : i + 2], 16) for i in (1, 3, 5)]
    return (image == np.array(rgb, dtype=np.uint8)).all(axis=-1)  # (H, W)


def runs(flags: np.ndarray, least: int = 1) -> list[tuple[int, int]]:
    """``[(first, last), ...]`` of the runs of True at least ``least`` long."""
    found, start = [], None
    for i, flag in enumerate([*flags.tolist(), False]):
        if flag and start is None:
            start = i
        if not flag and start is not None:
            if i - start >= least:
                found.append((start, i - 1))
            start = None
    return found


def vertical_bars(image: np.ndarray, colors: list[str]) -> list[dict[str, int]]:
    """Left to right, each bar's middle column: the pixels of each colour (legend swatches, narrow,
    left out)."""
    masks = {c: where(image, c) for c in colors}
    any_color = np.logical_or.reduce(list(masks.values()))
    bars = runs(any_color.sum(axis=0) > 0, least=40)
    return [{c: int(m[:, (a + b) // 2].sum()) for c, m in masks.items()} for a, b in bars]


def horizontal_lengths(image: np.ndarray, color: str) -> list[int]:
    """Top to bottom, the length of each bar of ``color`` in its middle row; the legend's swatch (the
    last run: every legend is below the bars) left out."""
    mask = where(image, color)
    return [int(mask[(a + b) // 2].sum()) for a, b in runs(mask.sum(axis=1) > 0)][:-1]


def assert_proportional(measured: list[int], figures: list[float], what: str) -> None:
    """Bars of ``measured`` pixels show ``figures`` (0 draws nothing) to within TOLERANCE of the largest;
    the largest bar gives the scale."""
    scale = max(measured) / max(figures)
    drawn = [f for f in figures if f * scale >= 2]  # a bar under 2 pixels may or may not show
    measured = [m for m in measured if m > 2]
    assert len(measured) == len(drawn), (what, measured, figures)
    for pixel, figure in zip(measured, drawn, strict=True):
        assert abs(pixel - figure * scale) <= TOLERANCE * max(measured) + 1, (what, measured, drawn)


def check_charts(data: dict[str, Any], out: Path) -> None:
    """Every chart in ``out`` shows ``data``'s figures."""
    ranks = shown(data)
    bars = vertical_bars(pixels(out / "step_parts.png"), list(charts.PART_COLORS.values()))
    assert len(bars) == len(ranks)
    tallest = max(sum(b.values()) for b in bars)
    longest = max(r["mean"]["step_s"] for r in ranks)
    for bar, rank in zip(bars, ranks, strict=True):
        for part in PARTS:
            pixel, seconds = bar[charts.PART_COLORS[part]], rank["mean"][part]
            assert abs(pixel / tallest - seconds / longest) <= TOLERANCE, (rank["rank"], part, bar)
    check_comm_share(data, pixels(out / "comm_share.png"))
    check_memory(data, pixels(out / "memory.png"))
    if any(r.get("comm") for r in ranks):
        image = pixels(out / "collectives.png")
        keys = sorted({k for r in ranks for k in r.get("comm", {})})
        for index, rank in enumerate(ranks):
            figures = [rank.get("comm", {}).get(k, {}).get("bytes", 0) for k in keys]
            assert_proportional(horizontal_lengths(image, charts.rank_color(index)), figures, "collectives")
    else:
        assert not (out / "collectives.png").exists()


def check_comm_share(data: dict[str, Any], image: np.ndarray) -> None:
    """Each rank's bar top over the rule's line: its share over COMM_SHARE."""
    line = where(image, charts.LINE_COLOR)
    row = float(np.mean(np.nonzero(line.sum(axis=1) > 0.5 * line.sum(axis=1).max())[0]))
    colored = where(image, charts.COMM_COLOR) | where(image, charts.GATHER_COLOR)
    bars = runs(colored.sum(axis=0) > 0, least=40)
    ranks = shown(data)
    assert len(bars) == len(ranks) or all(r["mean"]["comm_exposed_s"] == 0 for r in ranks)
    for (a, b), rank in zip(bars, ranks, strict=False):
        column = np.nonzero(colored[:, (a + b) // 2])[0]
        top, base = column.min(), column.max() + 1  # the bar's top edge and the axis
        share = charts.COMM_SHARE * (base - top) / (base - row - 0.5)
        expected = rank["mean"]["comm_exposed_s"] / rank["mean"]["step_s"]
        assert abs(share - expected) <= 0.01 + TOLERANCE * expected, (rank["rank"], share, expected)
        gather = int(where(image, charts.GATHER_COLOR)[:, (a + b) // 2].sum())
        of_it = rank["mean"].get("gather_wait_s", 0.0) / rank["mean"]["comm_exposed_s"]
        assert abs(gather - of_it * (base - top)) <= 1.5 + TOLERANCE * (base - top), (
            gather,
            of_it,
            base - top,
        )


def check_memory(data: dict[str, Any], image: np.ndarray) -> None:
    """The top panel's bars by kind (each rank's, the estimate's), then each rank's peak and engine total."""
    estimate = data.get("estimate") or {}
    held = list(
        dict.fromkeys(k for r in shown(data) for k in r["memory"] if k not in ("peak_bytes", "peak_kind"))
    )
    kinds = [  # the file's order, then the estimate's others; those 0 everywhere are not drawn
        k
        for k in (*held, *sorted(set(estimate) - set(held)))
        if any(r["memory"].get(k, 0) for r in shown(data)) or estimate.get(k, 0)
    ]
    for index, rank in enumerate(shown(data)):
        lengths = horizontal_lengths(image, charts.rank_color(index))
        figures = [rank["memory"].get(k, 0) for k in kinds]
        count = len([f for f in figures if f > 0])
        assert_proportional(lengths[:count], figures, f"memory of rank {rank['rank']}")
        assert_proportional(lengths[count:], [rank["memory"]["peak_bytes"], engine_bytes(rank)], "peaks")
    if estimate:
        lengths = horizontal_lengths(image, charts.ESTIMATE_COLOR)
        assert_proportional(lengths, [estimate.get(k, 0) for k in kinds], "estimate")


def engine_bytes(rank: dict[str, Any]) -> int:
    m = rank["memory"]
    held = m["param_bytes"] + m["grad_shard_bytes"] + m["state_bytes"]
    return (
        held
        + max(m["gathered_peak_bytes"], m["gathered_bytes"])
        + max(m["pool_bytes"], m["peak_accumulating_bytes"])
    )


# reading the page back --------------------------------------------------------------------------------


def tables(page: str) -> dict[str, list[dict[str, str]]]:
    """Each Markdown table under its section's heading: a list of rows, ``{header: cell}``."""
    found: dict[str, list[dict[str, str]]] = {}
    section, header = "", None
    for line in page.splitlines():
        if line.startswith("#"):
            section, header = line.lstrip("# "), None
        elif line.startswith("|") and not line.startswith("| ---") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if header is None:
                header = cells
                found.setdefault(section, [])
            else:
                found[section].append(dict(zip(header, cells, strict=True)))
        elif not line.startswith("|"):
            header = None
    return found


def check_page(data: dict[str, Any], out: Path) -> None:
    """The page's tables hold ``data``'s figures at their printed precision; absent ones "not measured"."""
    found = tables((out / PAGE).read_text())
    step = found["The step (milliseconds, mean over the window)"]
    for row, rank in zip(step, shown(data), strict=True):
        assert row["rank"] == str(rank["rank"])
        for key, header in [
            ("step_s", "step"),
            *((p, p[:-2].replace("_", " ")) for p in PARTS),
            ("comm_exposed_s", "exposed communication"),
            ("gather_wait_s", "gather wait"),
            ("host_s", "host in our code"),
            *([("pipeline_idle_s", "pipeline idle")] if data["pipeline"] else []),
        ]:
            if key in rank["mean"]:
                assert abs(float(row[header]) - 1e3 * rank["mean"][key]) <= 5e-4, (key, row)
            else:
                assert row[header] == "not measured"
    memory = found["Memory (MiB)"]
    estimates = data.get("estimate") or {}
    for row in memory[:-2]:
        key = row["kind"].strip("`")
        for figures, header in [
            *((r["memory"], f"rank {r['rank']}") for r in shown(data)),
            (estimates, "estimate"),
        ]:
            if key in figures:
                assert abs(float(row[header]) * MIB - figures[key]) <= 5e-4 * MIB, (key, row)
            else:
                assert row[header] == "not measured", (key, row)
    held = {k for r in shown(data) for k in r["memory"] if k != "peak_kind"}
    assert {r["kind"].strip("`") for r in memory[:-2]} == held | set(estimates)
    assert [r["kind"] for r in memory[-2:]] == ["the engine holds", "the rest of the peak"]
    for rank in shown(data):
        held = engine_bytes(rank)
        assert abs(float(memory[-2][f"rank {rank['rank']}"]) * MIB - held) <= 5e-4 * MIB
        rest = rank["memory"]["peak_bytes"] - held - rank["memory"].get("activation_bytes", 0)
        assert abs(float(memory[-1][f"rank {rank['rank']}"]) * MIB - rest) <= 5e-4 * MIB
    communication = found["Communication"]
    for row, rank in zip(communication[: len(shown(data))], shown(data), strict=True):
        assert abs(float(row["exposed (ms)"]) - 1e3 * rank["mean"]["comm_exposed_s"]) <= 5e-4
    collectives = communication[len(shown(data)) :]
    keys = sorted({k for r in shown(data) for k in r.get("comm", {})})
    assert [r["collective"] for r in collectives] == keys
    for row in collectives:
        for rank in shown(data):
            sent = rank["comm"][row["collective"]]
            assert int(row[f"rank {rank['rank']} count"]) == sent["count"]
            assert abs(float(row[f"rank {rank['rank']} MiB"]) * MIB - sent["bytes"]) <= 5e-4 * MIB
    throughput = data.get("throughput")
    text = (out / PAGE).read_text()
    if throughput is None:
        assert "## Throughput\n\nnot measured" in text
    else:
        rows = {r["figure"].strip("`"): r["value"] for r in found["Throughput"]}
        for key, value in throughput.items():
            if value is None:
                assert rows[key] == "not measured"
            elif isinstance(value, str):
                assert rows[key] == value
            else:
                assert float(rows[key].replace(",", "")) == pytest.approx(value, rel=1e-3)


def check_report(data: dict[str, Any], out: Path) -> None:
    check_page(data, out)
    check_charts(data, out)


# the tests --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optional", [False, True], ids=["format1", "every_optional_field"])
def test_the_page_and_charts_hold_the_profiles_figures(tmp_path: Path, optional: bool) -> None:
    data = with_optional(profile_json()) if optional else profile_json()
    report = write_report(write_profile(tmp_path / "run", data))
    assert report.page == tmp_path / "run" / PAGE
    assert len(report.charts) == (4 if optional else 3)
    check_report(data, tmp_path / "run")
    assert all(p.stat().st_size < 100_000 for p in report.charts)


def test_larger_shares_measure_too(tmp_path: Path) -> None:
    """A communication-bound step (above the rule's line) and unequal ranks."""
    data = with_optional(profile_json())
    data["ranks"][0]["mean"].update(comm_exposed_s=0.45, gather_wait_s=0.3)
    data["ranks"][1]["mean"].update(forward_s=0.6, other_s=0.0)
    data["ranks"][1]["mean"]["step_s"] = sum(data["ranks"][1]["mean"][p] for p in PARTS)
    write_report(write_profile(tmp_path, data))
    check_report(data, tmp_path)


def test_past_eight_ranks_the_first_the_fastest_and_the_slowest_are_shown(tmp_path: Path) -> None:
    data = with_optional(profile_json(ranks=[rank_row(r, 1 + r / 100) for r in range(12)]))
    data.update(slowest_rank=11, fastest_rank=4, slowest_over_fastest=1.1)
    write_report(write_profile(tmp_path, data))
    check_report(data, tmp_path)
    page = (tmp_path / PAGE).read_text()
    assert "Shown: ranks 0, 4, 11 (the first, the fastest, the slowest) of 12;" in page
    assert "(mean of 12 ranks, steps 1-2)" in page


def summary_of(tmp_path: Path, data: dict[str, Any]) -> list[str]:
    return write_report(write_profile(tmp_path, data)).summary


def shares(comm: float = 0.05, data_wait: float = 0.02) -> list[dict[str, Any]]:
    """Two equal ranks whose step is 1 s, with these shares of exposed communication and data wait."""
    ranks = [rank_row(0), rank_row(1)]
    for rank in ranks:
        rank["mean"].update(
            data_wait_s=data_wait,
            forward_s=0.3,
            backward_s=0.5,
            optimizer_s=0.1,
            other_s=0.1 - data_wait,
            step_s=1.0,
            comm_exposed_s=comm,
        )
    return ranks


def device_peak(factor: float, **mean: float) -> list[dict[str, Any]]:
    """Two ranks on CUDA whose device peak is ``factor`` x what their engines hold; ``mean`` laid over
    their means."""
    ranks = shares()
    for rank in ranks:
        held = engine_bytes(rank)
        rank["memory"].update(peak_bytes=int(factor * held), peak_kind="cuda_max_memory_allocated")
        rank["mean"].update(mean)
    return ranks


def idle(share: float) -> list[dict[str, Any]]:
    """Two ranks whose step is a pipeline schedule, idle ``share`` of the step."""
    ranks = shares()
    for rank in ranks:
        rank["mean"].update(forward_s=0.0, backward_s=0.0, pipeline_s=0.8, pipeline_idle_s=share)
    return ranks


CASES = {
    "exposed communication": ({"ranks": shares(comm=0.41)}, "exposed communication is 41.0 % of the step"),
    "data wait": ({"ranks": shares(data_wait=0.15)}, "the data wait is 15.0 % of the step"),
    "unbalanced ranks": (
        {"ranks": shares(), "slowest_over_fastest": 1.25},
        "rank 1's busy time is 1.25x rank 0's",
    ),
    "pipeline bubble": (
        {"ranks": idle(0.25), "slowest_over_fastest": 1.0, "pipeline": True},
        "the pipeline stages are idle 25.0 % of the step",
    ),
    "pipeline bubble: a profile without the idle time": (
        {"ranks": shares(), "slowest_over_fastest": 1.0, "pipeline": True},
        "the step runs a pipeline schedule (0.0 % of it), whose bubble is idle time (not measured",
    ),
    "host-bound": (
        {"ranks": device_peak(3.0, host_s=0.35), "slowest_over_fastest": 1.0},
        "the host spends 35.0 % of the step in lightning-zero's code",
    ),
    "activations": (
        {"ranks": device_peak(3.0), "slowest_over_fastest": 1.0},
        "peak memory is 3.0x what the engine holds",
    ),
    "compute-bound": ({"ranks": device_peak(1.5), "slowest_over_fastest": 1.0}, "compute-bound"),
}


@pytest.mark.parametrize("rule", list(CASES))
def test_the_summary_names_the_first_rule_that_fires(tmp_path: Path, rule: str) -> None:
    top, finding = CASES[rule]
    lines = summary_of(tmp_path, profile_json(**top))
    rule = rule.split(":")[0]
    look = next(r.look for r in RULES if r.name == rule)
    assert len(lines) == 3 and lines[0].startswith("step 1 s (mean of 2 ranks, steps 1-2)")
    assert lines[2].startswith("look at first: ") and finding in lines[2] and lines[2].endswith(look)
    fired = [
        row for row in tables((tmp_path / PAGE).read_text())["Rules, in order"] if "first" in row["here"]
    ]
    assert [row["rule"] for row in fired] == [rule]


def test_rules_are_checked_in_order_and_a_process_peak_is_not_activations(tmp_path: Path) -> None:
    both = profile_json(ranks=shares(comm=0.35, data_wait=0.2), slowest_over_fastest=1.3)
    assert "exposed communication is 35.0 %" in summary_of(tmp_path / "a", both)[2]
    rss = profile_json(ranks=device_peak(10.0, host_s=0.9), slowest_over_fastest=1.0)
    for rank in rss["ranks"]:
        rank["memory"]["peak_kind"] = "process_max_rss"  # Python and torch are in it: not compared
    assert "compute-bound" in summary_of(tmp_path / "b", rss)[2]  # nor a CPU's host time (its kernels)
    small = profile_json(ranks=idle(0.2), slowest_over_fastest=1.0, pipeline=True)  # at the line: fine
    assert "compute-bound" in summary_of(tmp_path / "c", small)[2]


def test_the_first_two_lines(tmp_path: Path) -> None:
    data = with_optional(profile_json(ranks=shares(comm=0.05)))
    data["throughput"]["mfu"] = 0.123
    line1, line2, _ = summary_of(tmp_path, data)
    assert line1 == "step 1 s (mean of 2 ranks, steps 1-2); 18,000 tokens/s, MFU 12.3 %"
    assert line2 == (
        "where it goes: backward 50.0 %, forward 30.0 %, optimizer 10.0 %; exposed communication 5.0 % "
        "(within those)"
    )
    assert "tokens/s and MFU not measured" in summary_of(tmp_path / "b", profile_json())[0]


def test_the_docs_rule_table_is_the_codes() -> None:
    page = (ROOT / "docs" / "report.md").read_text()
    rows = tables(page)["Rules"]
    assert [(r["#"], r["rule"], r["fires when"], r["look at"]) for r in rows] == [
        (str(i), r.name, r.when, r.look) for i, r in enumerate(RULES, 1)
    ]


def test_the_profile_is_found_in_a_runs_newest_version_dir(tmp_path: Path) -> None:
    old = write_profile(tmp_path / "logs" / "version_0", profile_json())
    new = write_profile(tmp_path / "logs" / "version_1", profile_json())
    os.utime(old / PROFILE_FILE, (1, 1))
    assert find_profile(tmp_path) == new / PROFILE_FILE
    assert find_profile(old) == old / PROFILE_FILE
    assert find_profile(old / PROFILE_FILE) == old / PROFILE_FILE


def test_a_run_dir_without_a_profile_is_an_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "logs" / "version_0").mkdir(parents=True)
    with pytest.raises(ReportError, match=f"no {PROFILE_FILE} under {tmp_path} \\(none found\\)") as error:
        find_profile(tmp_path)
    assert str(tmp_path / "*" / "version_*" / PROFILE_FILE) in str(error.value)
    assert cli.main(["report", str(tmp_path / "missing")]) == 1
    assert (
        f"FAIL no {PROFILE_FILE} under {tmp_path / 'missing'} (no such directory)" in capsys.readouterr().out
    )
    (tmp_path / PROFILE_FILE).write_text("{}")
    with pytest.raises(ReportError, match="not a readable step profile"):
        write_report(tmp_path)


def test_the_command_writes_where_told_and_replaces_only_its_own_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_profile(tmp_path / "run", profile_json())
    out = tmp_path / "out"
    assert cli.main(["report", str(run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("step ") and printed[2].startswith("look at first: ")
    assert sorted(p.name for p in out.iterdir()) == sorted(f for f in FILES if f != "collectives.png")
    assert cli.main(["report", str(run), "--out", str(out)]) == 0  # its own files: replaced
    (out / "step_parts.png").unlink()
    (out / PAGE).write_text("my notes\n")
    assert cli.main(["report", str(run), "--out", str(out)]) == 1
    assert "FAIL not replacing" in capsys.readouterr().out
    assert (out / PAGE).read_text() == "my notes\n" and not (out / "step_parts.png").exists()


def test_without_matplotlib_the_error_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # import raises ImportError
    run = write_profile(tmp_path, profile_json())
    with pytest.raises(ModuleNotFoundError, match="matplotlib") as error:
        write_report(run)
    assert error.value.name == "matplotlib"
    assert cli.main(["report", str(run)]) == 1 and "recipes` extra" in capsys.readouterr().out
    assert not (tmp_path / PAGE).exists()


def test_the_file_name_is_the_profilers() -> None:
    """The profiler's module, read as source (importing it imports Lightning: seconds)."""
    source = (ROOT / "lightning_zero" / "integrations" / "trainer" / "step_profile.py").read_text()
    assigned = [
        node.value.value
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["PROFILE_FILE"]
        and isinstance(node.value, ast.Constant)
    ]
    assert assigned == [PROFILE_FILE]
