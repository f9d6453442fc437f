"""The tensors of a stage-3 unit's forward output that its backward hook attaches to.

:mod:`lightning_zero.engine.unit_gather` registers one multi-grad hook per unit forward on these
tensors; it fires before the unit's backward and gathers the unit's parameters again.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from collections.abc import Mapping

import torch
from torch.utils._pytree import tree_flatten

_PLAIN = (type(None), bool, numbers.Number, str, bytes, enum.Enum, torch.dtype, torch.device, torch.layout)
"""Output values that hold no tensor."""


def grad_outputs(output: object, unit: str) -> list[torch.Tensor]:
    """The tensors requiring grad in a unit's forward output: the leaves of its pytree, and within them
    the fields of dataclasses and the items of mappings, lists and tuples that pytree does not know.

    Raises:
        TypeError: the output holds another object: tensors inside it could not be hooked, and the
            unit's backward would run on freed parameters.
    """
    found: list[torch.Tensor] = []
    pending: list[object] = [output]
    seen: set[int] = set()
    while pending:
        for leaf in tree_flatten(pending.pop())[0]:
            if isinstance(leaf, torch.Tensor):
                if leaf.requires_grad:
                    found.append(leaf)
            elif isinstance(leaf, _PLAIN) or id(leaf) in seen:
                continue
            elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
                seen.add(id(leaf))
                pending.append([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
            elif isinstance(leaf, (Mapping, list, tuple)):
                seen.add(id(leaf))
                pending.append(list(leaf.values()) if isinstance(leaf, Mapping) else list(leaf))
            else:
                kind = type(leaf)
                raise TypeError(
                    f"stage 3: unit {unit!r} returned a {kind.__module__}.{kind.__qualname__} from its "
                    "forward (with gradients on), whose tensors its backward hook cannot find, so its "
                    "backward would run on freed parameters. Return tensors, or tuples, lists, dicts, "
                    "named tuples or dataclasses of them (or register the type with torch.utils._pytree)"
                )
    return found
