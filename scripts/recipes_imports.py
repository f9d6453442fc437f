"""The import graph among the `recipes` modules: modules, arrows, cycles, fan-out, package arrows.

    python scripts/recipes_imports.py              # the working tree
    python scripts/recipes_imports.py --rev HEAD~3 # a commit (read with `git show`, nothing checked out)
    python scripts/recipes_imports.py --edges      # also list every arrow

An arrow A -> B means that module A imports module B anywhere in its source (function-level imports
included: a circle through a lazy import is still a circle). `from recipes.x import name` points at
`recipes.x.name` when that is a module, else at `recipes.x` (a package's `__init__`). Implicit imports
of parent packages are not arrows (Python finds a parent already initialising in `sys.modules`).
Cycles are the strongly connected components with more than one module, and self-imports.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "recipes"


def module_name(path: str) -> str:
    """`recipes/data/__init__.py` -> `recipes.data`; `recipes/data/sources.py` -> `recipes.data.sources`."""
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources(rev: str | None) -> dict[str, str]:
    """Source text of every module of the package, by module name, in the working tree or at `rev`."""
    if rev is None:
        files = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / PACKAGE).rglob("*.py"))
        return {module_name(f): (ROOT / f).read_text() for f in files}
    listing = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", rev, f"{PACKAGE}/"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    files = [f for f in listing if f.endswith(".py")]
    show = ["git", "-C", str(ROOT), "show"]
    return {
        module_name(f): subprocess.run(
            [*show, f"{rev}:{f}"], check=True, capture_output=True, text=True
        ).stdout
        for f in files
    }


def imports(name: str, source: str, known: set[str]) -> set[str]:
    """The package's modules that module `name` imports (see the module docstring)."""
    package = name if source_is_package(name, known) else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import recipes.a.b` of a name inside a module
                target = target.rpartition(".")[0]
            if target:
                found.add(target)
    return found


def source_is_package(name: str, known: set[str]) -> bool:
    return any(other.startswith(f"{name}.") for other in known)


def graph(rev: str | None) -> dict[str, set[str]]:
    texts = sources(rev)
    known = set(texts)
    return {name: imports(name, text, known) for name, text in sorted(texts.items())}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, and modules that import themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan; the graphs here are a few dozen modules deep at most
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges.get(node, ()):
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def package_of(name: str, edges: dict[str, set[str]]) -> str:
    """The first-level subpackage a module belongs to (`recipes.data.preparation.units` -> `recipes.data`),
    or the module itself at the top level."""
    parts = name.split(".")
    first = ".".join(parts[:2])
    return first if source_is_package(first, set(edges)) else name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="a git revision instead of the working tree")
    parser.add_argument("--edges", action="store_true", help="list every arrow")
    args = parser.parse_args(argv)
    edges = graph(args.rev)
    arrows = sum(len(targets) for targets in edges.values())
    print(f"{len(edges)} modules, {arrows} import arrows among them ({args.rev or 'working tree'})")
    found = cycles(edges)
    print(f"cycles: {len(found)}" + "".join(f"\n  {' <-> '.join(c)}" for c in found))
    print("fan-out (recipes modules each imports), largest first:")
    for name, targets in sorted(edges.items(), key=lambda item: (-len(item[1]), item[0]))[:8]:
        print(f"  {len(targets):2d}  {name}")
    packages: dict[str, set[str]] = defaultdict(set)
    for name, targets in edges.items():
        for target in targets:
            if package_of(target, edges) != package_of(name, edges):
                packages[package_of(name, edges)].add(package_of(target, edges))
    print("arrows between packages and top-level modules:")
    for name in sorted(packages):
        print(f"  {name} -> {', '.join(sorted(packages[name]))}")
    if args.edges:
        print("arrows:")
        for name, targets in edges.items():
            for target in sorted(targets):
                print(f"  {name} -> {target}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
