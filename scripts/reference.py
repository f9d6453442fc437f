"""Write ``docs/reference.md`` from the code: every argument of ``ZeroConfig``, ``ZeroOptions``,
``ZeroStrategy``, ``ZeroFabricStrategy`` and ``ShardedAdamW`` (signature, default, the docstring's
description, the ``DDPStrategy`` arguments they do not take) and the ``--help`` of every
``lightning-zero`` command; and the argument tables of ``docs/strategy.md`` (between its
``<!-- BEGIN generated ... -->`` and ``<!-- END generated -->`` lines).

    python scripts/reference.py          # rewrite both
    python scripts/reference.py --check  # exit 1 if either differs from the code

``tests/docs/test_reference.py`` runs the check, so the page cannot go stale. An argument that a
signature has and its docstring does not describe is an error here, naming it.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import inspect
import io
import os
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PAGE = ROOT / "docs" / "reference.md"
GUIDE = ROOT / "docs" / "strategy.md"
BLOCK = re.compile(r"(<!-- BEGIN generated (\w+) [^\n]*-->\n)(.*?)(<!-- END generated -->)", re.S)
COMMANDS = ("consolidate", "verify", "estimate", "preflight", "report")


def _role(match: re.Match[str]) -> str:
    """``:class:`~a.b.C``` -> `C`; ``:mod:`a.b``` -> `a.b`."""
    name = match.group(2)
    return f"`{name.split('.')[-1] if match.group(1) else name}`"


def markdown(text: str) -> str:
    """A docstring's reST inline markup as Markdown, on one line."""
    text = re.sub(r":(?:class|func|meth|mod|data|attr):`(~?)([^`]+)`", _role, text)
    return " ".join(text.replace("``", "`").split())


def _cell(text: str) -> str:
    return markdown(text).replace("|", "\\|")


def _default(value: Any) -> str:
    if value is inspect.Parameter.empty:
        return "required"
    return f"`{value!r}`" if not callable(value) else f"`{getattr(value, '__name__', value)}`"


