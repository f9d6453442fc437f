"""One source per setting (issue 40): a strategy argument's name, default, type and docstring live in
its dataclass field once (``ZeroConfig``, ``ZeroOptions``); everything else is read from there.

The scans below say where a default literal is written a second time: a function's parameter, a
call's keyword, a dict entry, an ``==``/``!=`` comparison or an assignment in the package,
the recipes, the benchmarks and the scripts; a key of a ``conf/`` YAML file; a row of a docs table
outside the generated blocks. ``None`` defaults are left out (``None`` means "not set" everywhere), and
so is ``stage``: a stage is named where it is chosen (``"zero2"``, ``conf/strategy/zero2.yaml``), never
restated as a default.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_zero.integrations.arguments import LIGHTNING_ARGUMENTS, lightning_name, zero_fields

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"lightning_zero/config.py": "ZeroConfig", "lightning_zero/integrations/options.py": "ZeroOptions"}
DEFAULTS = {f.name: f.default for f in zero_fields() if f.default is not None and f.name != "stage"}


def _same(a: Any, b: Any) -> bool:
    numbers = (int, float)
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, numbers) and isinstance(b, numbers):
        return a == b
    return type(a) is type(b) and a == b


def _pairs(node: ast.AST) -> list[tuple[str, ast.AST]]:
    """(name, value) pairs a node binds or compares: where a restated default would sit."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        args = node.args
        positional = args.posonlyargs + args.args
        pairs = [
            (a.arg, d)
            for a, d in zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True)
        ]
        return pairs + [
            (a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None
        ]
    if isinstance(node, ast.Call):
        return [(k.arg, k.value) for k in node.keywords if k.arg]
    if isinstance(node, ast.Dict):
        keys = zip(node.keys, node.values, strict=True)
        return [(k.value, v) for k, v in keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and len(node.ops) == 1:
        if isinstance(node.ops[0], ast.Eq | ast.NotEq):
            return [(node.left.attr, node.comparators[0])]
    if isinstance(node, ast.AnnAssign) and node.value is not None:
        return [(name, node.value) for name in _names(node.target)]
    if isinstance(node, ast.Assign):
        return [(name, node.value) for target in node.targets for name in _names(target)]
    return []


def _names(target: ast.AST) -> list[str]:
    """The setting an assignment target names: ``x``, ``a.x``, ``d["x"]``."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Attribute):
        return [target.attr]
    if isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant):
        return [str(target.slice.value)]
    return []


def restated_in_python(path: Path, text: str) -> list[str]:
    tree = ast.parse(text)
    source_class = SOURCES.get(path.relative_to(ROOT).as_posix())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == source_class:
            skip |= {id(n) for n in node.body}  # the fields themselves: the one source
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        for name, value in _pairs(node):
            if name in DEFAULTS and isinstance(value, ast.Constant) and _same(value.value, DEFAULTS[name]):
                found.append(f"{path.relative_to(ROOT)}:{value.lineno}: {name}={value.value!r}")
    return found


def restated_in_yaml(path: Path, text: str) -> list[str]:
    found: list[str] = []
    node = yaml.safe_load(text) or {}
    if not str(node.get("_target_", "")).startswith("lightning_zero."):
        return found  # another class's arguments (DDPStrategy's find_unused_parameters)
    for key, value in node.items():
        if key in DEFAULTS and _same(value, DEFAULTS[key]):
            found.append(f"{path.relative_to(ROOT)}: {key}: {value!r}")
    return found


GENERATED = re.compile(r"<!-- BEGIN generated .*?<!-- END generated -->", re.S)
ROW = re.compile(r"^\|\s*`(\w+)`\s*\|\s*`?([^|`]+?)`?\s*\|", re.M)


def restated_in_docs(path: Path, text: str) -> list[str]:
    found = []
    for match in ROW.finditer(GENERATED.sub("", text)):
        name, shown = match.groups()
        if name in DEFAULTS and shown.strip() in {repr(DEFAULTS[name]), str(DEFAULTS[name])}:
            found.append(f"{path.relative_to(ROOT)}: | `{name}` | {shown} |")
    return found


def scan() -> list[str]:
    found: list[str] = []
    for folder in ("lightning_zero", "recipes", "benchmarks", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += restated_in_python(path, path.read_text())
    for path in sorted((ROOT / "conf").rglob("*.yaml")):
        found += restated_in_yaml(path, path.read_text())
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        found += restated_in_docs(path, path.read_text())
    return found


def test_no_default_is_written_twice() -> None:
    found = scan()
    assert not found, "a default written again (read it from its field instead):\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("kind", "text"),
    [
        ("python", "def plan(bucket_cap_mb: float = 25.0) -> None: ...\n"),
        ("python", "ZeroStrategy(overlap_comm=True)\n"),
        ("python", "changed = self.min_unit_numel != 100_000\n"),
        ("python", "DEFAULTS = {'prefetch_units': 1}\n"),
        ("python", "defaults['min_unit_numel'] = 100_000\n"),
        ("python", "self.broadcast_buffers = True\n"),
        ("yaml", "_target_: lightning_zero.ZeroStrategy\nbucket_cap_mb: 25\n"),
        ("docs", "| argument | default |\n| --- | --- |\n| `first_bucket_cap_mb` | 1.0 |\n"),
    ],
)
def test_the_scan_finds_a_restated_default(kind: str, text: str) -> None:
    """The scans can fail: each kind of restatement, written into a file, is found."""
    path = ROOT / "lightning_zero" / "restated.py"
    scanner = {"python": restated_in_python, "yaml": restated_in_yaml, "docs": restated_in_docs}[kind]
    assert scanner(path, text)


def test_both_strategies_take_one_signature() -> None:
    """The Trainer's and Fabric's strategies: the same arguments, defaults and types, read from the
    fields and from Lightning's ``DDPStrategy`` (only ``precision``'s name differs, as Lightning's)."""
    from lightning.fabric.strategies import DDPStrategy as FabricDDP
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero import ZeroFabricStrategy, ZeroStrategy

    trainer, fabric = inspect.signature(ZeroStrategy), inspect.signature(ZeroFabricStrategy)
    ours = [f.name for f in zero_fields()]
    assert list(trainer.parameters) == ours + [lightning_name(n, DDPStrategy) for n in LIGHTNING_ARGUMENTS]
    assert list(fabric.parameters) == ours + [lightning_name(n, FabricDDP) for n in LIGHTNING_ARGUMENTS]
    for field in zero_fields():
        for signature in (trainer, fabric):
            parameter = signature.parameters[field.name]
            assert parameter.default is field.default or parameter.default == field.default, field.name
            assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
    for name in LIGHTNING_ARGUMENTS:
        theirs = inspect.signature(DDPStrategy.__init__).parameters[lightning_name(name, DDPStrategy)]
        assert trainer.parameters[lightning_name(name, DDPStrategy)].default == theirs.default


def test_the_typed_arguments_are_the_signature() -> None:
    """``TrainerArguments``/``FabricArguments`` (what type checkers and IDEs read on ``**arguments``)
    name every argument of the signature built from the fields, with the fields' types."""
    import typing

    from lightning.fabric.strategies import DDPStrategy as FabricDDP
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero.integrations.arguments import FabricArguments, TrainerArguments, strategy_signature

    for typed, peer in ((TrainerArguments, DDPStrategy), (FabricArguments, FabricDDP)):
        signature = strategy_signature(peer)
        hints = typing.get_type_hints(typed)
        assert set(hints) == set(list(signature.parameters)[1:]), typed.__name__
        for field in zero_fields():
            assert hints[field.name] == signature.parameters[field.name].annotation, field.name


def _windows(path: Path, size: int = 6) -> dict[tuple[str, ...], int]:
    """Every run of ``size`` consecutive non-trivial lines (whitespace-normalized), with its line."""
    lines = [(n, " ".join(line.split())) for n, line in enumerate(path.read_text().splitlines(), 1)]
    kept = [(n, line) for n, line in lines if len(line) > 3 and not line.startswith(("#", '"""', ")"))]
    return {tuple(line for _, line in kept[i : i + size]): kept[i][0] for i in range(len(kept) - size + 1)}


def test_no_block_is_written_twice_between_the_strategies_and_the_config() -> None:
    files = [
        ROOT / "lightning_zero/integrations/trainer/strategy.py",
        ROOT / "lightning_zero/integrations/fabric/strategy.py",
        ROOT / "lightning_zero/config.py",
        ROOT / "lightning_zero/integrations/options.py",
    ]
    windows = {path: _windows(path) for path in files}
    found = []
    for i, a in enumerate(files):
        for b in files[i + 1 :]:
            for block in windows[a].keys() & windows[b].keys():
                found.append(f"{a.name}:{windows[a][block]} and {b.name}:{windows[b][block]}: {block[0]!r}")
    assert not found, "six or more lines alike:\n" + "\n".join(found)
