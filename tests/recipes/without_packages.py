"""Run a module as `python -m` does, in an environment that lacks some installed packages:

    python -m tests.recipes.without_packages matplotlib,wandb recipes.pretrain [arguments...]

"Lacks" as far as any code can tell: importing one of them (or a submodule) raises
`ModuleNotFoundError`, and `importlib.metadata` finds no distribution of that name. Both matter: a
`sys.modules[name] = None` shim alone is not what a user without the package has, because libraries
probe the metadata first (torchmetrics imports matplotlib at import time when matplotlib's metadata is
there, Lightning's loggers check their client's metadata in their constructors) and would fail, or
pass, where the user's environment does not.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import re
import runpy
import sys
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class Hidden(importlib.abc.MetaPathFinder):
    """First on `sys.meta_path`: refuses the hidden top-level packages and everything below them."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> None:
        if fullname.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def hide(names: Iterable[str]) -> None:
    """Make `names` (top-level import names, also their distribution names) unimportable and unlisted."""
    names = frozenset(names)
    for module in [m for m in sys.modules if m.partition(".")[0] in names]:
        del sys.modules[module]
    sys.meta_path.insert(0, Hidden(names))
    distributions = frozenset(canonical(name) for name in names)
    finder = importlib.metadata.MetadataPathFinder
    original = finder.find_distributions

    def find_distributions(context: Any = None) -> Any:
        context = importlib.metadata.DistributionFinder.Context() if context is None else context
        if context.name is not None:
            return iter(()) if canonical(context.name) in distributions else original(context)
        return (d for d in original(context) if canonical(d.metadata["Name"] or "") not in distributions)

    finder.find_distributions = staticmethod(find_distributions)  # type: ignore[method-assign,assignment]


def main() -> None:
    packages, module, *arguments = sys.argv[1:]
    hide(packages.split(","))
    sys.argv = [module, *arguments]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
