"""The report's charts, drawn with matplotlib's file-only Agg backend into PNGs.

  * ``step_parts``: one stacked bar per rank, its segments the step's parts (seconds, mean over the
    window);
  * ``comm_share``: exposed communication as a share of each rank's step (the wait for parameter
    all-gathers stacked apart when measured), against the line at
    :data:`~lightning_zero.report.rules.COMM_SHARE`;
  * ``memory``: the engine's bytes by kind per rank beside the estimate (when the profile has one),
    then each rank's peak beside what the engine holds;
  * ``collectives``: bytes per collective kind and group, per rank (when measured).

Bars are drawn without edges or antialiasing in fixed colours (:data:`PART_COLORS`, :data:`RANK_COLORS`,
...) on white, legends outside the bars' rows or columns, so that a bar's pixels measure its figure: the
report's test reads the figures back from the PNGs. matplotlib is imported on first use
(:func:`require_matplotlib`): it is an optional package (the ``recipes`` extra).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning_zero.report.profile import PARTS, Profile, label
from lightning_zero.report.rules import COMM_SHARE

PART_COLORS = {
    "data_wait_s": "#e41a1c",
    "forward_s": "#377eb8",
    "backward_s": "#4daf4a",
    "pipeline_s": "#984ea3",
    "optimizer_s": "#ff7f00",
    "other_s": "#a65628",
}
COMM_COLOR = "#377eb8"
GATHER_COLOR = "#984ea3"
LINE_COLOR = "#e41a1c"
RANK_COLORS = ("#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666")
"""Ranks past the eighth share the last colour."""
ESTIMATE_COLOR = "#bcbd22"
PEAK_KINDS = ("peak_bytes", "engine_bytes")
MIB = 2**20
BAR = {"linewidth": 0, "antialiased": False}


def require_matplotlib() -> None:
    """Import matplotlib's Agg backend now.

    Raises:
        ModuleNotFoundError: matplotlib cannot be imported, naming the package and the extra.
    """
    try:
        import matplotlib.backends.backend_agg  # noqa: F401  (what the charts draw with)
    except ImportError as error:
        raise ModuleNotFoundError(
            f"the report draws its charts with matplotlib, which cannot be imported here ({error}); "
            "pip install matplotlib (or this package's `recipes` extra)",
            name="matplotlib",
        ) from error


def rank_color(index: int) -> str:
    return RANK_COLORS[min(index, len(RANK_COLORS) - 1)]


@contextmanager
def _figure(path: Path, rows: int = 1, height: float = 4.0) -> Iterator[Any]:
    """A white figure of ``rows`` axes (a list), saved to ``path`` as PNG and closed."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(rows, 1, figsize=(7, height), dpi=100, squeeze=False)
    try:
        yield figure, [a[0] for a in axes]
        figure.savefig(path, format="png", facecolor="white", bbox_inches="tight")
    finally:
        plt.close(figure)


def step_parts(profile: Profile, path: Path) -> None:
    """One stacked bar per rank: the step's parts, in seconds."""
    with _figure(path) as (figure, (axes,)):
        ranks = profile.shown_ranks()
        labels = [f"rank {r.rank}" for r in ranks]
        bottom = [0.0] * len(labels)
        for part in PARTS:
            values = [r.mean.get(part, 0.0) for r in ranks]
            if any(values):
                axes.bar(
                    labels, values, 0.6, bottom=bottom, color=PART_COLORS[part], label=label(part), **BAR
                )
                bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        axes.set_ylabel("seconds per optimizer step (mean)")
        axes.set_title(f"where the step goes, steps {profile.steps[0]}-{profile.steps[1]}")
        axes.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)


