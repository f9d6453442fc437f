"""What a tensor holds until a deferred initialization writes it (:mod:`lightning_zero.engine.deferred_init`):
NaN for a floating tensor, its dtype's minimum for an integer one (an unsigned one's maximum), so that a
tensor no initializer wrote is found after the initialization."""

from __future__ import annotations

import torch
from torch import Tensor


def nan_like(tensor: Tensor, device: torch.device) -> Tensor:
    """What an unwritten tensor holds until an initializer writes it: NaN, an integer's minimum."""
    return mark_unwritten(torch.empty(tensor.shape, dtype=tensor.dtype, device=device))


def mark_unwritten(out: Tensor) -> Tensor:
    """Fill ``out`` with what an unwritten tensor holds (see :func:`nan_like`); returns it."""
    if out.is_floating_point() or out.is_complex():
        out.fill_(float("nan"))
    elif out.dtype != torch.bool:
        out.fill_(unset_integer(out.dtype))
    else:  # no value tells "unwritten" here: a boolean buffer no initializer writes stays False
        out.zero_()
    return out


def unwritten(tensor: Tensor) -> Tensor:
    if tensor.is_floating_point() or tensor.is_complex():
        return torch.isnan(tensor).any()
    return (tensor == unset_integer(tensor.dtype)).any()


def unset_integer(dtype: torch.dtype) -> int:
    """What an unwritten integer tensor holds: the dtype's minimum (its maximum for an unsigned one,
    whose minimum 0 is an ordinary value)."""
    info = torch.iinfo(dtype)
    return info.max if info.min == 0 else info.min
