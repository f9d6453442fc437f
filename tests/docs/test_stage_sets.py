"""A page or docstring that names the set of ZeRO stages this package implements names the set the
code accepts (``ZeroConfig``'s validation): "ZeRO-1/2" or "either stage" left behind after stage 3
landed fails here, with the file and line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_zero import ZeroConfig

ROOT = Path(__file__).resolve().parents[2]
FILES = [
    ROOT / "README.md",
    ROOT / "pyproject.toml",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "lightning_zero").rglob("*.py")),
    *sorted((ROOT / "recipes").rglob("*.py")),
    *sorted((ROOT / "conf").rglob("*.yaml")),
]
SET_PATTERNS = (  # each names a set of stages; the digits found must be the code's set
    re.compile(r"ZeRO[- ]?(\d(?:/\d)+)"),
    re.compile(r"ZeRO stages? (\d(?:, \d)*,? (?:and|or) \d)"),
    re.compile(r"ZeRO stages (\d[–-]\d)"),
)
WRONG = (re.compile(r"\beither stage\b", re.IGNORECASE),)  # two stages: there are three


def code_stages() -> set[int]:
    """The stages ``ZeroConfig`` accepts, by trying them."""
    accepted = set()
    for stage in range(0, 6):
        try:
            ZeroConfig(stage=stage)
        except ValueError:
            continue
        accepted.add(stage)
    return accepted


def _digits(text: str) -> set[int]:
    if "–" in text or re.fullmatch(r"\d-\d", text):
        low, high = (int(d) for d in re.split(r"[–-]", text))
        return set(range(low, high + 1))
    return {int(d) for d in re.findall(r"\d", text)}


def stale_mentions(files: list[Path], stages: set[int], root: Path = ROOT) -> list[str]:
    """``file:line: 'text'`` of every named stage set that is not ``stages``."""
    found = []
    for path in files:
        where = path.relative_to(root)
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for pattern in SET_PATTERNS:
                for match in pattern.finditer(line):
                    if _digits(match.group(1)) != stages:
                        found.append(f"{where}:{number}: {match.group(0)!r}")
            for pattern in WRONG:
                found += [f"{where}:{number}: {m.group(0)!r}" for m in pattern.finditer(line)]
    return found


def test_every_named_stage_set_is_the_codes() -> None:
    stages = code_stages()
    assert stages == {1, 2, 3}
    assert stale_mentions(FILES, stages) == []


@pytest.mark.parametrize(
    ("text", "stale"),
    [
        ("ZeRO-1/2 data parallelism", "ZeRO-1/2"),
        ("sharded ZeRO stages 1 and 2 here", "ZeRO stages 1 and 2"),
        ("it works at either stage", "either stage"),
        ("ZeRO stages 1–2 only", "ZeRO stages 1–2"),
    ],
)
def test_a_stale_set_is_found_and_the_current_one_is_not(tmp_path: Path, text: str, stale: str) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"ZeRO-1/2/3 and ZeRO stages 1, 2 and 3 and ZeRO stages 1–3\n{text}\n")
    assert stale_mentions([page], {1, 2, 3}, root=tmp_path) == [f"page.md:2: {stale!r}"]
