"""Suite-wide pytest settings.

Every test runs with the collective-order recorder on (``LZ_COLLECTIVE_LOG``, see
:mod:`lightning_zero.comm.recorder`): each rank that any launch of the test starts logs the
collectives it issues, and after the test the ranks of each launch must have issued the same sequence
per process group and across groups, as NCCL requires; the first difference fails the test, naming
the ranks, the position and both collectives (the launches of a module-scoped fixture are checked
after the first test that uses it). A test whose launches fail on purpose is marked
``collective_faults`` and compared up to where its first rank stopped.

`make test` runs the suite on two pytest-xdist workers, a whole file per worker (``--dist loadfile``:
a module's launched ranks and fixtures stay together). Most of the suite is launched processes, and
on the 2-core test machine a launch often keeps one core busy (Lightning's launcher starts rank 1 only
once rank 0 has imported Lightning; SLURM schedules; a fault test waits out a timeout), so the second
worker fills the other core. The longest files are collected first, so that a worker does not start
one of them when the other is almost done.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_zero.comm import recorder

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


def pytest_configure(config: pytest.Config) -> None:
    # set once per pytest process (each xdist worker its own: a worker inherits the controller's
    # environment, and must not compare or remove the other's logs), so that the launches of module-
    # and session-scoped fixtures log too
    os.environ[recorder.ENV_DIR] = tempfile.mkdtemp(prefix="lz-collectives-")
    # one intra-op thread per pytest process, as every launched rank has (OMP_NUM_THREADS=1): two xdist
    # workers of two threads each beside the launched ranks oversubscribe the 2-core machine (an
    # in-process training test took 63 s in the suite against 3 s alone)
    torch.set_num_threads(1)


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(os.environ.get(recorder.ENV_DIR, ""), ignore_errors=True)  # this process's logs


@pytest.fixture(autouse=True)
def collective_order(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test, compare the logs of every launch since the last test (its fixtures' launches
    included) and remove them."""
    yield
    directory = Path(os.environ[recorder.ENV_DIR])
    faults = request.node.get_closest_marker("collective_faults") is not None
    problems = recorder.compare_logs(directory, prefix_only=faults)
    for path in directory.glob("*.jsonl"):
        path.unlink(missing_ok=True)
    if problems:
        pytest.fail(
            "ranks issued different collective sequences (NCCL would hang or mix up tensors):\n"
            + "\n".join(problems),
            pytrace=False,
        )
