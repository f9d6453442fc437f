"""The seams of `recipes/`: no import circle, arrows between packages one way only, a light data face.

Read from the source (every `import`, function-level ones included: the `compose` <-> `schema` circle
went through a lazy import), so it takes milliseconds and needs no import of torch or Lightning.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES_MAY_IMPORT = {
    "recipes.data": set(),
    "recipes.training": set(),
    "recipes.checkpoints": {"recipes.data", "recipes.training"},
    "recipes.config": {"recipes.data", "recipes.training"},
}
"""Each library package and the other recipe packages it may import (the commands may import any)."""


def module_names() -> dict[str, Path]:
    files = sorted((ROOT / "recipes").rglob("*.py"))
    names = {}
    for path in files:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the recipe modules it imports (`from p import m` of a module `p.m` points at `p.m`)."""
    names = module_names()
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{name}: relative import"
                base = node.module or ""
                found = [f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names]
            else:
                continue
            for target in found:
                while target and target not in names:
                    target = target.rpartition(".")[0]
                if target:
                    targets.add(target)
        graph[name] = targets
    return graph


def reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), list(graph[start])
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(graph[node])
    return False


def package(name: str) -> str:
    return ".".join(name.split(".")[:2])


def test_no_recipes_module_imports_one_that_imports_it_back() -> None:
    graph = import_graph()
    assert "recipes.config.compose" in graph and len(graph) > 30  # the walk found the package
    circles = sorted(
        f"{name} -> {target}" for name in graph for target in graph[name] if reaches(graph, target, name)
    )
    assert not circles, f"import circles: {circles}"


def test_packages_import_each_other_one_way_and_never_a_command() -> None:
    graph = import_graph()
    wrong = sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        if package(name) in PACKAGES_MAY_IMPORT
        for target in targets
        if package(target) != package(name) and package(target) not in PACKAGES_MAY_IMPORT[package(name)]
    )
    assert not wrong, f"imports against the layering: {wrong}"
    top = ROOT / "recipes"
    commands = {n for n, path in module_names().items() if path.parent == top and path.stem != "__init__"}
    assert {"recipes.pretrain", "recipes.prepare", "recipes.evaluate"} <= commands
    assert not [f"{n} -> {t}" for n, targets in graph.items() for t in targets if t in commands]


def test_the_data_face_and_the_prepare_command_import_no_torch() -> None:
    """`python -m recipes.prepare` and its pool workers start without torch or Lightning."""
    code = "import sys, recipes.data, recipes.prepare; print(sorted({m.split('.')[0] for m in sys.modules}))"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    loaded = run.stdout
    assert "'numpy'" in loaded and "'torch'" not in loaded and "'lightning'" not in loaded, loaded
