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
