"""The seams of `recipes/`: no import circle, arrows between packages one way only, a light data face.

Read from the source by `scripts/import_graph.py`, the one import-graph reader (every `import`,
function-level ones included: the `compose` <-> `schema` circle went through a lazy import), so it takes
milliseconds and needs no import of torch or Lightning.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.docs.scripts import ROOT, load_script

import_graph = load_script("import_graph")

PACKAGE = ROOT / "recipes"
PACKAGES_MAY_IMPORT = {
    "recipes.data": set(),
    "recipes.training": set(),
    "recipes.checkpoints": {"recipes.data", "recipes.training"},
    "recipes.config": {"recipes.data", "recipes.training"},
}
"""Each library package and the other recipe packages it may import (the commands may import any)."""


def package(name: str) -> str:
    return ".".join(name.split(".")[:2])


def test_no_recipes_module_imports_one_that_imports_it_back() -> None:
    graph = import_graph.graph(PACKAGE)
    assert "recipes.config.compose" in graph and len(graph) > 30  # the walk found the package
    assert import_graph.find_cycles(graph) == []


def test_packages_import_each_other_one_way_and_never_a_command() -> None:
    graph = import_graph.graph(PACKAGE)
    wrong = sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        if package(name) in PACKAGES_MAY_IMPORT
        for target in targets
        if package(target) != package(name) and package(target) not in PACKAGES_MAY_IMPORT[package(name)]
    )
    assert not wrong, f"imports against the layering: {wrong}"
    paths = import_graph.modules(PACKAGE)
    commands = {n for n, path in paths.items() if path.parent == PACKAGE and path.stem != "__init__"}
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
