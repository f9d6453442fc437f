"""Architecture rules that reviews kept missing: only ``comm.py`` talks to ``torch.distributed``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_zero"


def _distributed_uses(tree: ast.Module) -> list[int]:
    """Lines that import or reach ``torch.distributed`` outside an ``if TYPE_CHECKING:`` block."""
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            typing_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    lines = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import) and any(a.name.startswith("torch.distributed") for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            lines.append(node.lineno)
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "distributed"
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        ):
            lines.append(node.lineno)
    return lines


def test_only_comm_calls_torch_distributed() -> None:
    offenders = {
        path.name: lines
        for path in sorted(PACKAGE.glob("*.py"))
        if path.name != "comm.py" and (lines := _distributed_uses(ast.parse(path.read_text())))
    }
    assert offenders == {}, f"torch.distributed used outside comm.py (file: lines): {offenders}"
    assert _distributed_uses(ast.parse((PACKAGE / "comm.py").read_text())), "the check must see comm.py's use"


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
        path.name: hidden
        for path in sorted(PACKAGE.glob("*.py"))
        if (hidden := _typing_only_package_imports(ast.parse(path.read_text())))
    }
    assert offenders == {}, f"TYPE_CHECKING-only imports of lightning_zero modules: {offenders}"
