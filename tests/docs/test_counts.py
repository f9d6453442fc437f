"""A count the docs give of something the code holds is the code's count, never an estimate.

The pages said "~50" and "about 60" conformance cases when ``tests/conformance/cases.py`` held 62,
"nine" schedule cases left out at stage 3 when there were twelve, and "the first eight strategy
arguments" for a ``ZeroConfig`` of sixteen fields. The pages now name the set instead of counting it;
a count written again (in digits or words, with or without "about") must be the code's.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from lightning_zero.config import ZeroConfig
from tests.conformance import cases, test_conformance

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty"
).split()
TENS = {"thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90}
NUM = rf"(?P<n>\d+|{'|'.join([*WORDS, *TENS])})"
APPROX = r"(?P<approx>~\s*|about\s+|around\s+|some\s+|nearly\s+|over\s+|roughly\s+)?"

# what is counted: (patterns whose group ``n`` is the count, the code's count)
COUNTED: dict[str, tuple[tuple[str, ...], Callable[[], int]]] = {
    "conformance cases (tests/conformance/cases.py: CASES)": (
        (rf"{APPROX}\b{NUM}\s+(?:conformance\s+)?cases\b",),
        lambda: len(cases.CASES),
    ),
    "schedule cases left out under zero3 (cases.SCHEDULES_WITHOUT_ZERO3)": (
        (rf"{APPROX}\b{NUM}\s+(?:of\s+the\s+)?(?:LR-)?schedule\s+cases\b",),
        lambda: len(cases.SCHEDULES_WITHOUT_ZERO3),
    ),
    "ZeroConfig's fields (the engine's strategy arguments)": (
        (
            rf"first\s+{APPROX}\b{NUM}\s+strategy\s+arguments",
            rf"{APPROX}\b{NUM}\s+fields\s+of\s+`?(?:lightning_zero\.)?ZeroConfig",
        ),
        lambda: len(dataclasses.fields(ZeroConfig)),
    ),
    "conformance launches of 2 processes (test_conformance.CHUNKS)": (
        (rf"{APPROX}\b{NUM}\s+launches\s+of\s+2\s+processes",),
        lambda: test_conformance.CHUNKS,
    ),
}


def number(text: str) -> int:
    text = text.lower()
    if text.isdigit():
        return int(text)
    return WORDS.index(text) if text in WORDS else TENS[text]


def prose(page: Path) -> str:
    """The page with its links as their text and its line breaks as spaces (a count may wrap)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", page.read_text())
    return re.sub(r"\s+", " ", text)


def counts_found(patterns: tuple[str, ...]) -> list[tuple[str, str, int | None]]:
    """``(page, quoted text, count or None when approximate)`` for each match on every page."""
    found = []
    for page in PAGES:
        text = prose(page)
        for match in (m for pattern in patterns for m in re.finditer(pattern, text, re.IGNORECASE)):
            approx = match.group("approx")
            found.append((page.name, match.group(0), None if approx else number(match.group("n"))))
    return found


@pytest.mark.parametrize("what", list(COUNTED))
def test_counts_in_the_docs_are_the_code_s(what: str) -> None:
    pattern, count = COUNTED[what]
    wrong = [
        f"{page}: {quoted!r}: " + ("an estimate" if n is None else f"{n}") + f", the code has {count()}"
        for page, quoted, n in counts_found(pattern)
        if n != count()
    ]
    assert not wrong, f"{what}:\n" + "\n".join(wrong)


def test_the_patterns_find_the_old_wording() -> None:
    """The counts the pages used to give are found (and would fail): the patterns are not blind."""
    old = {
        "about 60 cases run": "conformance cases",
        "~50 cases in four": "conformance cases",
        "except nine LR-schedule cases": "schedule cases",
        "all but twelve of the schedule cases": "schedule cases",
        "the first eight strategy arguments": "ZeroConfig",
        "in four launches of 2 processes": "launches",
    }
    for text, what in old.items():
        (key,) = [k for k in COUNTED if k.startswith(what) or what in k]
        assert any(re.search(pattern, text, re.IGNORECASE) for pattern in COUNTED[key][0]), (text, key)