def comm_share(profile: Profile, path: Path) -> None:
    """Exposed communication as a % of each rank's step, against the :data:`COMM_SHARE` line."""
    with _figure(path) as (figure, (axes,)):
        ranks = profile.shown_ranks()
        labels = [f"rank {r.rank}" for r in ranks]
        comm = [100 * r.mean["comm_exposed_s"] / (r.mean["step_s"] or 1.0) for r in ranks]
        gather = [100 * r.mean.get("gather_wait_s", 0.0) / (r.mean["step_s"] or 1.0) for r in ranks]
        rest = [c - g for c, g in zip(comm, gather, strict=True)]
        name = "exposed communication" + (", the rest" if any(gather) else "")
        axes.bar(labels, rest, 0.6, color=COMM_COLOR, label=name, **BAR)
        if any(gather):
            axes.bar(
                labels, gather, 0.6, bottom=rest, color=GATHER_COLOR, label="of it: parameter gathers", **BAR
            )
        line = f"{COMM_SHARE:.0%} (the first rule's line)"
        axes.axhline(100 * COMM_SHARE, color=LINE_COLOR, linewidth=1, antialiased=False, label=line)
        axes.set_ylim(0, max(100 * COMM_SHARE, *comm) * 1.15)
        axes.set_ylabel("% of the step")
        axes.set_title("exposed communication (the host waited on collectives)")
        axes.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)


def memory_kinds(profile: Profile) -> list[str]:
    """The kinds the memory chart shows: :meth:`Profile.memory_kinds` but those 0 everywhere."""
    estimate = profile.estimate or {}
    ranks = profile.shown_ranks()
    return [k for k in profile.memory_kinds() if any(r.memory.get(k, 0) for r in ranks) or estimate.get(k, 0)]


def memory(profile: Profile, path: Path) -> None:
    """Top: MiB by kind, a bar per rank and the estimate's; bottom: each rank's peak and what the engine
    holds (:meth:`RankFigures.engine_bytes`)."""
    kinds, ranks = memory_kinds(profile), profile.shown_ranks()
    with _figure(path, rows=2, height=2.0 + 0.45 * len(kinds) * (len(ranks) + 1)) as (figure, axes):
        series: list[tuple[str, str, Sequence[float]]] = [
            (f"rank {r.rank}", rank_color(i), [r.memory.get(k, 0) / MIB for k in kinds])
            for i, r in enumerate(ranks)
        ]
        if profile.estimate:
            series.append(("estimate", ESTIMATE_COLOR, [profile.estimate.get(k, 0) / MIB for k in kinds]))
        _grouped(axes[0], [label(k) for k in kinds], series)
        axes[0].set_title("the engine's memory by kind (MiB)")
        peaks = [
            (f"rank {r.rank}", rank_color(i), [r.memory.get("peak_bytes", 0) / MIB, r.engine_bytes() / MIB])
            for i, r in enumerate(ranks)
        ]
        kind = ranks[0].peak_kind
        _grouped(axes[1], [f"peak ({kind})", "the engine holds"], peaks)
        axes[1].set_xlabel("MiB")
        figure.tight_layout(rect=(0, 0.06, 1, 1))
        figure.legend(
            *axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(series), frameon=False
        )


def collectives(profile: Profile, path: Path) -> None:
    """MiB per ``"<kind> <group>"`` over the window, a bar per rank."""
    keys, ranks = profile.comm_kinds(), profile.shown_ranks()
    with _figure(path, height=1.5 + 0.4 * len(keys) * len(ranks)) as (figure, (axes,)):
        series = [
            (f"rank {r.rank}", rank_color(i), [r.comm.get(k, {}).get("bytes", 0) / MIB for k in keys])
            for i, r in enumerate(ranks)
        ]
        _grouped(axes, keys, series)
        axes.set_xlabel(f"MiB over steps {profile.steps[0]}-{profile.steps[1]}")
        axes.set_title("bytes per collective kind and group")
        axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=len(series), frameon=False)


def _grouped(axes: Any, labels: Sequence[str], series: Sequence[tuple[str, str, Sequence[float]]]) -> None:
    """Horizontal bars, one group per label (top to bottom), one bar per series in each."""
    height = 0.8 / len(series)
    for index, (name, color, values) in enumerate(series):
        rows = [g + (index - (len(series) - 1) / 2) * height for g in range(len(labels))]
        axes.barh(rows, values, height * 0.85, color=color, label=name, **BAR)
    axes.set_yticks(range(len(labels)), labels)
    axes.invert_yaxis()
