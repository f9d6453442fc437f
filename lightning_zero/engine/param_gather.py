"""The all-gather of updated parameters, bucket by bucket, optionally left in flight into the next forward.

After the optimizer updates its shard of a bucket, one all-gather per bucket brings every rank's
updated slice back into the flat buffer (in place: the parameters are views of it). Without
overlap, ``step()`` waits for all of them. With ``overlap_param_gather`` (the scheme Megatron-Core
calls by that name), the gathers are launched in forward order (the last bucket holds the first
layers) and left in flight; a forward pre-hook on every module that owns parameters waits only for
the buckets holding *its* parameters, just before they are used, so the tail of the gathers
overlaps the first layers' forward.

Every other reader must wait first (:meth:`ParamGather.wait`): the next ``step()``, checkpoint
saves and loads, ``state_dict``, re-planning, evaluation, and code that reads parameters outside
their module's forward. ``ZeroStrategy`` does this for Lightning's phases and callbacks. Overlap
only takes effect once forward waits are installed (:meth:`ParamGather.install_forward_waits`):
without them ``step()`` waits as before, so parameters are never read stale by a module forward.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence

import torch

from lightning_zero.comm.communicator import Comm
from lightning_zero.comm.host_clock import timed
from lightning_zero.layout.buckets import BucketPlan
from lightning_zero.layout.flat import FlatParams


class ParamGather:
    """Per-bucket parameter all-gathers of one plan and their pending handles."""

    def __init__(self, plan: BucketPlan, flat: FlatParams, comm: Comm, overlap: bool) -> None:
        self.plan, self.flat, self.comm = plan, flat, comm
        self.overlap = overlap
        self._pending: list[object | None] = [None] * len(plan.buckets)
        self._any_pending = False
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self.module: torch.nn.Module | None = None
        """The module whose forwards wait (overlap is in effect only when set)."""
        self.root_buckets: tuple[int, ...] = ()
        """Buckets holding parameters ``module`` owns itself: Lightning calls ``training_step``, not
        the root's forward, so its pre-hook does not fire before them (:meth:`wait_root`)."""

    @property
    def pending(self) -> bool:
        """Whether some bucket's gather is still in flight."""
        return self._any_pending

    @property
    def in_effect(self) -> bool:
        """Overlap asked for and forward waits installed."""
        return self.overlap and self.module is not None

    def order(self) -> list[int]:
        """The order to update and gather buckets in: forward order (the last bucket holds the first
        layers) when the gathers overlap the next forward, else bucket order."""
        buckets = list(range(len(self.plan.buckets)))
        return buckets[::-1] if self.in_effect else buckets

    def launch(self, b: int) -> None:
        """Start bucket ``b``'s gather (its owned shard is updated). Call on all ranks, in :meth:`order`."""
        bucket = self.plan.buckets[b]
        with self.comm.labelled(f"bucket {b}"):
            self._pending[b] = self.comm.all_gather(
                self.flat.bucket(bucket), self.flat.shard(bucket), what="parameter all-gather", params=True
            )
        self._any_pending = True

    def launched(self) -> None:
        """Every bucket is launched: wait for all of them, unless overlap is in effect."""
        if not self.in_effect:
            self.wait()

    def wait(self, buckets: Iterable[int] | None = None) -> None:
        """Complete the pending gathers of ``buckets`` (default: all). Needed before any read or write
        of the parameters outside their module's forward."""
        if not self._any_pending:
            return
        for b in range(len(self._pending)) if buckets is None else buckets:
            handle = self._pending[b]
            if handle is not None:
                self.comm.wait(handle)
                self._pending[b] = None
        self._any_pending = any(h is not None for h in self._pending)

    def install_forward_waits(
        self, module: torch.nn.Module, params_in_order: Sequence[torch.nn.Parameter]
    ) -> None:
        """A forward pre-hook on every submodule of ``module`` that owns planned parameters directly:
        it waits for the buckets holding them. Makes overlap take effect — except for a model that
        contains ``torch.compile``'d parts: their cached graphs may skip hooks registered after they
        were traced (torch does not guard on them), so the gathers are then waited for in ``step()``
        and a warning says so."""
        self.remove_hooks()
        compiled = _compiled_parts(module)
        if compiled:
            warnings.warn(
                f"overlap_param_gather is off for this model: it has torch.compile'd parts ({compiled[:3]}), "
                "whose graphs may skip the forward hooks that wait for the parameters; the parameter "
                "all-gather completes at the end of each optimizer step instead",
                stacklevel=2,
            )
            return
        index = {p: i for i, p in enumerate(params_in_order)}
        where = self.plan.locate()
        for sub in module.modules():
            own = [p for p in sub._parameters.values() if p is not None and p in index]
            buckets = tuple(sorted({where[index[p]][0] for p in own}))
            if buckets:
                self._hooks.append(sub.register_forward_pre_hook(self._waiter(buckets)))
            if sub is module:
                self.root_buckets = buckets
        self.module = module

    def wait_root(self) -> None:
        """Complete the gathers of the buckets holding the root module's own parameters (before a
        step function of the root that may read them without calling its forward)."""
        if self._any_pending and self.root_buckets:
            self.wait(self.root_buckets)

    def _waiter(self, buckets: tuple[int, ...]):  # noqa: ANN202 - a closure over the bucket indices
        # never traced: a compiled block would bake "nothing pending" into its graph and skip the wait
        @torch.compiler.disable
        @timed
        def hook(module: torch.nn.Module, args: object) -> None:
            if self._any_pending:
                self.wait(buckets)

        return hook

    def remove_hooks(self) -> None:
        """Remove the forward waits (after :meth:`wait`, so that nothing stays in flight unguarded)."""
        self.wait()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.module = None
        self.root_buckets = ()


def _compiled_parts(module: torch.nn.Module) -> list[str]:
    """Names of ``torch.compile``'d submodules, or the module itself when Lightning compiled its steps."""
    optimized = getattr(getattr(torch, "_dynamo", None), "OptimizedModule", None)
    names = [
        n or "<root>" for n, m in module.named_modules() if optimized is not None and isinstance(m, optimized)
    ]
    if getattr(module, "_compiler_ctx", None):  # trainer.fit(torch.compile(model))
        names.insert(0, "<root>")
    return names
