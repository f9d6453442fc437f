"""Register the ``zero`` strategies with Lightning when Lightning is imported, not before (and keep
torch's import-time capture of the world group away from the user's process group, see the end).

``import lightning_zero`` must make ``Trainer(strategy="zero")`` and ``Fabric(strategy="zero")`` work
(the public contract), yet a user of the standalone :class:`~lightning_zero.ShardedAdamW` should not
pay Lightning's import (about 4 s here). Lightning has no plugin entry point for strategies, so the
registration runs right after Lightning's own package has finished importing:

  * each strategy module registers itself at the end of its own import (Trainer: ``"zero"``,
    ``"zero1"``, ``"zero2"`` and the ``load_from_checkpoint`` loader; Fabric: the same names);
  * if ``lightning.pytorch`` / ``lightning.fabric`` is already imported, that strategy module is
    imported at once;
  * otherwise a finder on ``sys.meta_path`` wraps the loader of that package, and the registration
    runs when the package's ``__init__`` has run to its end (the registry and everything our
    strategy imports then exist). The finder removes itself once every action has run.

The same mechanism runs one thing after ``torch`` is imported: ``torch.distributed.nn``, whose
functions take ``group=group.WORLD`` as a default argument, evaluated when that module is imported.
Imported after ``init_process_group`` it holds the world group forever: ``destroy_process_group()``
then cannot free it, gloo's worker threads outlive the user's script, and a worker still releasing
a finished collective when the interpreter shuts down aborts the process after all its work is done
("terminate called without an active exception", 2 of 30 runs of a 2-rank script here). Our engine's
first use imports it (through ``torch._dynamo``, which ``torch.compiler.disable`` needs), and with
the lazy package face that first use comes after the user's ``init_process_group``; importing it
with torch (4 ms), before any group exists, keeps it from capturing one. Lightning imports it with
itself, so only the standalone optimizer needed this.

This module imports nothing of Lightning itself.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any


def _import(module: str) -> Callable[[], None]:
    """Importing the strategy module registers it (its last lines). A module already in
    ``sys.modules`` is not run again: complete, it registered; partially initialised (it imported
    Lightning, which brought us here), it registers when its own import reaches its end."""

    def run() -> None:
        importlib.import_module(module)

    return run


def _before_any_group() -> None:
    """Import what must come before a process group exists (see the module docstring). When torch's
    import came from ``lightning_zero.comm.backends`` itself (``import lightning_zero.comm`` before
    torch), that module is half-imported here: it runs this at its own end instead."""
    backends = sys.modules.get("lightning_zero.comm.backends")
    if backends is not None and not hasattr(backends, "before_any_group"):
        return
    importlib.import_module("lightning_zero.comm.backends").before_any_group()


ACTIONS: dict[str, Callable[[], None]] = {
    "lightning.pytorch": _import("lightning_zero.integrations.trainer.strategy"),
    "lightning.fabric": _import("lightning_zero.integrations.fabric.strategy"),
    "torch": _before_any_group,
}
"""Package -> what to run once it is imported."""


class _Loader(importlib.abc.Loader):
    """The package's own loader, plus an action once the module has executed."""

    def __init__(self, loader: Any, action: Callable[[], None]) -> None:
        self._loader, self._action = loader, action

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader  # later readers see the real loader
        self._loader.exec_module(module)
        try:
            self._action()
        except Exception as err:  # noqa: BLE001 - never break the user's `import lightning`
            warnings.warn(
                f"lightning-zero could not register its strategies with (or prepare after) "
                f"{module.__name__}: {type(err).__name__}: {err}",
                stacklevel=2,
            )

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self._loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``ACTIONS[name]`` when the package ``name`` has been imported."""

    def __init__(self, pending: dict[str, Callable[[], None]]) -> None:
        self.pending = pending
        self._lock = threading.Lock()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        with self._lock:
            action = self.pending.pop(fullname, None)
            if not self.pending and self in sys.meta_path:
                sys.meta_path.remove(self)
        if action is None:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, action)
                return spec
        return None


def install(actions: dict[str, Callable[[], None]] | None = None) -> None:
    """Run each action now if its package is imported, else right after it is. Idempotent per package."""
    actions = dict(ACTIONS if actions is None else actions)
    for finder in sys.meta_path:
        if isinstance(finder, _AfterImport):
            for name in list(actions):
                if name in finder.pending:
                    del actions[name]  # already waiting for it
    pending = {}
    for name, action in actions.items():
        if name in sys.modules:
            action()
        else:
            pending[name] = action
    if pending:
        sys.meta_path.insert(0, _AfterImport(pending))
