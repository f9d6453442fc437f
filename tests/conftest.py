"""Suite-wide pytest settings.

`make test` runs the suite on two pytest-xdist workers, a whole file per worker (``--dist loadfile``:
a module's launched ranks and fixtures stay together). Most of the suite is launched processes, and
on the 2-core test machine a launch often keeps one core busy (Lightning's launcher starts rank 1 only
once rank 0 has imported Lightning; SLURM schedules; a fault test waits out a timeout), so the second
worker fills the other core. The longest files are collected first, so that a worker does not start
one of them when the other is almost done.
"""

from __future__ import annotations

import pytest

# Files that take minutes on the 2-core machine, longest first; every other file keeps its place after them.
LONGEST_FIRST = (
    "tests/cluster/test_slurm_and_torchrun.py",
    "tests/docs/test_docs.py",
    "tests/recipes/test_pretrain_cli.py",
    "tests/distributed/test_faults.py",
    "tests/conformance/test_conformance.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a file, and among the other files, is kept