def field_docs(cls: type) -> dict[str, str]:
    """A dataclass's attribute docstrings (the string right after each annotated field)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                docs[node.target.id] = inspect.cleandoc(str(after.value.value))
    return docs


def args_section(doc: str) -> list[tuple[list[str], str]]:
    """The ``Args:`` entries of a Google-style docstring: ``([names], text)``, a name list for an
    entry that documents several arguments at once (``a, b, c: ...``)."""
    lines = inspect.cleandoc(doc).splitlines()
    try:
        start = lines.index("Args:") + 1
    except ValueError:
        return []
    entries: list[tuple[list[str], str]] = []
    names_buffer = ""
    for line in lines[start:]:
        if line and not line.startswith(" "):
            break  # the next section (Raises:, Returns:)
        stripped = line.strip()
        if not stripped:
            continue
        indent = len(line) - len(line.lstrip())
        head = re.match(r"^([\w*][\w, *]*?):\s*(.*)$", stripped)
        if indent == 4 and head is None and stripped.endswith(","):  # a name list spanning lines
            names_buffer += stripped + " "
            continue
        if indent == 4 and head is not None:
            names = [n.strip() for n in (names_buffer + head.group(1)).split(",") if n.strip()]
            entries.append((names, head.group(2)))
            names_buffer = ""
        elif entries:
            entries[-1] = (entries[-1][0], entries[-1][1] + " " + stripped)
    return entries


def _arguments(cls: Any, peer: Any = None, skip: tuple[str, ...] = ("self",)) -> str:
    """A table of ``cls.__init__``'s arguments, described by its docstring's ``Args:`` (the
    ``Remaining arguments`` entry covers only arguments that ``peer``'s signature has too)."""
    signature = inspect.signature(cls.__init__)
    peers = set() if peer is None else set(inspect.signature(peer.__init__).parameters)
    described: dict[str, str] = {}
    remaining, groups = None, []
    for names, text in args_section(cls.__doc__ or ""):
        if names == ["Remaining arguments"]:
            remaining = text
            continue
        if len(names) > 1:  # one text for many arguments: written once, below the table
            groups.append(f"{', '.join(f'`{n}`' for n in names)}: {markdown(text)}")
        for name in names:
            described[name] = text if len(names) == 1 else "see the note below the table"
    rows = ["| argument | default | what it does |", "| --- | --- | --- |"]
    missing: list[str] = []
    for name, parameter in signature.parameters.items():
        if name in skip or parameter.kind in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
            continue
        found = described.get(name)
        if found is None:
            if remaining is None or name not in peers:
                missing.append(name)
                continue
            found = remaining
        rows.append(f"| `{name}` | {_default(parameter.default)} | {_cell(found)} |")
    if missing:
        raise SystemExit(f"{cls.__name__}: arguments without a description in its docstring: {missing}")
    return "\n\n".join(["\n".join(rows), *groups])


def _not_taken(cls: Any, peer: Any) -> str:
    ours = set(inspect.signature(cls.__init__).parameters)
    signature = inspect.signature(peer.__init__)
    theirs = [
        ("**" if p.kind == p.VAR_KEYWORD else "") + n
        for n, p in signature.parameters.items()
        if n not in ours and n != "self"
    ]
    names = ", ".join(f"`{n}`" for n in theirs)
    return f"`{peer.__module__}.{peer.__name__}` arguments it does not take (a `TypeError`): {names}."


def _fields(cls: Any, skip: tuple[str, ...] = ()) -> str:
    """A table of a settings dataclass's fields: type, default and docstring."""
    docs = field_docs(cls)
    rows = ["| field | type | default | what it does |", "| --- | --- | --- | --- |"]
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        if field.name not in docs:
            raise SystemExit(f"{cls.__name__}.{field.name} has no docstring")
        default = field.default if field.default is not dataclasses.MISSING else inspect.Parameter.empty
        kind, doc = _cell(str(field.type)), _cell(docs[field.name])
        rows.append(f"| `{field.name}` | `{kind}` | {_default(default)} | {doc} |")
    return "\n".join(rows)


def _lightning(cls: Any, peer: Any) -> str:
    """The Lightning arguments a strategy takes, after checking its signature is exactly the fields of
    ``ZeroConfig`` and ``ZeroOptions`` and these (one source: nothing else may appear)."""
    from lightning_zero.integrations.arguments import LIGHTNING_ARGUMENTS, lightning_name, zero_fields

    names = [lightning_name(n, peer) for n in LIGHTNING_ARGUMENTS]
    signature = inspect.signature(cls)
    expected = [f.name for f in zero_fields()] + names
    if list(signature.parameters) != expected:
        raise SystemExit(
            f"{cls.__name__}'s signature is not ZeroConfig's + ZeroOptions' + Lightning's: {signature}"
        )
    rows = ["| argument | default | what it does |", "| --- | --- | --- |"]
    for generic, name in zip(LIGHTNING_ARGUMENTS, names, strict=True):
        default = signature.parameters[name].default
        rows.append(f"| `{name}` | {_default(default)} | {_cell(LIGHTNING_ARGUMENTS[generic])} |")
    return "\n".join(rows)


def _summary() -> str:
    """``docs/strategy.md``'s table: every strategy argument of ours, its default and its docstring."""
    from lightning_zero.integrations.arguments import zero_fields
    from lightning_zero.integrations.options import ZeroConfig, ZeroOptions

    docs = {**field_docs(ZeroConfig), **field_docs(ZeroOptions)}
    rows = ["| argument | default | what it does |", "| --- | --- | --- |"]
    for field in zero_fields():
        summary = _cell(docs[field.name])
        rows.append(f"| `{field.name}` | {_default(field.default)} | {summary} |")
    return "\n".join(rows)


def _methods(cls: Any) -> str:
    rows = []
    for name, member in sorted(vars(cls).items()):
        if name.startswith("_") or not (inspect.isfunction(member) or isinstance(member, property)):
            continue
        doc = inspect.getdoc(member) or ""
        first = doc.split("\n\n")[0]
        shown = (
            name if isinstance(member, property) else f"{name}{inspect.signature(member)}".replace("'", "")
        )
        rows.append(f"- `{shown}`: {_cell(first)}")
    return "\n".join(rows)


def _help(argv: list[str]) -> str:
    from lightning_zero.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main(argv)
    return out.getvalue().rstrip()


def render() -> str:
    os.environ["COLUMNS"] = "100"  # argparse wraps its help to the terminal: a fixed width
    from lightning.fabric.strategies import DDPStrategy as FabricDDP
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero import ShardedAdamW, ZeroConfig, ZeroFabricStrategy, ZeroStrategy
    from lightning_zero.integrations.options import ZeroOptions

    takes = (
        "Keyword arguments only, each optional: every field of `ZeroConfig` and of `ZeroOptions` "
        "(above), and these of Lightning's `DDPStrategy`:"
    )

    parts = [
        "# Reference (generated from the code)",
        "",
        "<!-- generated by `python scripts/reference.py`; `tests/docs/test_reference.py` fails when this "
        "page differs from the code. Edit the docstrings, then rerun the script. -->",
        "",
        "Every argument of the public classes, with its default and its docstring, and the `--help` of",
        "every command. The guides explain when to use what: [strategy](strategy.md),",
        "[Fabric](fabric.md), [ShardedAdamW](sharded-adamw.md), [checkpoints](checkpoints.md).",
        "",
        "## `lightning_zero.ZeroConfig`",
        "",
        (inspect.getdoc(ZeroConfig) or "").split("\n\n")[0],
        "",
        _fields(ZeroConfig),
        "",
        "## `lightning_zero.integrations.options.ZeroOptions`",
        "",
        (inspect.getdoc(ZeroOptions) or "").split("\n\n")[0],
        "",
        _fields(ZeroOptions, skip=("config",)),
        "",
        "## `lightning_zero.ZeroStrategy`",
        "",
        '`Trainer(strategy=ZeroStrategy(...))`; the names `"zero"`, `"zero1"`, `"zero2"`,',
        '`"zero3"` are it with `stage` 2, 1, 2, 3.',
        "",
        takes,
        "",
        _lightning(ZeroStrategy, DDPStrategy),
        "",
        _not_taken(ZeroStrategy, DDPStrategy),
        "",
        "## `lightning_zero.ZeroFabricStrategy`",
        "",
        "`Fabric(strategy=ZeroFabricStrategy(...))`; the same names as for the Trainer.",
        "",
        takes,
        "",
        _lightning(ZeroFabricStrategy, FabricDDP),
        "",
        "`log_comm_stats=True` and `async_checkpoint=True` are refused (they need the Trainer's logging "
        "and end-of-fit hooks).",
        "",
        _not_taken(ZeroFabricStrategy, FabricDDP),
        "",
        "## `lightning_zero.ShardedAdamW`",
        "",
        _arguments(ShardedAdamW),
        "",
        "Its public methods and properties (first paragraph of each docstring):",
        "",
        _methods(ShardedAdamW),
        "",
        "## `lightning-zero` commands",
        "",
    ]
    for argv in [["--help"]] + [[c, "--help"] for c in COMMANDS]:
        parts += [f"`lightning-zero {' '.join(argv)}`:", "", "```text", _help(argv), "```", ""]
    return "\n".join(parts).rstrip() + "\n"


def guide(text: str) -> str:
    """``docs/strategy.md`` with its generated blocks rewritten (``arguments``, ``lightning``)."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero import ZeroStrategy

    tables = {"arguments": _summary(), "lightning": _lightning(ZeroStrategy, DDPStrategy)}
    found = {m.group(2) for m in BLOCK.finditer(text)}
    if found != set(tables):
        raise SystemExit(f"{GUIDE}: expected generated blocks {sorted(tables)}, found {sorted(found)}")
    return BLOCK.sub(lambda m: m.group(1) + tables[m.group(2)] + "\n" + m.group(4), text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    pages = {PAGE: render(), GUIDE: guide(GUIDE.read_text())}
    stale = [path for path, text in pages.items() if not path.is_file() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path} differs from the code: run python scripts/reference.py")
        return 1 if stale else 0
    for path in stale:
        path.write_text(pages[path])
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
