"""Architecture rules that reviews kept missing, checked on the source (``ast``, nothing imported).

Layers of ``lightning_zero``, bottom up; a module imports only from its own package and the layers
below it (``docs/architecture.md``):

    0  config                      settings shared by every layer
    1  layout                      pure math: partition, buckets, flat buffers
    2  comm                        the only caller of ``torch.distributed``
    3  engine                      hooks, wire buffers, collectives per bucket, shard state
    4  optim | checkpoint          the optimizer protocol and update rule | the directory format
    5  integrations                the only importer of Lightning: front end, Trainer, Fabric
    6  cli                         the command line
    7  lightning_zero (__init__)   the public names
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_zero"

LAYER = {
    "config": 0,
    "layout": 1,
    "comm": 2,
    "engine": 3,
    "optim": 4,
    "checkpoint": 4,
    "integrations": 5,
    "cli": 6,
    "": 7,
}
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")


def _modules() -> dict[str, ast.Module]:
    """``{"engine/reducer.py": tree, ...}`` for every module of the package."""
    return {str(p.relative_to(PACKAGE)): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def _part(relpath: str) -> str:
    """The top-level part a module belongs to (``"engine"``, ``"config"``, ``""`` for ``__init__``)."""
    first = relpath.split("/")[0]
    return "" if first == "__init__.py" else first.removesuffix(".py")


def _typing_only(tree: ast.Module) -> set[int]:
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            ids.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return ids


def _imports(tree: ast.Module) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every run-time import (``names`` empty for ``import x``)."""
    hidden = _typing_only(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, [a.name for a in node.names]))
    return found


def _distributed_uses(tree: ast.Module) -> list[int]:
    """Lines that import or reach ``torch.distributed`` outside an ``if TYPE_CHECKING:`` block."""
    lines = [line for line, module, _ in _imports(tree) if module.startswith("torch.distributed")]
    hidden = _typing_only(tree)
    for node in ast.walk(tree):
        if (
            id(node) not in hidden
            and isinstance(node, ast.Attribute)
            and node.attr == "distributed"
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        ):
            lines.append(node.lineno)
    return lines


def test_only_comm_calls_torch_distributed() -> None:
    modules = _modules()
    offenders = {
        path: lines
        for path, tree in modules.items()
        if _part(path) != "comm" and (lines := _distributed_uses(tree))
    }
    assert offenders == {}, f"torch.distributed used outside comm/ (file: lines): {offenders}"
    assert any(_distributed_uses(t) for p, t in modules.items() if _part(p) == "comm"), (
        "the check must see comm's use"
    )


def test_imports_go_down_the_layers() -> None:
    offenders = []
    for path, tree in _modules().items():
        part = _part(path)
        for line, module, _ in _imports(tree):
            if not module.startswith("lightning_zero."):
                continue
            target = module.split(".")[1]
            if target != part and LAYER[target] >= LAYER[part]:
                offenders.append(f"{path}:{line} ({part}, layer {LAYER[part]}) imports {module}")
    assert offenders == [], "imports that run up or across the layers:\n" + "\n".join(offenders)


def test_the_core_never_imports_lightning() -> None:
    offenders = [
        f"{path}:{line} imports {module}"
        for path, tree in _modules().items()
        if _part(path) not in ("integrations", "")
        for line, module, _ in _imports(tree)
        if module.split(".")[0] in LIGHTNING
    ]
    assert offenders == [], "Lightning imported below integrations/:\n" + "\n".join(offenders)
    assert any(
        module.split(".")[0] in LIGHTNING
        for path, tree in _modules().items()
        if _part(path) == "integrations"
        for _, module, _ in _imports(tree)
    ), "the check must see the integrations' use"


def _typing_only_package_imports(tree: ast.Module) -> list[str]:
    """Modules of this package imported only under ``if TYPE_CHECKING:`` (an import circle hidden)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").startswith("lightning_zero"):
                    found.append(stmt.module or "")
    return found


def test_readers_of_the_sharded_state_import_it_plainly() -> None:
    """full_state, checkpoint, reshard, ... take the engine (``ShardEngine``), imported at run time:
    no module reaches into another of this package through a ``TYPE_CHECKING`` import."""
    offenders = {
        path: hidden
        for path, tree in _modules().items()
        # the package's __init__ names its lazily imported public classes for type checkers
        if path != "__init__.py" and (hidden := _typing_only_package_imports(tree))
    }
    assert offenders == {}, f"TYPE_CHECKING-only imports of lightning_zero modules: {offenders}"


def test_no_private_name_is_imported_from_another_module() -> None:
    offenders = [
        f"{path}:{line} imports {name} from {module}"
        for path, tree in _modules().items()
        for line, module, names in _imports(tree)
        if module.startswith("lightning_zero")
        for name in names
        if name.startswith("_")
    ]
    assert offenders == [], "private names imported across modules:\n" + "\n".join(offenders)


ENGINE_PARTS = ("reducer", "gather", "flat", "records", "shards", "plan", "comm", "params_in_order", "pool")
"""Attributes of the engine that only the engine and the layers that store its state may touch."""


def test_the_integrations_speak_to_the_engine_through_its_methods() -> None:
    """Strategies, precision plugins, callbacks and the monitor use ``ShardEngine``'s named methods
    (``finish_grad_sync``, ``grad_norms``, ``comm_stats``, ...), never its parts."""
    offenders = [
        f"{path}:{node.lineno} reads .{node.attr}"
        for path, tree in _modules().items()
        if _part(path) == "integrations"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_PARTS
    ]
    assert offenders == [], "reach-through into the engine's parts:\n" + "\n".join(offenders)
