"""Write ``docs/reference.md`` from the code: every argument of ``ZeroConfig``, ``ZeroStrategy``,
``ZeroFabricStrategy`` and ``ShardedAdamW`` (signature, default, the docstring's description, the
``DDPStrategy`` arguments they do not take) and the ``--help`` of every ``lightning-zero`` command.

    python scripts/reference.py          # rewrite docs/reference.md
    python scripts/reference.py --check  # exit 1 if docs/reference.md differs from the code

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
COMMANDS = ("consolidate", "verify", "estimate", "preflight")


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


def _config() -> str:
    from lightning_zero import ZeroConfig

    docs = field_docs(ZeroConfig)
    rows = ["| field | type | default | what it does |", "| --- | --- | --- | --- |"]
    for field in dataclasses.fields(ZeroConfig):
        if field.name not in docs:
            raise SystemExit(f"ZeroConfig.{field.name} has no docstring")
        default = field.default if field.default is not dataclasses.MISSING else inspect.Parameter.empty
        kind, doc = _cell(str(field.type)), _cell(docs[field.name])
        rows.append(f"| `{field.name}` | `{kind}` | {_default(default)} | {doc} |")
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

    from lightning_zero import ShardedAdamW, ZeroFabricStrategy, ZeroStrategy

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
        (inspect.getdoc(__import__("lightning_zero").ZeroConfig) or "").split("\n\n")[0],
        "",
        _config(),
        "",
        "## `lightning_zero.ZeroStrategy`",
        "",
        '`Trainer(strategy=ZeroStrategy(...))`; the names `"zero"`, `"zero1"`, `"zero2"`,',
        '`"zero3"` are it with `stage` 2, 1, 2, 3.',
        "",
        _arguments(ZeroStrategy, DDPStrategy),
        "",
        _not_taken(ZeroStrategy, DDPStrategy),
        "",
        "## `lightning_zero.ZeroFabricStrategy`",
        "",
        "`Fabric(strategy=ZeroFabricStrategy(...))`; the same names as for the Trainer.",
        "",
        _arguments(ZeroFabricStrategy, FabricDDP),
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE} differs from the code: run python scripts/reference.py")
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
