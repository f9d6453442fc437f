"""Every module, name and file the docs, the configs and the code's comments mention exists.

A package split leaves comments behind: ``lightning_zero.reducer.GradReducer`` after ``reducer.py``
moved into ``engine/``, ``recipes/schema.py`` after it moved into ``recipes/config/``. The checks:

* a dotted ``lightning_zero.x.y`` or ``recipes.x.y`` is a module of the repository, or a module
  followed by names each an attribute (or a dataclass field) of the one before;
* a path ``lightning_zero/...``, ``recipes/...``, ``tests/...``, ``conf/...``, ``scripts/...``,
  ``examples/...``, ``docs/...`` or ``benchmarks/...`` naming a source (``.py``, ``.yaml``,
  ``.md``, ``.sh``) or a folder of the code exists (a ``*`` in it: matches a file); outputs that
  a benchmark or a run writes (``.json``, ``.png``, ``benchmarks/results/...``) are not checked;
* in the code and the configs a bare file name (``backends.py``) is a file of the repository, a
  module of Python's standard library, or a file a run writes (:data:`RUN_OUTPUTS`);
* ``docs/architecture.md``'s file table lists exactly the package's ``.py`` files (a subpackage's
  ``__init__.py``, which only re-exports, aside).

A one-letter or all-capitals part (``lightning_zero.engine.x``, ``conf/data/NAME.yaml``) is a
placeholder, not a name.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "lightning_zero"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONFIGS = sorted((ROOT / "conf").rglob("*.yaml"))
CODE = [
    p
    for folder in (PACKAGE, "recipes", "benchmarks", "scripts", "examples")
    for p in sorted((ROOT / folder).rglob("*.py"))
]
TOP = ("lightning_zero", "recipes", "benchmarks", "scripts", "tests", "conf", "examples", "docs")
CODE_DIRS = {"lightning_zero", "recipes", "tests", "conf", "scripts", "examples"}
SOURCES = {".py", ".yaml", ".md", ".sh"}
RUN_OUTPUTS = {
    "config.yaml": "the composed config a recipe run writes (Hydra's .hydra/config.yaml, the run's copy)",
    "hparams.yaml": "Lightning's CSV logger",
}
DOTTED = re.compile(r"(?<![\w./-])((?:lightning_zero|recipes)(?:\.[A-Za-z_]\w*)+)")
PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(TOP)})/[\w./*-]*[\w*])")
BARE = re.compile(r"(?<![\w./-])([\w-]+\.(?:py|yaml))\b")
NOT_MODULES = {"md", "py", "yaml", "txt", "json", "sh"}  # recipes.md is a page


def placeholder(part: str) -> bool:
    return len(part) == 1 or (part.isupper() and len(part) > 1)


def mentions(files: list[Path], pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    """``(file:line, text)`` of every match."""
    found = []
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found += [(f"{path.relative_to(ROOT)}:{number}", m) for m in pattern.findall(line)]
    return found


def is_module(parts: list[str]) -> bool:
    path = ROOT.joinpath(*parts)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


@cache
def dotted_problem(name: str) -> str | None:
    """Why ``name`` does not resolve, or ``None``."""
    parts = name.split(".")
    if parts[-1] in NOT_MODULES or any(placeholder(p) for p in parts):
        return None
    k = len(parts)
    while k > 1 and not is_module(parts[:k]):
        k -= 1
    if k == len(parts):
        return None
    if k == 1 and not is_module(parts[:1]):
        return f"no module {parts[0]}"
    try:
        obj: object = importlib.import_module(".".join(parts[:k]))
    except Exception as error:  # a module that fails to import is named, not a crash of the test
        return f"import {'.'.join(parts[:k])} failed: {error!r}"
    for i, attr in enumerate(parts[k:]):
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
            continue
        fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
        annotated = getattr(obj, "__annotations__", {}) if inspect.isclass(obj) else {}
        if attr in fields or attr in annotated:
            return None
        return f"{'.'.join(parts[: k + i])} has no module or attribute {attr!r}"
    return None


def path_problem(text: str) -> str | None:
    parts = text.split("/")
    if any(placeholder(Path(p).stem) for p in parts[1:]):
        return None
    if "*" in text:
        return None if any(ROOT.glob(text)) else "matches no file"
    suffix = Path(text).suffix
    if suffix in SOURCES or (not suffix and parts[0] in CODE_DIRS):
        return None if (ROOT / text).exists() else "no such file or folder"
    return None  # an output (a figure, a result, a benchmark's folder)


@cache
def repository_names() -> frozenset[str]:
    names = {p.name for top in TOP for p in (ROOT / top).rglob("*")}
    return frozenset(names | {p.name for p in ROOT.iterdir()})


def bare_problem(name: str) -> str | None:
    if placeholder(Path(name).stem) or name in repository_names() or name in RUN_OUTPUTS:
        return None
    if name.endswith(".py") and importlib.util.find_spec(name[:-3]) is not None:
        return None  # the standard library's (contextlib.py)
    return "no file of that name in the repository"


def test_dotted_names_resolve() -> None:
    problems = [
        f"{where}: {name}: {why}"
        for where, name in mentions(DOCS + CONFIGS + CODE, DOTTED)
        if (why := dotted_problem(name))
    ]
    assert not problems, "\n".join(problems)


def test_file_paths_exist() -> None:
    problems = [
        f"{where}: {text}: {why}"
        for where, text in mentions(DOCS + CONFIGS + CODE, PATH)
        if (why := path_problem(text))
    ]
    assert not problems, "\n".join(problems)


def test_bare_file_names_in_code_and_configs_exist() -> None:
    problems = [
        f"{where}: {name}: {why}"
        for where, name in mentions(CONFIGS + CODE, BARE)
        if (why := bare_problem(name))
    ]
    assert not problems, "\n".join(problems)


def architecture_files() -> list[str]:
    """The ``file`` column of ``docs/architecture.md``'s table under ``## Files``."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n## Files\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|") for line in section.splitlines() if line.startswith("|")]
    return [cells[2].strip().strip("`") for cells in rows[2:]]


def test_the_architecture_table_lists_every_package_file() -> None:
    listed = architecture_files()
    package = ROOT / PACKAGE
    files = sorted(  # a subpackage's __init__.py only re-exports its public names
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if p.parent == package or p.name != "__init__.py"
    )
    doubled = sorted({f for f in listed if listed.count(f) > 1})
    missing = sorted(set(files) - set(listed))
    extra = sorted(set(listed) - set(files))
    assert not (doubled or missing or extra), (
        f"docs/architecture.md's file table: missing {missing}, no such file {extra}, twice {doubled}"
    )
