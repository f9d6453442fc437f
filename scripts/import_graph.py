"""Import structure of a package: modules, import arrows, levels, cycles, largest files and functions.

    python scripts/import_graph.py [PACKAGE_DIR ...]      (default: lightning_zero)

Reads the source only (``ast``; nothing is imported). An arrow is a module-level or function-level
``import``/``from ... import`` of another module of the same package, counted once per pair; an
import of a package counts as an arrow to its ``__init__``. The level of a module is the length of
the longest chain of arrows below it (a module importing nothing of the package is level 0); a
cycle makes levels undefined, so the cycles are listed instead.
"""

from __future__ import annotations

import ast
import signal
import sys
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(tree: ast.AST, name: str, is_package: bool, known: set[str]) -> set[str]:
    """Modules of the package that ``tree`` (module ``name``) imports."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def analyse(root: Path) -> None:
    files = sorted(root.rglob("*.py"))
    names = {module_name(root, f): f for f in files}
    known = set(names)
    graph = {
        n: imports_of(ast.parse(f.read_text()), n, f.name == "__init__.py", known) for n, f in names.items()
    }
    arrows = sum(len(v) for v in graph.values())
    cycles = find_cycles(graph)
    lines = {n: len(f.read_text().splitlines()) for n, f in names.items()}
    print(f"package {root.name}: {len(names)} modules, {sum(lines.values())} lines, {arrows} import arrows")
    if cycles:
        print(f"cycles ({len(cycles)}):")
        for cycle in cycles:
            print("  " + " -> ".join(cycle + [cycle[0]]))
    else:
        levels = level_of(graph)
        print(f"no cycles; {max(levels.values()) + 1} levels")
        for level in range(max(levels.values()) + 1):
            print(f"  level {level}: " + ", ".join(sorted(n for n, v in levels.items() if v == level)))
    parts: dict[str, set[str]] = {}
    for n, targets in graph.items():
        part = _part(root.name, n)
        parts.setdefault(part, set()).update(
            _part(root.name, t) for t in targets if _part(root.name, t) != part
        )
    if len(parts) > 1:
        print(f"parts ({len(parts)}), each with the parts it imports:")
        for part, targets in sorted(parts.items(), key=lambda kv: (len(kv[1]), kv[0])):
            print(f"  {part:<14} -> {', '.join(sorted(targets)) or '-'}")
    print("largest files (lines):")
    for n, count in sorted(lines.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  {count:5d}  {n}")
    print("largest functions (lines):")
    functions = []
    for n, f in names.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                functions.append((node.end_lineno - node.lineno + 1, f"{n}:{node.name}"))  # type: ignore[operator]
    for count, where in sorted(functions, reverse=True)[:8]:
        print(f"  {count:5d}  {where}")


def _part(package: str, module: str) -> str:
    """The top-level part of the package a module belongs to (``engine`` for ``pkg.engine.reducer``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(package)"


def level_of(graph: dict[str, set[str]]) -> dict[str, int]:
    levels: dict[str, int] = {}

    def visit(n: str) -> int:
        if n not in levels:
            levels[n] = 1 + max((visit(m) for m in graph[n]), default=-1)
        return levels[n]

    for n in graph:
        visit(n)
    return levels


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as a list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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

    for v in graph:
        if v not in index:
            connect(v)
    return out


if __name__ == "__main__":
    sys.setrecursionlimit(10000)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends quietly
    for arg in sys.argv[1:] or ["lightning_zero"]:
        analyse(Path(arg).resolve())
