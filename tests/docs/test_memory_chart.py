"""The memory table of ``docs/clusters.md`` is what ``scripts/memory_chart.py`` computes from
``lightning-zero estimate``'s own function now (so the page cannot drift from the command), and its
chart exists; the per-component split adds up to what ``estimate`` prints."""

from __future__ import annotations

import pytest

from lightning_zero.layout.memory import COMPONENTS, estimate_components, estimate_rows
from tests.docs.scripts import ROOT, load_script


def test_the_clusters_table_is_estimates() -> None:
    script = load_script("memory_chart")
    page = (ROOT / "docs" / "clusters.md").read_text()
    assert page == script.page(), "run python scripts/memory_chart.py"
    assert script.CHART.is_file()


@pytest.mark.parametrize("precision", ["bf16-true", "32-true"])
def test_components_add_up_and_shard_as_documented(precision: str) -> None:
    params, n, block = 7e9, 64, 2e8
    parts = estimate_components(params, n, precision, 25.0, block)
    totals = estimate_rows(params, n, precision, 25.0, block)
    for name, components in parts.items():
        assert list(components) == list(COMPONENTS)
        assert sum(components.values()) == totals[name]
    p_bytes = 2 if precision == "bf16-true" else 4
    assert parts["zero3"]["parameters"] == params * p_bytes / n  # sharded
    assert parts["zero2"]["parameters"] == params * p_bytes  # whole
    assert parts["zero2"]["optimizer state"] == parts["zero3"]["optimizer state"]
    assert parts["zero3"]["gathered units"] == 2 * block * p_bytes  # the unit and one prefetched
