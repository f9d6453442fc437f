"""Architecture rules that reviews kept missing, checked on the source (``ast``, nothing imported).

Layers of ``lightning_zero``, bottom up; a module imports only from its own package and the layers
below it (``docs/architecture.md``):

    0  config | _version           settings shared by every layer | the installed version
    1  layout                      pure math: partition, buckets, flat buffers, memory per rank
    2  comm                        the only caller of ``torch.distributed``
    3  engine                      hooks, wire buffers, collectives per bucket, shard state
    4  optim | checkpoint          the optimizer protocol and update rule | the directory format
    5  integrations | report       the only importer of Lightning: front end, Trainer, Fabric |
                                   a step profile's report (JSON in, Markdown and charts out)
    6  cli                         the command line
    7  lightning_zero (__init__)   the public names

Imports are read by ``scripts/import_graph.py`` (the one reader): function-level imports included,
and a bare ``import lightning_zero`` or ``from lightning_zero import X`` is an import of the package
face, the top layer.
"""

from __future__ import annotations

import ast
from typing import Any

from tests.docs.scripts import ROOT, load_script

import_graph = load_script("import_graph")

PACKAGE = ROOT / "lightning_zero"

LAYER = {
    "config": 0,
    "_version": 0,
    "layout": 1,
    "comm": 2,
    "engine": 3,
    "optim": 4,
    "checkpoint": 4,
    "integrations": 5,
    "report": 5,
    "cli": 6,
    "": 7,
}
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")

KNOWN_CYCLES: list[list[str]] = []
"""Import cycles that exist and are to go; a new cycle, or one of these gone, fails the test."""


def _modules() -> dict[str, ast.Module]:
    """``{"engine/reducer.py": tree, ...}`` for every module of the package."""
    return {str(p.relative_to(PACKAGE)): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def _part(relpath: str) -> str:
    """The top-level part a module belongs to (``"engine"``, ``"config"``, ``""`` for ``__init__``)."""
    first = relpath.split("/")[0]
    return "" if first == "__init__.py" else first.removesuffix(".py")


def _imports_by_file(run_time: bool = True) -> dict[str, list[Any]]:
    """``{"engine/reducer.py": [Import, ...]}``: every import of each module (``run_time``: those it
    runs, not ``TYPE_CHECKING``'s)."""
    paths = import_graph.modules(PACKAGE)
    return {
        str(paths[module].relative_to(PACKAGE)): [i for i in found if not (run_time and i.typing_only)]
        for module, found in import_graph.imports(PACKAGE).items()
    }


def _distributed_uses(tree: ast.Module, found: list[Any]) -> list[int]:
    """Lines that import or reach ``torch.distributed`` outside an ``if TYPE_CHECKING:`` block."""
    lines = [i.line for i in found if i.module.startswith("torch.distributed")]
    lines += [i.line for i in found if i.module == "torch" and i.name == "distributed"]
    hidden = import_graph.type_checking_nodes(tree)
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
    modules, found = _modules(), _imports_by_file()
    uses = {path: _distributed_uses(tree, found[path]) for path, tree in modules.items()}
    offenders = {path: lines for path, lines in uses.items() if _part(path) != "comm" and lines}
    assert offenders == {}, f"torch.distributed used outside comm/ (file: lines): {offenders}"
    assert any(lines for path, lines in uses.items() if _part(path) == "comm"), (
        "the check must see comm's use"
    )


def test_imports_go_down_the_layers() -> None:
    """Function-level imports included; ``import lightning_zero`` is an import of layer 7, the face."""
    offenders = []
    for path, found in _imports_by_file().items():
        part = _part(path)
        for i in found:
            if i.target is None:
                continue
            target = import_graph.part(i.target)
            if target != part and LAYER[target] >= LAYER[part]:
                what = i.module if i.name is None else f"{i.name} from {i.module}"
                offenders.append(
                    f"{path}:{i.line} ({part or '__init__'}, layer {LAYER[part]}) imports {what}"
                )
    assert offenders == [], "imports that run up or across the layers:\n" + "\n".join(offenders)


def test_no_import_cycle_function_level_imports_included() -> None:
    cycles = import_graph.find_cycles(import_graph.graph(PACKAGE))
    assert [c for c in cycles if c not in KNOWN_CYCLES] == [], f"import cycles: {cycles}"
    gone = [c for c in KNOWN_CYCLES if c not in cycles]
    assert gone == [], f"these cycles are gone: remove them from KNOWN_CYCLES: {gone}"


def test_the_core_never_imports_lightning() -> None:
    found = _imports_by_file()
    offenders = [
        f"{path}:{i.line} imports {i.module}"
        for path, imports in found.items()
        if _part(path) not in ("integrations", "")
        for i in imports
        if i.module.split(".")[0] in LIGHTNING
    ]
    assert offenders == [], "Lightning imported below integrations/:\n" + "\n".join(offenders)
    assert any(
        i.module.split(".")[0] in LIGHTNING
        for path, imports in found.items()
        if _part(path) == "integrations"
        for i in imports
    ), "the check must see the integrations' use"


def test_readers_of_the_sharded_state_import_it_plainly() -> None:
    """full_state, checkpoint, reshard, ... take the engine (``ShardEngine``), imported at run time:
    no module reaches into another of this package through a ``TYPE_CHECKING`` import."""
    offenders = {
        path: hidden
        for path, found in _imports_by_file(run_time=False).items()
        # the package's __init__ names its lazily imported public names for type checkers
        if path != "__init__.py" and (hidden := [i.module for i in found if i.typing_only and i.target])
    }
    assert offenders == {}, f"TYPE_CHECKING-only imports of lightning_zero modules: {offenders}"


def test_no_private_name_is_imported_from_another_module() -> None:
    offenders = [
        f"{path}:{i.line} imports {i.name} from {i.module}"
        for path, found in _imports_by_file().items()
        for i in found
        if i.target is not None and i.name is not None and i.name.startswith("_")
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
