"""Named ranges in profiler traces: every bucket's launch and collection, every unit's gather and
free, the optimizer's update of each shard, each collective and each wait, and the phases of a
checkpoint appear by name in a ``torch.profiler`` trace (and in an Nsight Systems timeline on CUDA:
NVTX ranges), so a trace of a step shows lightning-zero's schedule, not only torch's kernels.

Names start with ``lightning_zero``: ``lightning_zero bucket 3: launch``, ``lightning_zero unit
blocks.0: gather``, ``lightning_zero shard: gradient reduce-scatter``; the table of every name is in
``docs/troubleshooting.md`` ("Slow steps"). Costs (``benchmarks/trace_overhead.py``): outside a
profiler a range is one check and a shared no-op context, about 0.4 microseconds (0.5 with the
caller's f-string of its name), and on CUDA an NVTX push and pop, which do nothing unless a tool such
as Nsight listens. While a profiler records, a range is torch's ``_RecordFunctionFast``, the C++ range
its compiled code records with: about 2 microseconds, against 12 for ``torch.profiler.record_function``
(two dispatcher calls); its events are ``cpu_op`` in a Chrome trace, not ``user_annotation``.
``record_function`` stands in where torch lacks it.

torch's profiler records the thread that started it: ranges opened on another thread (the async
checkpoint writer's) cost the check only and appear in Nsight (NVTX), not in a ``torch.profiler``
trace.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

PREFIX = "lightning_zero"

_NVTX = torch.cuda.is_available()
"""NVTX exists only in a CUDA build with a device (a CPU build raises on its calls; tests that stand a
CPU tensor in for a CUDA device must not reach them)."""


_OFF = nullcontext()

_profiling = torch._C._autograd._profiler_enabled
"""Whether a profiler records on this thread. torch 2.13 has no public name for it:
``torch.autograd.profiler._is_profiler_enabled``, the Python flag, is process-wide (True on threads the
profiler does not record) and private too."""

_record: Callable[[str], AbstractContextManager[Any]] = getattr(
    torch._C._profiler, "_RecordFunctionFast", torch.profiler.record_function
)
"""A range in torch's profiler (see the module docstring)."""


def span(name: str, device: torch.device | None = None) -> AbstractContextManager[Any]:
    """A range named ``f"{PREFIX} {name}"`` around the block: recorded while a profiler records on
    this thread, and an NVTX range when ``device`` is a CUDA device; otherwise a shared no-op
    context."""
    if _NVTX and device is not None and device.type == "cuda":
        return _nvtx(f"{PREFIX} {name}")
    if _profiling():
        return _record(f"{PREFIX} {name}")
    return _OFF


@contextmanager
def _nvtx(label: str) -> Iterator[None]:
    torch.cuda.nvtx.range_push(label)
    try:
        if _profiling():
            with _record(label):
                yield
        else:
            yield
    finally:
        torch.cuda.nvtx.range_pop()
