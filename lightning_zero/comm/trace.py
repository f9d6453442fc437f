"""Named ranges in profiler traces: every bucket's launch and collection, every unit's gather and
free, the optimizer's update of each shard, each collective and each wait, and the phases of a
checkpoint appear by name in a ``torch.profiler`` trace (and in an Nsight Systems timeline on CUDA:
NVTX ranges), so a trace of a step shows lightning-zero's schedule, not only torch's kernels.

Names start with ``lightning_zero``: ``lightning_zero bucket 3: launch``, ``lightning_zero unit
blocks.0: gather``, ``lightning_zero shard: gradient reduce-scatter``. Outside a profiler a range
costs one check and a shared no-op context (about 0.4 microseconds; a ``record_function`` itself
costs about 12 here), and on CUDA an NVTX push and pop, which do nothing unless a tool such as
Nsight listens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

PREFIX = "lightning_zero"

_NVTX = torch.cuda.is_available()
"""NVTX exists only in a CUDA build with a device (a CPU build raises on its calls; tests that stand a
CPU tensor in for a CUDA device must not reach them)."""


_OFF = nullcontext()


def span(name: str, device: torch.device | None = None) -> AbstractContextManager[None]:
    """A range named ``f"{PREFIX} {name}"`` around the block: a ``record_function`` while a profiler
    records, and an NVTX range when ``device`` is a CUDA device; otherwise a shared no-op context."""
    nvtx = _NVTX and device is not None and device.type == "cuda"
    if not (nvtx or torch._C._autograd._profiler_enabled()):
        return _OFF
    return _on(f"{PREFIX} {name}", nvtx)


@contextmanager
def _on(label: str, nvtx: bool) -> Iterator[None]:
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
