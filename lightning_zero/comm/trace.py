"""Named ranges in profiler traces: every bucket's launch and collection, every unit's gather and
free, the optimizer's update of each shard, each collective and each wait, and the phases of a
checkpoint appear by name in a ``torch.profiler`` trace (and in an Nsight Systems timeline on CUDA:
NVTX ranges), so a trace of a step shows lightning-zero's schedule, not only torch's kernels.

Names start with ``lightning_zero``: ``lightning_zero bucket 3: launch``, ``lightning_zero unit
blocks.0: gather``, ``lightning_zero shard: gradient reduce-scatter``. Outside a profiler a range
costs one check (about 0.2 microseconds; a ``record_function`` itself costs about 12 here), and on
CUDA an NVTX push and pop, which do nothing unless a tool such as Nsight listens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

PREFIX = "lightning_zero"

_NVTX = torch.cuda.is_available()
"""NVTX exists only in a CUDA build with a device (a CPU build raises on its calls; tests that stand a
CPU tensor in for a CUDA device must not reach them)."""


@contextmanager
def span(name: str, device: torch.device | None = None) -> Iterator[None]:
    """A range named ``f"{PREFIX} {name}"`` around the block: a ``record_function`` while a profiler
    records, and an NVTX range when ``device`` is a CUDA device."""
    nvtx = _NVTX and device is not None and device.type == "cuda"
    if not (nvtx or torch._C._autograd._profiler_enabled()):
        yield
        return
    label = f"{PREFIX} {name}"
    if nvtx:
        torch.cuda.nvtx.range_push(label)
    try:
        if torch._C._autograd._profiler_enabled():
            with torch.profiler.record_function(label):
                yield
        else:
            yield
    finally:
        if nvtx:
            torch.cuda.nvtx.range_pop()
