"""One "7B" (and one "70B") across the docs and the benchmarks: Llama 2's, the sizes
``scripts/memory_chart.py`` computes ``docs/clusters.md``'s tables with.

``performance.md`` once quoted bytes per node for ``Ψ = 7e9`` beside ``clusters.md``'s table for
6.74e9, two different answers to one question. A parameter count written in the docs
(``--params 6.74e9``) or a benchmark near one of those models' sizes is that model's size, and no
page but ``clusters.md`` (generated) restates its per-node figures.
"""

from __future__ import annotations

import re

import pytest

from tests.docs.scripts import ROOT, load_script

FILES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "benchmarks").glob("*.py")),
]
COUNT = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?e9)\b")


def models() -> dict[str, float]:
    return {model.name: model.params for model in load_script("memory_chart").MODELS}


@pytest.mark.parametrize("name", ["7B", "70B"])
def test_a_model_size_is_the_one_the_generated_tables_use(name: str) -> None:
    size = models()[name]
    near = [
        f"{path.relative_to(ROOT)}:{number}: {text}"
        for path in FILES
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for text in COUNT.findall(line)
        if 0.85 * size <= float(text) <= 1.15 * size and float(text) != size
    ]
    assert not near, f"{name} is {size:g} parameters (scripts/memory_chart.py); found:\n" + "\n".join(near)


def test_only_clusters_md_gives_the_bytes_that_leave_a_node() -> None:
    """The per-node traffic of a 7B/70B run is computed once, in clusters.md's generated table."""
    phrase = re.compile(r"leaves? each node|leaving each node", re.IGNORECASE)
    pages = [p for p in FILES if p.suffix == ".md" and p.name != "clusters.md"]
    found = []
    for page in pages:
        text = re.sub(r"\s+", " ", page.read_text())
        for match in phrase.finditer(text):
            window = text[max(0, match.start() - 200) : match.end() + 200]
            if re.search(r"\b\d+(?:\.\d+)? GB\b", window) and re.search(r"\b70?B\b", window):
                found.append(f"{page.name}: ...{window}...")
    assert not found, "link to clusters.md#node-aware-sharding instead:\n" + "\n".join(found)
