"""The one import-graph reader: every import of a package's modules, the arrows among them, cycles, levels.

    python scripts/import_graph.py [PACKAGE_DIR ...]   (default: lightning_zero; recipes works too)

Reads the source only (``ast``; nothing is imported), so it takes milliseconds and needs neither
torch nor Lightning. ``tests/unit/test_layering.py`` (the package's layers) and
``tests/recipes/test_import_graph.py`` (the recipes' seams) check their rules on what it reads; run
as a script it prints the structure: modules, arrows, cycles or levels, which part imports which, the
largest files and functions.

What counts as an import of a module of the package (an *arrow*):

  * every ``import`` and ``from ... import`` statement, at module level or inside a function (a cycle
    through a lazy import is still a cycle); relative imports are resolved;
  * ``import pkg`` and ``from pkg import name`` reach ``pkg/__init__.py``, the package face, unless
    ``pkg.name`` is itself a module (then they reach it): a bare ``import lightning_zero`` in a lower
    layer is an arrow to the top;
  * ``import pkg.a.b`` reaches ``pkg.a.b``; the parents Python initialises on the way are not arrows
    (a parent is already in ``sys.modules`` while its children load);
  * imports under ``if TYPE_CHECKING:`` are read, marked ``typing_only``, and left out of the run-time
    graph (:func:`graph`).
"""

from __future__ import annotations

import argparse
import ast
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Import:
    """One imported name (``import a, b`` gives two)."""

    line: int
    module: str
    """The module as imported, absolute (``torch.distributed``, ``lightning_zero.engine``)."""
    name: str | None
    """``from module import name``: the name; ``None`` for ``import module``."""
    target: str | None
    """The module of the package this reaches (see the module docstring); ``None``: outside it."""
    typing_only: bool
    """Under ``if TYPE_CHECKING:``: read by type checkers, never run."""
    function_level: bool
    """Inside a function: run at its first call, not at import."""


def modules(package_dir: Path) -> dict[str, Path]:
    """``{"lightning_zero.engine.reducer": path, "lightning_zero": path of __init__.py, ...}``."""
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def type_checking_nodes(tree: ast.AST) -> set[int]:
    """``id`` of every node under an ``if TYPE_CHECKING:`` / ``if typing.TYPE_CHECKING:`` block."""
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            ids.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return ids


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _statements(
    tree: ast.AST, in_function: bool = False
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement of ``tree``, and whether it sits inside a function."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, in_function
        nested = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield from _statements(child, nested)


def _resolve(dotted: str, known: set[str]) -> str | None:
    """The longest prefix of ``dotted`` that is a module of the package."""
    while dotted and dotted not in known:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def imports_of(name: str, source: str, known: set[str]) -> list[Import]:
    """Every import in module ``name`` (source ``source``), ``known`` the package's module names.

    Raises:
        SyntaxError: ``source`` does not parse.
    """
    tree = ast.parse(source)
    hidden = type_checking_nodes(tree)
    is_package = any(other.startswith(f"{name}.") for other in known)
    anchor = name.split(".") if is_package else name.split(".")[:-1]
    found = []
    for node, in_function in _statements(tree):
        marks = {"typing_only": id(node) in hidden, "function_level": in_function}
        if isinstance(node, ast.Import):
            found += [Import(node.lineno, a.name, None, _resolve(a.name, known), **marks) for a in node.names]
            continue
        base = node.module or ""
        if node.level:
            parent = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*parent, base] if base else parent)
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            target = submodule if submodule in known else _resolve(base, known)
            found.append(Import(node.lineno, base, alias.name, target, **marks))
    return found


def imports(package_dir: Path) -> dict[str, list[Import]]:
    """Module name -> every import in it (:func:`imports_of`), for the package in ``package_dir``."""
    paths = modules(package_dir)
    known = set(paths)
    return {name: imports_of(name, path.read_text(), known) for name, path in paths.items()}


def graph(package_dir: Path) -> dict[str, set[str]]:
    """Module name -> the package's modules it imports when run (``TYPE_CHECKING`` imports left out)."""
    return {
        name: {i.target for i in found if i.target and i.target != name and not i.typing_only}
        for name, found in imports(package_dir).items()
    }


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted, in a fixed order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return sorted(out)


def level_of(edges: dict[str, set[str]]) -> dict[str, int]:
    """The length of the longest chain of arrows below each module (call on a graph without cycles)."""
    levels: dict[str, int] = {}

    def visit(n: str) -> int:
        if n not in levels:
            levels[n] = 1 + max((visit(m) for m in edges[n]), default=-1)
        return levels[n]

    for n in edges:
        visit(n)
    return levels


def part(module: str) -> str:
    """The top-level part of the package a module belongs to (``engine`` for ``pkg.engine.reducer``,
    ``""`` for the package face)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def analyse(package_dir: Path, show_edges: bool = False) -> None:
    """Print the structure of the package in ``package_dir``."""
    paths = modules(package_dir)
    edges = graph(package_dir)
    lines = {n: len(f.read_text().splitlines()) for n, f in paths.items()}
    arrows = sum(len(v) for v in edges.values())
    size = f"{len(paths)} modules, {sum(lines.values())} lines"
    print(f"package {package_dir.name}: {size}, {arrows} import arrows")
    cycles = find_cycles(edges)
    if cycles:
        print(f"cycles ({len(cycles)}):")
        for cycle in cycles:
            print("  " + " -> ".join([*cycle, cycle[0]]))
    else:
        levels = level_of(edges)
        print(f"no cycles; {max(levels.values()) + 1} levels")
        for level in range(max(levels.values()) + 1):
            print(f"  level {level}: " + ", ".join(sorted(n for n, v in levels.items() if v == level)))
    parts: dict[str, set[str]] = {}
    for n, targets in edges.items():
        parts.setdefault(part(n), set()).update(part(t) for t in targets if part(t) != part(n))
    if len(parts) > 1:
        print(f"parts ({len(parts)}), each with the parts it imports ((package): the package face):")
        for name, targets in sorted(parts.items(), key=lambda kv: (len(kv[1]), kv[0])):
            shown = sorted(t or "(package)" for t in targets)
            print(f"  {name or '(package)':<14} -> {', '.join(shown) or '-'}")
    print("largest files (lines):")
    for n, count in sorted(lines.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  {count:5d}  {n}")
    print("largest functions (lines):")
    functions = []
    for n, f in paths.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                functions.append((node.end_lineno - node.lineno + 1, f"{n}:{node.name}"))
    for count, where in sorted(functions, reverse=True)[:8]:
        print(f"  {count:5d}  {where}")
    if show_edges:
        print("arrows:")
        for n, targets in sorted(edges.items()):
            for t in sorted(targets):
                print(f"  {n} -> {t}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="*", default=["lightning_zero"], help="package directories")
    parser.add_argument("--edges", action="store_true", help="also list every arrow")
    args = parser.parse_args(argv)
    for package in args.packages:
        analyse(Path(package).resolve(), args.edges)
    return 0


if __name__ == "__main__":
    sys.setrecursionlimit(10000)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends quietly
    sys.exit(main())
