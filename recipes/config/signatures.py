"""Config schemas and argument checks read from constructor signatures, so they never drift.

What a `_target_` node may hold is what its class accepts: the Lightning `Trainer`, the strategies,
loggers and callbacks are configured with every argument of their `__init__`, read with `inspect`
from the installed versions. Two layers use it:

- Compose time. `schema_for(cls)` makes a dataclass with one field per keyword argument, registered in
  Hydra's ConfigStore by `recipes.config.schema`: a misspelt key or a wrong simple type fails while
  Hydra composes, naming the full key. OmegaConf 2.3 checks `int`, `float`, `bool`, `str`, their `Optional`,
  and lists of them; a `Literal` of strings becomes `str`, `str | Path` becomes `str`, everything else
  (`int | float`, classes, callables) is `Any`. A default OmegaConf cannot hold is written as a
  `_target_` node when it is a `timedelta` (`{_target_: datetime.timedelta, seconds: 1800}`), else
  the argument is left out (then it can still be added with `+key=`).
- Validate time. `check_arguments(values, key)` checks a resolved `_target_` node against the full
  signature of its class: an argument it does not take is refused with the closest valid names
  (`**kwargs` classes accept any; `DDPStrategy`'s are checked against `DistributedDataParallel`,
  which receives them), and each value against its full annotation (unions, `Literal` choices, lists;
  an object is given as a nested `_target_` node, checked the same way).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Any, Literal, Optional, Union

from hydra.utils import get_object
from lightning.pytorch.strategies import DDPStrategy
from omegaconf import MISSING
from torch.nn.parallel import DistributedDataParallel

PRIMITIVES = (int, float, bool, str)
KWARGS_RECEIVERS: dict[type, tuple[Callable[..., Any], frozenset[str]]] = {
    # DDPStrategy(**kwargs) passes them to torch's DistributedDataParallel, minus what Lightning sets.
    DDPStrategy: (
        DistributedDataParallel,
        frozenset({"module", "device_ids", "process_group", "device_mesh"}),
    ),
}
SIGNATURE_SCHEMA = "__signature_schema__"
"""Attribute marking a generated schema: its keys are checked against the signature, not the fields."""


class ArgumentError(ValueError):
    """A `_target_` node's key or value that its class does not accept; the message names both."""


@dataclasses.dataclass(frozen=True)
class Signature:
    """The keyword arguments of one callable, with resolved annotations."""

    parameters: dict[str, inspect.Parameter]
    hints: dict[str, Any]
    var_keyword: bool


