"""Stage 3: ``state_dict()`` and ``load_state_dict()`` of a sharded model see full values, one unit
at a time.

Between steps (and after ``fit``) a stage-3 model's parameters are placeholders
(:mod:`lightning_zero.layout.flat`). Hooks on every module that holds planned parameters itself,
and on every unit's module, make the two module methods work on the full values anyway:

  * ``state_dict()``: the first module of a unit reached gathers the unit; each module's entries are
    copied (``keep_vars=False``) before the unit is freed again, at the end of the unit module's
    ``state_dict`` (or of the outermost call). A whole-model ``state_dict()`` so holds at most one
    unit gathered, plus the root and the copies it returns.
  * ``load_state_dict()``: a module whose parameters have entries in the given dict gathers their
    unit before the copy; at the end of the unit module's load (or of the outermost call) each
    rank keeps its slice of what was written as its shard, and the unit is freed.

Both are collectives: every rank must call them, in the same order (as with FSDP's full state
dict); a call on one rank waits for the others until the process group's timeout. Units already
gathered when the call starts stay as they are. :meth:`UnitRequests.off` turns the gathers off
for a caller that drops the trainable entries anyway (a sharded checkpoint save).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import nn

from lightning_zero.layout.buckets import Bucket
from lightning_zero.layout.flat import FlatParams
from lightning_zero.layout.units import UnitLayout


class _Unit(Protocol):
    buckets: list[Bucket]


class Units(Protocol):
    """What the hooks use of :class:`~lightning_zero.engine.unit_gather.UnitGather` (its owner)."""

    flat: FlatParams
    layout: UnitLayout

    @property
    def units(self) -> Sequence[_Unit]: ...

    def gathered(self, unit: int) -> bool: ...

    def gather(self, unit: int, wait: bool = True) -> None: ...

    def free(self, unit: int) -> None: ...


class UnitRequests:
    """The state-dict hooks of one stage-3 model (removed with :meth:`remove_hooks`)."""

    def __init__(self, units: Units, root: nn.Module, after_write: Callable[[], None]) -> None:
        self.units = units
        self.after_write = after_write
        """Called once a load wrote shards (the engine re-reads separate fp32 masters)."""
        self.enabled = True
        self._depth = 0
        self._keep_vars: list[bool] = []
        self._requested: set[int] = set()
        """Units gathered for the call in progress (freed at its end)."""
        self._written: set[int] = set()
        """Units whose parameters a load in progress wrote (each rank keeps its slice at the end)."""
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        index_of = {id(p): i for i, p in enumerate(units.flat.params)}
        unit_of_module = {id(m): u for u, m in enumerate(units.layout.modules)}
        for module in root.modules():
            direct = [
                (name, units.layout.of_param[index_of[id(p)]])
                for name, p in module._parameters.items()
                if p is not None and id(p) in index_of
            ]
            unit = unit_of_module.get(id(module))
            if not direct and unit is None:
                continue
            self._hooks += [
                module.register_state_dict_pre_hook(self._save_pre(direct)),
                module.register_state_dict_post_hook(self._save_post(direct, unit)),
                module.register_load_state_dict_pre_hook(self._load_pre(direct)),
                module.register_load_state_dict_post_hook(self._load_post(unit)),
            ]

    @contextmanager
    def off(self) -> Iterator[None]:
        """Inside, ``state_dict()`` returns the placeholders of freed units (no gather)."""
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled

    def _request(self, unit: int, write: bool) -> None:
        if not self.units.gathered(unit):
            self._requested.add(unit)
        self.units.gather(unit)  # completes a prefetch in flight too
        if write:
            self._written.add(unit)

    def _release(self, unit: int | None) -> None:
        """The end of ``unit``'s module's call (or, at depth 0, of the outermost call): written units
        keep their slices as shards, units gathered for the call are freed."""
        done = set(self._requested | self._written) if self._depth == 0 else set() if unit is None else {unit}
        written = done & self._written
        for u in sorted(written):
            self.units.flat.keep_own_slices(self.units.units[u].buckets)
        for u in sorted(done & self._requested):
            self.units.free(u)
        self._written -= done
        self._requested -= done
        if written:
            self.after_write()

    # ---- state_dict -------------------------------------------------------------------------

    def _save_pre(self, direct: list[tuple[str, int]]) -> Callable[..., None]:
        def hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
            self._depth += 1
            self._keep_vars.append(keep_vars)
            if self.enabled:
                for unit in dict.fromkeys(u for _, u in direct):
                    self._request(unit, write=False)

        return hook

    def _save_post(self, direct: list[tuple[str, int]], unit: int | None) -> Callable[..., None]:
        def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
            keep_vars = self._keep_vars.pop()
            self._depth -= 1
            if self.enabled:
                if not keep_vars:  # the entries are views of a buffer freed below: copies
                    for name, _ in direct:
                        key = prefix + name
                        if key in state_dict:
                            state_dict[key] = state_dict[key].clone()
                self._release(unit)

        return hook

    # ---- load_state_dict --------------------------------------------------------------------

    def _load_pre(self, direct: list[tuple[str, int]]) -> Callable[..., None]:
        def hook(
            module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any, *_: Any
        ) -> None:
            if local_metadata.get("assign_to_params_buffers", False) and direct:
                raise RuntimeError(
                    "stage 3: load_state_dict(assign=True) would replace the sharded parameters of "
                    f"{type(module).__name__} {prefix.rstrip('.') or '<root>'!r}; load with assign=False"
                )
            self._depth += 1
            if self.enabled:
                for name, unit in direct:
                    if prefix + name in state_dict:
                        self._request(unit, write=True)

        return hook

    def _load_post(self, unit: int | None) -> Callable[..., None]:
        def hook(module: nn.Module, incompatible_keys: Any) -> None:
            self._depth -= 1
            if self.enabled:
                self._release(unit)

        return hook

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
