"""``SavedActivations``: the bytes autograd keeps for the backward of one micro-batch, on any device.

The step profiler (``ZeroStrategy(profile_steps=...)``) reports them as ``activation_bytes``, beside
the engine's memory by kind: the activations a step holds when its forward ends (no recomputation of
an activation-checkpointed region is seen: it happens in the backward). A device's allocator would
give them only on CUDA, and mixed with everything else allocated in the forward; here they are what
autograd saves: ``torch.autograd.graph.saved_tensors_hooks`` are entered at the micro-batch's start and
left before its backward (a hook pair stays with the tensors it packed, so leaving early changes
nothing), and each saved tensor's storage is counted once (views of one activation share it). A
parameter (or a view of one: a transposed weight) is not an activation and is not counted: its bytes
are the engine's ``param_bytes`` or, at stage 3, its gathered units. A copy of a weight made for the
forward (autocast's 16-bit weights) is counted: the step holds it for the backward too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class SavedActivations:
    """Counts one forward's saved bytes: :meth:`start` at the micro-batch's start, :meth:`stop` before
    its backward (or at its end); :attr:`bytes` once done (None before)."""

    def __init__(self) -> None:
        self._hooks: Any = None
        self._storages: dict[int, int] = {}  # storage address -> its bytes
        self.bytes: int | None = None

    @property
    def counting(self) -> bool:
        return self._hooks is not None

    def start(self) -> None:
        self._storages = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()

    def stop(self) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
            self.bytes = sum(self._storages.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        base = tensor if tensor._base is None else tensor._base
        if isinstance(base, nn.Parameter) or tensor.is_meta:
            return tensor
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's part
        try:
            storage = local.untyped_storage()
            self._storages.setdefault(storage.data_ptr(), storage.nbytes())
        except (RuntimeError, NotImplementedError):  # no storage of its own (a sparse or wrapper tensor)
            self._storages[id(local)] = local.numel() * local.element_size()
        return tensor
