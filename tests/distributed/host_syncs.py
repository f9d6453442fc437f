"""Counting host synchronisations in the training hot path, on CPU (test mode).

On CUDA a host synchronisation stalls the CPU until the GPU has caught up, so the host can no longer
queue work ahead: ``torch.cuda.set_sync_debug_mode`` finds them there (``benchmarks/gpu_check.py``).
On CPU nothing waits, so the test suite counts the operations that would: reading a tensor's value on
the host (``.item()``, ``.tolist()``, ``bool``/``float``/``int`` of a tensor, ``.cpu()``, ``.numpy()``)
and Python data copied to a device (``torch.tensor``/``torch.as_tensor`` with a ``device``). A
non-blocking copy out of a pinned host buffer is not one (it is how the engine moves the
used-parameter mask).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")
COPIES = ("tensor", "as_tensor")


class HostSyncs:
    """``with HostSyncs() as syncs: ...``; ``syncs.count`` is what would synchronise on CUDA, by name.

    The methods are wrapped on ``torch.Tensor`` and ``torch`` for the duration (process-wide, in the
    launched rank): a ``TorchFunctionMode`` would not see what autograd's hooks and queued callbacks do,
    which is where the reducer works."""

    def __init__(self) -> None:
        self.count: Counter[str] = Counter()
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> HostSyncs:
        for name in READS:
            self._wrap(torch.Tensor, name, lambda args, kwargs: True)
        for name in COPIES:
            self._wrap(torch, name, lambda args, kwargs: kwargs.get("device") is not None)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def _wrap(self, owner: Any, name: str, counts: Any) -> None:
        original = getattr(owner, name)
        count = self.count

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if counts(args, kwargs):
                count[name] += 1
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, wrapped)

    @property
    def total(self) -> int:
        return sum(self.count.values())
