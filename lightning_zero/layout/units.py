"""Units of gathering for stage 3: the parameters that are all-gathered, used and freed together.

At stage 3 a rank keeps only its shard of every parameter; a unit's full parameters exist only
around the unit's forward and backward (:mod:`lightning_zero.engine.unit_gather`). A *unit* is a
submodule whose forward the model calls, e.g. one transformer block, plus the *root* unit (index 0):
the parameters of no other unit (embeddings, final norm, output layer), gathered for the whole
forward and backward.

Which submodules are units:
  * ``unit_modules`` given (a tuple of module classes, as Lightning's FSDP strategy takes an
    auto-wrap policy): every submodule of those classes;
  * otherwise every submodule held in an ``nn.ModuleList`` or ``nn.Sequential`` (the repeated blocks
    of a transformer, the layers of a sequential model) with at least ``min_unit_numel`` trainable
    elements in its subtree and no such block around it (a block's own ``nn.Sequential`` MLP is part
    of the block's unit: one gather per block, as FSDP's per-block wrapping does), and every other
    submodule outside those that holds at least
    ``min_unit_numel`` trainable elements itself (not through a child): the embedding and the output
    layer of a language model, which would otherwise stay gathered for the whole step in the root.

A parameter belongs to the innermost unit that holds it; one held by two units (weights tied across
blocks) belongs to the root, which is gathered whenever either runs. Units that end up with no
parameter are dropped. Pure module inspection: no communication, no tensors allocated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
"""Modules without a forward of their own: never a unit (their pre-forward hook would never run)."""


@dataclass(frozen=True)
class UnitLayout:
    """The units of a model: unit 0 is the root."""

    modules: tuple[nn.Module, ...]
    names: tuple[str, ...]
    """Qualified module names (``""``: the root)."""
    of_param: tuple[int, ...]
    """The unit of each parameter, in the order given to :func:`find_units`."""

    def params_of(self, unit: int) -> list[int]:
        """Indices of the parameters of ``unit``."""
        return [i for i, u in enumerate(self.of_param) if u == unit]


def find_units(
    root: nn.Module,
    params: Sequence[nn.Parameter],
    unit_modules: tuple[type[nn.Module], ...] | None = None,
    min_unit_numel: int = 0,
) -> UnitLayout:
    """The units of ``root`` for ``params`` (the planned parameters, in plan order).

    Args:
        root: the model.
        params: the parameters to place (those of the optimizer; any not in ``root`` go to the root unit).
        unit_modules: module classes that are units; ``None``: the blocks of containers (see above).
        min_unit_numel: without ``unit_modules``, a block with fewer trainable elements is no unit.

    Returns:
        The layout; its units are numbered in module registration order, the root first.
    """
    planned = {p: i for i, p in enumerate(params)}
    parent: dict[nn.Module, nn.Module] = {}
    for module in root.modules():
        for child in module.children():
            parent.setdefault(child, module)
    candidates = [
        (name, module)
        for name, module in root.named_modules()
        if module is not root and _is_unit(module, parent.get(module), unit_modules, min_unit_numel)
    ]
    if unit_modules is None:  # the outermost blocks: a block's own Sequential is no unit of its own
        chosen: set[nn.Module] = set()
        for _, module in candidates:  # registration order: an ancestor comes first
            if not _has_ancestor_in(module, parent, chosen):
                chosen.add(module)
        candidates = [(name, module) for name, module in candidates if module in chosen]
        candidates += _large_leaves(root, chosen, min_unit_numel)
        order = {m: i for i, (_, m) in enumerate(root.named_modules())}
        candidates.sort(key=lambda c: order[c[1]])
    candidate_set = {module for _, module in candidates}
    claims: dict[int, list[int]] = {}  # parameter index -> candidates whose own parameters hold it
    for c, (_, module) in enumerate(candidates):
        for p in dict.fromkeys(_own_params(module, candidate_set)):  # a shared submodule once
            if p in planned:
                claims.setdefault(planned[p], []).append(c)
    kept = sorted({owners[0] for owners in claims.values() if len(owners) == 1})
    number = {c: u + 1 for u, c in enumerate(kept)}
    of_param = tuple(number[claims[i][0]] if len(claims.get(i, ())) == 1 else 0 for i in range(len(params)))
    return UnitLayout(
        modules=(root, *(candidates[c][1] for c in kept)),
        names=("", *(candidates[c][0] for c in kept)),
        of_param=of_param,
    )


def _is_unit(
    module: nn.Module,
    parent: nn.Module | None,
    unit_modules: tuple[type[nn.Module], ...] | None,
    min_unit_numel: int,
) -> bool:
    if isinstance(module, _CONTAINERS):
        return False
    if unit_modules is not None:
        return isinstance(module, unit_modules)
    if not isinstance(parent, nn.ModuleList | nn.Sequential):
        return False
    return sum(p.numel() for p in module.parameters() if p.requires_grad) >= min_unit_numel


def _has_ancestor_in(module: nn.Module, parent: dict[nn.Module, nn.Module], modules: set[nn.Module]) -> bool:
    ancestor = parent.get(module)
    while ancestor is not None:
        if ancestor in modules:
            return True
        ancestor = parent.get(ancestor)
    return False


def _large_leaves(root: nn.Module, units: set[nn.Module], min_unit_numel: int) -> list[tuple[str, nn.Module]]:
    """Modules outside every unit whose own trainable parameters (not a child's) reach the threshold."""
    found: list[tuple[str, nn.Module]] = []
    seen: set[nn.Module] = set()

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            if child in units or child in seen:
                continue
            seen.add(child)
            path = f"{prefix}{name}"
            own = sum(p.numel() for p in child._parameters.values() if p is not None and p.requires_grad)
            if own and own >= min_unit_numel and not isinstance(child, _CONTAINERS):
                found.append((path, child))
            visit(child, f"{path}.")

    visit(root, "")
    return found


def _own_params(module: nn.Module, units: set[nn.Module]) -> list[nn.Parameter]:
    """``module``'s parameters that no unit nested inside it holds."""
    own = [p for p in module._parameters.values() if p is not None]
    for child in module.children():
        if child not in units:
            own += _own_params(child, units)
    return own
