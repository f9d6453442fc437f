"""The random-number generators' state: captured where a model's construction begins, and set again
where a deferred initialization replays it (:mod:`lightning_zero.engine.deferred_init`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RngState:
    """The random-number generators' state where a model's construction began."""

    cpu: Tensor
    device: Tensor | None
    """The accelerator's generator (``None`` on a CPU run)."""


def capture_rng(device: torch.device) -> RngState:
    """The CPU generator's state and, for an accelerator ``device``, that device's generator's."""
    accelerator = None if device.type in ("cpu", "meta") else torch.get_device_module(device.type)
    return RngState(
        cpu=torch.random.get_rng_state(),
        device=None if accelerator is None else accelerator.get_rng_state(device),
    )


@contextmanager
def rng_set_to(state: RngState, device: torch.device) -> Iterator[None]:
    """Inside: the generators hold ``state``; at the exit, what they held before."""
    accelerator = state.device is not None and device.type not in ("cpu", "meta")
    devices = [device] if accelerator else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if accelerator else "cuda"):
        set_rng(state, device)
        yield


def set_rng(state: RngState, device: torch.device) -> None:
    """The CPU generator (and ``device``'s, an accelerator's) set to ``state``."""
    torch.random.set_rng_state(state.cpu)
    if state.device is not None and device.type not in ("cpu", "meta"):
        torch.get_device_module(device.type).set_rng_state(state.device, device)
