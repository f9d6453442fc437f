"""``docs/reference.md`` is what ``scripts/reference.py`` generates from the code now: every argument
of the public classes with its default and docstring, and every command's ``--help``. A signature,
default, docstring or command that changed without the page fails here; so does an argument that
its docstring does not describe."""

from __future__ import annotations

import pytest

from tests.docs.scripts import ROOT, load_script


def test_the_reference_page_is_the_code(monkeypatch: pytest.MonkeyPatch) -> None:
    script = load_script("reference")
    monkeypatch.setenv("COLUMNS", "100")
    text = script.render()
    page = (ROOT / "docs" / "reference.md").read_text()
    assert page == text, "docs/reference.md differs from the code: run python scripts/reference.py"


def test_the_strategy_guide_tables_are_the_code() -> None:
    """``docs/strategy.md``'s argument tables are generated from the fields (one source): a default or
    a docstring changed by hand in the page, or in the code alone, fails here."""
    script = load_script("reference")
    page = (ROOT / "docs" / "strategy.md").read_text()
    assert script.guide(page) == page, (
        "docs/strategy.md's tables differ from the code: run python scripts/reference.py"
    )
    edited = page.replace("| `bucket_cap_mb` | `25.0` |", "| `bucket_cap_mb` | `50.0` |")
    assert edited != page and script.guide(edited) == page  # the generator rewrites a hand edit


def test_an_undescribed_argument_is_an_error() -> None:
    script = load_script("reference")

    class Strategy:
        """A strategy.

        Args:
            documented: what it does.
        """

        def __init__(self, documented: int = 1, forgotten: int = 2) -> None:
            pass

    with pytest.raises(
        SystemExit, match=r"Strategy: arguments without a description in its docstring: \['forgotten'\]"
    ):
        script._arguments(Strategy)


def test_grouped_and_continued_entries_are_read() -> None:
    script = load_script("reference")
    doc = """Summary.

    Args:
        a, b,
        c: shared text
            that continues.
        d: alone.

    Raises:
        ValueError: never.
    """
    assert script.args_section(doc) == [(["a", "b", "c"], "shared text that continues."), (["d"], "alone.")]
    assert (
        script.markdown("see :class:`~x.y.Z` and :mod:`x.y` and ``code``") == "see `Z` and `x.y` and `code`"
    )