def read_signature(target: Callable[..., Any]) -> Signature | None:
    """Keyword arguments of `target` (a class: its constructor); None when Python cannot tell (builtins)."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    function = target.__init__ if isinstance(target, type) else target  # type: ignore[misc]
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # an annotation naming something not importable here: check keys, not types
        hints = {}
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    parameters = {n: p for n, p in signature.parameters.items() if p.kind in kinds}
    var_keyword = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    receiver = next((r for cls, r in KWARGS_RECEIVERS.items() if target is cls), None)
    if receiver is not None:  # the **kwargs are another callable's arguments: check those instead
        inner = read_signature(receiver[0])
        assert inner is not None
        extra = {n: p for n, p in inner.parameters.items() if n not in receiver[1] and n not in parameters}
        parameters, hints = {**parameters, **extra}, {**inner.hints, **hints}
        var_keyword = False
    return Signature(parameters=parameters, hints=hints, var_keyword=var_keyword)


def _union_args(annotation: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return typing.get_args(annotation)
    return None


def field_type(annotation: Any, default: Any) -> Any:
    """The OmegaConf type of a schema field for `annotation` (see the module docstring)."""
    optional = default is None
    members = _union_args(annotation)
    if members is not None:
        optional = optional or type(None) in members
        rest = [m for m in members if m is not type(None)]
        if len(rest) == 1:
            annotation = rest[0]
        elif str in rest and all(m in (str, Path, os.PathLike) for m in rest):
            annotation = str
        else:
            return Any
    if typing.get_origin(annotation) is Literal:
        if not all(isinstance(a, str) for a in typing.get_args(annotation)):
            return Any
        annotation = str
    elif typing.get_origin(annotation) is list and typing.get_args(annotation)[0] in PRIMITIVES:
        annotation = list[typing.get_args(annotation)[0]]  # type: ignore[misc]
    elif typing.get_origin(annotation) is tuple and len(set(typing.get_args(annotation)) - {Ellipsis}) == 1:
        member = next(a for a in typing.get_args(annotation) if a is not Ellipsis)  # tuple[float, float]
        if member not in PRIMITIVES:
            return Any
        annotation = list[member]  # type: ignore[valid-type]  # a YAML list; the class takes it as its tuple
    elif annotation not in PRIMITIVES:
        return Any
    return Optional[annotation] if optional else annotation  # noqa: UP045  (OmegaConf reads typing.Optional)


def field_default(value: Any) -> dataclasses.Field[Any] | None:
    """A dataclass field holding `value` as OmegaConf can; None when it cannot."""
    if value is inspect.Parameter.empty:
        return dataclasses.field(default=MISSING)
    if value is None or isinstance(value, PRIMITIVES):
        return dataclasses.field(default=value)
    if isinstance(value, Path):
        return dataclasses.field(default=str(value))
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
        whole = round(seconds) if seconds.is_integer() else seconds
        node = {"_target_": "datetime.timedelta", "seconds": whole}
        return dataclasses.field(default_factory=lambda: dict(node))
    if isinstance(value, list | tuple) and all(isinstance(v, PRIMITIVES) for v in value):
        return dataclasses.field(default_factory=lambda: list(value))
    return None


def schema_for(
    cls: type,
    exclude: Iterable[str] = (),
    overrides: Mapping[str, tuple[Any, dataclasses.Field[Any]]] | None = None,
    *,
    keys_from_signature: bool = True,
) -> type:
    """A dataclass schema of `cls`'s keyword arguments, `_target_` first (its default: `cls` itself).

    `overrides` replaces a field's (type, field) where the recipe differs from the class on purpose
    (a value every model file must set: `MISSING`; an interpolation); each must name an argument whose
    default a schema can hold. `keys_from_signature`: a `+key=` added to the node is checked against
    the class's signature (`validation.check_target_nodes`); `False` for the recipe's own groups,
    whose keys are this schema's fields (`validation.unknown_keys`: "unknown key(s): optim.momentum").
    """
    signature = read_signature(cls)
    assert signature is not None, f"{cls} has no signature"
    unknown = set(overrides or {}) - set(signature.parameters)
    assert not unknown, f"overrides of {cls.__name__} name no argument of it: {sorted(unknown)}"
    fields: list[tuple[str, Any, dataclasses.Field[Any]]] = [
        ("_target_", str, dataclasses.field(default=f"{cls.__module__}.{cls.__qualname__}"))
    ]
    for name, parameter in signature.parameters.items():
        default = field_default(parameter.default)
        if name in exclude or default is None:
            continue
        annotation = signature.hints.get(name, Any)
        kind, default = (overrides or {}).get(name, (field_type(annotation, parameter.default), default))
        fields.append((name, kind, default))
    dropped = set(overrides or {}) - {name for name, _, _ in fields}
    assert not dropped, f"overrides of {cls.__name__} whose class default a schema cannot hold: {dropped}"
    schema = dataclasses.make_dataclass(f"{cls.__name__}Schema", fields)
    setattr(schema, SIGNATURE_SCHEMA, keys_from_signature)
    return schema


def matches(value: Any, annotation: Any) -> bool:
    """Whether a resolved config value can be passed for `annotation` (objects: as `_target_` nodes)."""
    if annotation in (Any, object, inspect.Parameter.empty) or isinstance(annotation, (typing.TypeVar, str)):
        return True
    members = _union_args(annotation)
    if members is not None:
        return any(matches(value, member) for member in members)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return any(value == choice and type(value) is type(choice) for choice in args)
    if annotation is type(None) or value is None:
        return annotation is type(None) and value is None
    if isinstance(value, Mapping) and "_target_" in value:
        return True  # built by instantiate; its own arguments are checked as a node of their own
    if annotation in (bool, str):
        return isinstance(value, annotation)
    if annotation in (int, float):  # an int is a valid float; a bool is neither
        wanted = (int, float) if annotation is float else (int,)
        return isinstance(value, wanted) and not isinstance(value, bool)
    if origin in (list, tuple, Sequence, Iterable) or annotation in (list, tuple):
        element = args[0] if args else Any
        return isinstance(value, list) and all(matches(v, element) for v in value)
    if origin in (dict, Mapping) or annotation is dict:
        element = args[1] if args else Any
        return isinstance(value, Mapping) and all(matches(v, element) for v in value.values())
    if isinstance(annotation, type):
        if issubclass(annotation, (Path, os.PathLike)):
            return isinstance(value, str)
        if issubclass(annotation, Enum):
            return value in {member.value for member in annotation} | {member.name for member in annotation}
        return False  # an object: only a `_target_` node builds one
    return True  # Callable and other typing forms: not checked


def describe(annotation: Any) -> str:
    """`annotation` as a reader wants it in an error message."""
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(repr(choice) for choice in typing.get_args(annotation))
    members = _union_args(annotation)
    if members is not None:
        return " or ".join(describe(member) for member in members)
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and annotation.__module__ != "builtins":
        return f"a {annotation.__name__} (a node with _target_)"
    return str(annotation).replace("typing.", "") if not isinstance(annotation, type) else annotation.__name__


def check_arguments(values: Mapping[str, Any], key: str) -> None:
    """Check a resolved `_target_` node (and nested ones) against its class's signature.

    Raises:
        ArgumentError: naming `key.<argument>`, what is wrong and what would be valid.
    """
    target = values["_target_"]
    try:
        cls = get_object(str(target))
    except Exception as error:
        raise ArgumentError(f"{key}._target_={target} cannot be imported: {error}") from error
    signature = read_signature(cls)
    if signature is None:
        return
    for name, value in values.items():
        if name.startswith("_"):  # _target_, _partial_, _recursive_, _convert_, _args_: Hydra's own
            continue
        if name not in signature.parameters:
            if signature.var_keyword:
                continue
            valid = sorted(signature.parameters)
            close = difflib.get_close_matches(name, valid, n=3, cutoff=0.6)
            hint = f"did you mean {', '.join(close)}?" if close else f"valid: {', '.join(valid)}"
            raise ArgumentError(f"{key}.{name}: {target} takes no argument {name!r}; {hint}")
        annotation = signature.hints.get(name, Any)
        if value is None and signature.parameters[name].default is None:
            continue  # None is the argument's own default, whatever its annotation says
        if not matches(value, annotation):
            raise ArgumentError(f"{key}.{name}={value!r}: {target} wants {describe(annotation)}")
        if isinstance(value, Mapping) and "_target_" in value:
            check_arguments(value, f"{key}.{name}")
