"""Which parameters got a gradient in this step, and the agreement on it across ranks.

With ``find_unused_parameters`` every rank must skip exactly the parameters that *no* rank used, as
``torch.optim.AdamW`` skips a ``None`` gradient: each rank's ``(num_params,)`` int32 mask is
max-all-reduced over all ranks once per step (per round for backward passes outside ``no_sync``).
When the non-finite guard is on, its ``(2 * world_size,)`` flags ride on the same all-reduce, so the
step costs one small collective and one host synchronisation, whichever of the two asks.

The mask travels to the device out of a pinned host buffer with a non-blocking copy (Python data
copied to the device would synchronise); the previous copy out of it has finished by then, since its
result was read back. At world size 1 the local mask is the agreement: no tensor, no synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lightning_zero.comm.communicator import Comm
from lightning_zero.engine.nonfinite import NonFiniteGuard


class UsedParams:
    """The used-parameter mask of one reducer (see the module docstring).

    Args:
        count: parameters of the plan.
        world: every rank (the agreement is over all of them, replica groups included).
        skip_unused: ``find_unused_parameters``.
        guard: the non-finite guard whose flags ride on the mask, if on.
    """

    def __init__(self, count: int, world: Comm, skip_unused: bool, guard: NonFiniteGuard | None) -> None:
        self.world, self.skip_unused, self.guard = world, skip_unused, guard
        self.local = [False] * count
        """Got a gradient on this rank in this step."""
        self.agreed: list[bool] | None = None
        """Used by some rank (after an agreement with ``skip_unused``)."""
        self._host: Tensor | None = None  # pinned on CUDA

    def reset(self) -> None:
        self.local = [False] * len(self.local)
        self.agreed = None

    def agree(self, collect: Callable[[], None], with_guard: bool) -> None:
        """Agree across ranks, around ``collect`` (the round's collects, which issue no collective):
        the mask alone is launched before it, to overlap; with the guard's flags, after it (they hold
        what the collects inspected). ``with_guard``: agree on the flags even without
        ``skip_unused`` (the step's close; a round leaves them to the optimizer step). All ranks."""
        pending = None
        if self.skip_unused and self.world.world_size == 1:
            self.agreed = list(self.local)  # local is global
        elif self.skip_unused and self.guard is None:
            pending = self._launch()
        collect()
        flags_too = with_guard and self.guard is not None and not self.skip_unused
        if pending is None and ((self.skip_unused and self.world.world_size > 1) or flags_too):
            pending = self._launch()
        if pending is not None:
            self._read(*pending)

    def _launch(self) -> tuple[Tensor, object]:
        """Start the max all-reduce of the mask (``(count,)`` int32), the guard's flags after it."""
        host = self._host
        if host is None:
            host = self._host = torch.empty(
                len(self.local), dtype=torch.int32, pin_memory=self.world.device.type == "cuda"
            )
        host.copy_(torch.tensor(self.local, dtype=torch.int32))
        used = torch.empty(len(self.local), dtype=torch.int32, device=self.world.device)
        used.copy_(host, non_blocking=True)
        if self.guard is not None:
            used = torch.cat([used, self.guard.local_flags()])  # (count + 2 * world_size,)
        return used, self.world.all_reduce(used, op="max", control=True)

    def _read(self, used: Tensor, handle: object) -> None:
        self.world.wait(handle)
        if self.guard is not None:
            self.guard.agree_also(used)  # tensor parallelism: the flags (and the mask) over its group too
            self.guard.agree_across_stages(used[len(self.local) :])  # the flags only: other parameters
        values = used.tolist()  # the step's one host synchronisation
        if self.skip_unused:
            self.agreed = [bool(u) for u in values[: len(self.local)]]
        if self.guard is not None:
            self.guard.agreed(values[len(self.local) :])
