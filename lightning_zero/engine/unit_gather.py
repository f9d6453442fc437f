"""Stage 3: each unit's parameters are all-gathered just before they are used and freed after.

Between steps a rank holds only its shard of every bucket (:mod:`lightning_zero.layout.flat`,
``sharded=True``); a unit (:mod:`lightning_zero.layout.units`: a block, or the root's remaining
parameters) is *gathered* — its buckets' full buffers given storage and all-gathered from every
rank's shard — at these moments:

  * **forward**: a pre-hook on the unit's module gathers it (waiting only for its own buckets) and
    launches the gather of the next ``prefetch_units`` units in the order the last forward ran them
    (registration order on the first step), so the next unit's gather overlaps this one's forward.
    After the forward, with ``reshard_after_forward`` (the default) the unit is freed at once, but for
    two: the root, and the unit that ran last in the last forward (an output layer, a final block):
    the loss and the first backward need them at once, so they stay gathered (FSDP keeps its root
    so; torchtitan does not reshard its last block by hand). Should another unit's forward start
    after it (the guess was wrong: the order changed), or a new forward begin before its backward,
    that unit is freed at once. A forward without gradients (evaluation) frees each unit it runs
    after it, root included. A unit's prefetch on its first run in a forward skips the units that
    already ran in it.
  * **backward**: a hook on the unit's outputs (``register_multi_grad_hook``, fires before the
    unit's backward) gathers it again if it was freed, and prefetches the unit that ran before it
    in forward. When every parameter of the unit has delivered its gradient (the reducer, whose
    hooks run first, has taken it into its bucket's reduce-scatter), the unit is freed; at the end
    of backward every unit but the root still gathered is. The root stays gathered until the
    optimizer step frees it (the next micro-batch of an accumulation window needs it at once).
  * **activation checkpointing**: a recomputed forward runs inside backward; its pre-hook gathers
    the unit, its post-hook leaves it gathered for the backward that follows.
  * **a submodule holding root parameters** runs on its own (a model's inner network called for
    generation, outside the LightningModule's forward): its pre-hook gathers the root.
  * **``state_dict()``/``load_state_dict()``** of the model: one unit at a time
    (:mod:`lightning_zero.engine.unit_requests`).

So at most ``1 + prefetch_units`` units (plus the root) hold full parameters at once with
``reshard_after_forward`` (the last unit held through the loss is one of them: nothing comes after
it to prefetch); without it every unit stays gathered from its forward to its backward (ZeRO-2's
parameter memory, one gather per step fewer). Elements sent per step: one all-gather of every unit
in forward, another of every unit but the root and the last in backward (with
``reshard_after_forward``), one reduce-scatter of the gradients: ``(3Ψ - Ψ_root - Ψ_last)(N-1)/N``.
The last unit is the one that ran last in the previous forward (registration order before the
first); where a forward ends elsewhere, the unit that did run last is gathered again for its backward,
so the figure assumes the forward order of the step before. Between its forward and its backward the
last unit's parameters hold their values, as the root's do (elsewhere they are placeholders); a
write there is lost when the unit is freed, as at any gathered unit without a write-back.

The backward hook is registered on the tensors requiring grad in the unit's output: the leaves of its
pytree (tensors, tuples, lists, dicts, named tuples, registered types), and inside them the fields of
dataclasses and the items of other mappings, lists and tuples. Any other object in the output of a
forward with gradients is refused there with a ``TypeError`` naming the unit and the type: its
tensors could not be hooked, and the unit's backward would run on freed parameters.

**int8 gathers** (``gather_dtype="int8"``): the gathers of a forward with gradients, of the backward
that follows and of their prefetches send each rank's shard as one byte row of int8 blocks and fp32
scales (:func:`~lightning_zero.engine.quantize.pack`); every rank, the owner too, dequantizes the same
rows into the full buffer, so all compute on identical weights, and the backward of a unit gathers
in the mode its forward did (the gradients are those of the weights the forward used). The shard is
never written from the full buffer here, so the error stays out of the optimizer's master. Every
other gather is exact, and a unit held from int8 rows is gathered again, exactly, when one asks for
it: evaluation (no gradients), ``state_dict()``/``load_state_dict()``, :meth:`UnitGather.gather_all`
and the writes back after it. A unit's backward gathers in the mode its forward recorded when it ran
(a unit held in the other mode by then, e.g. after a ``state_dict()`` between forward and backward,
is gathered again); a unit prefetched in backward is gathered as its own forward ran. Under reentrant
activation checkpointing (``use_reentrant=True``) the checkpointed forward runs without gradients,
so those units gather exactly, in the forward and in its recomputation.

Limits: every rank must run the same units in the same order (the gathers are collectives);
parameters are readable outside their unit's forward and backward only through
:meth:`UnitGather.gather_all` or the model's ``state_dict()``, writable only with a write-back after
:meth:`UnitGather.gather_all` or through ``load_state_dict()`` (elsewhere they read NaN, and every
write raises, naming the parameter: :mod:`lightning_zero.layout.placeholders`); a parameter used
outside its unit's forward gets a gradient from those NaN values, which raises here.
:meth:`UnitGather.unshard` removes every hook it installed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lightning_zero.comm.communicator import Comm
from lightning_zero.engine.grad_outputs import grad_outputs
from lightning_zero.engine.quantize import pack, unpack_rows
from lightning_zero.engine.unit_requests import UnitRequests
from lightning_zero.layout.buckets import Bucket, BucketPlan
from lightning_zero.layout.flat import FlatParams
from lightning_zero.layout.units import UnitLayout


@dataclass
class _Unit:
    """One unit's buckets and per-step state (lives and dies together)."""

    index: int
    name: str
    buckets: list[Bucket]
    params: list[int]
    pending: list[tuple[object, Bucket, torch.Tensor | None]] = field(default_factory=list)
    """Gathers launched and not yet waited for: the handle, the bucket, and (int8 gathers) the byte
    rows it fills, dequantized into the bucket once it completes."""
    quantized: bool = False
    """What the gathered buffers hold (or will once ``pending`` completes) are dequantized int8 values."""
    forward_quantized: bool = False
    """The unit's last training forward ran on dequantized values: its backward gathers them again."""
    arrived: set[int] = field(default_factory=set)
    """Parameters whose gradient arrived in this backward."""


class UnitGather:
    """The hooks and gathers of stage 3 for one model and one plan."""

    def __init__(
        self,
        plan: BucketPlan,
        flat: FlatParams,
        comm: Comm,
        layout: UnitLayout,
        reshard_after_forward: bool,
        prefetch_units: int,
        after_write: Callable[[], None],
        quantized: bool = False,
    ) -> None:
        self.plan, self.flat, self.comm, self.layout = plan, flat, comm, layout
        self.quantized = quantized
        """``gather_dtype="int8"``: the gathers of training forwards and backwards send int8 rows."""
        self.reshard_after_forward = reshard_after_forward
        self.prefetch_units = prefetch_units
        by_unit: dict[int, list[Bucket]] = {}
        for bucket in plan.buckets:
            by_unit.setdefault(bucket.unit, []).append(bucket)
        self.units = [
            _Unit(u, layout.names[u] or "<root>", by_unit.get(u, []), layout.params_of(u))
            for u in range(len(layout.modules))
        ]
        self._order: list[int] = [u for u in range(1, len(self.units))]  # forward order, last step's
        self._running: list[int] = []  # forward order of this step so far
        self._kept: int | None = None  # the last unit, held from its forward to its backward
        self._callback_queued = False
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        for unit, module in zip(self.units, layout.modules, strict=True):
            self._hooks.append(module.register_forward_pre_hook(self._pre_forward(unit.index)))
            self._hooks.append(module.register_forward_hook(self._post_forward(unit.index)))
        root = layout.modules[0]
        root_params = {id(flat.params[i]) for i in layout.params_of(0)}
        for module in root.modules():  # a submodule called on its own (e.g. generation) finds the root
            if module is not root and any(id(p) in root_params for p in module._parameters.values()):
                self._hooks.append(module.register_forward_pre_hook(self._root_holder_pre_forward))
        for index in range(len(plan.params)):
            param = flat.params[index]
            self._hooks.append(param.register_post_accumulate_grad_hook(self._arrival(index)))
        self.requests = UnitRequests(self, root, after_write)
        """``state_dict()``/``load_state_dict()`` of the model on full values, one unit at a time."""
        self.free_all()

    # ---- gathering --------------------------------------------------------------------------

    def gathered(self, unit: int) -> bool:
        """Whether ``unit``'s full parameters have storage (filled, or being filled)."""
        return all(self.flat.is_gathered(b) for b in self.units[unit].buckets)

    def gather(self, unit: int, wait: bool = True, quantized: bool = False, strict: bool = False) -> None:
        """Launch ``unit``'s all-gathers unless it is gathered; with ``wait``, complete them.
        ``quantized`` (a training forward or backward under ``gather_dtype="int8"``): int8 rows are
        enough. A unit gathered from int8 rows is gathered again, exactly, for any other request;
        ``strict`` (a backward, or a recomputation, that must see what its forward saw): a unit held
        exactly is gathered again from int8 rows too when ``quantized`` asks for them."""
        state = self.units[unit]
        quantized = quantized and self.quantized
        if self.gathered(unit) and state.quantized != quantized and (strict or state.quantized):
            self._complete(state)
            state.pending = [self._launch(bucket, quantized) for bucket in state.buckets]
            state.quantized = quantized
        elif not self.gathered(unit):
            for bucket in state.buckets:
                self.flat.materialize(bucket)
            state.pending = [self._launch(bucket, quantized) for bucket in state.buckets]
            state.quantized = quantized
        if wait:
            self._complete(state)

    def _launch(self, bucket: Bucket, quantized: bool) -> tuple[object, Bucket, torch.Tensor | None]:
        if not quantized:
            handle = self.comm.all_gather(
                self.flat.bucket(bucket), self.flat.shard(bucket), what="parameter all-gather"
            )
            return handle, bucket, None
        row = pack(self.flat.shard(bucket), 1)
        rows = row.new_empty(self.comm.world_size, row.shape[1])
        handle = self.comm.all_gather(rows.view(-1), row.view(-1), what="parameter all-gather (int8)")
        return handle, bucket, rows

    @torch.no_grad()
    def _complete(self, state: _Unit) -> None:
        """Wait for ``state``'s gathers in flight; int8 rows are dequantized into their buckets (every
        rank, the owner too, from the same bytes)."""
        for handle, bucket, rows in state.pending:
            self.comm.wait(handle)
            if rows is not None:
                full = self.flat.bucket(bucket)
                unpack_rows(rows, full.numel(), out=full)
        state.pending.clear()

    def free(self, unit: int) -> None:
        """Release ``unit``'s full parameters (after its gathers in flight complete)."""
        state = self.units[unit]
        self._complete(state)
        for bucket in state.buckets:
            self.flat.free(bucket)
        state.quantized = False
        if unit == self._kept:
            self._kept = None

    def refill(self, unit: int, quantized: bool) -> None:
        """Gather ``unit`` again from the shards, from int8 rows where ``quantized`` (as it was held
        before a block that read or wrote its full values); a unit held for its backward stays so."""
        kept = self._kept
        self.free(unit)
        self.gather(unit, quantized=quantized)
        self._kept = kept

    def _release_kept(self, running: int) -> None:
        """``running``'s forward starts (outside backward): a unit held for its backward since an earlier
        forward is freed, as the others were after theirs (it ran before ``running``, or that forward
        gets no backward); a later backward gathers it again."""
        if self._kept is not None and self._kept != running:
            self.free(self._kept)

    def free_all(self) -> None:
        """Release every unit (the state between optimizer steps)."""
        for unit in range(len(self.units)):
            self.free(unit)

    def gather_all(self) -> None:
        """Every unit gathered (to read or save full parameters); :meth:`free_all` releases them."""
        self.gather_units(range(len(self.units)))

    def gather_units(self, units: Sequence[int]) -> None:
        """``units`` gathered (their all-gathers launched together, then waited for)."""
        for unit in units:
            self.gather(unit, wait=False)
        for unit in units:
            self.gather(unit)

    def gather_root(self) -> None:
        """Gather the root unit before a step function that uses it without calling its forward
        (Lightning calls ``training_step``, not ``forward``); starts this step's forward order."""
        self._running = []
        self._release_kept(0)
        training = torch.is_grad_enabled()
        self.gather(0, quantized=training)
        self.units[0].forward_quantized = self.units[0].quantized
        self._prefetch(0, self._order, training)

    def _prefetch(
        self, after: int, order: Sequence[int], quantized: bool | None, skip_ran: bool = False
    ) -> None:
        """Launch the gathers of the ``prefetch_units`` units that follow ``after`` in ``order`` (the
        first ones after the root); ``quantized=None`` (backward): each in the mode its forward ran.
        ``skip_ran`` (``after`` runs for the first time in this forward): not the units that already
        ran in it (``order`` was a wrong guess there); a repeated pass prefetches as the first did."""
        if after != 0 and after not in order:
            return
        start = 0 if after == 0 else order.index(after) + 1
        for unit in order[start : start + self.prefetch_units]:
            if skip_ran and unit in self._running:
                continue
            if quantized is None:
                self.gather(unit, wait=False, quantized=self.units[unit].forward_quantized, strict=True)
            else:
                self.gather(unit, wait=False, quantized=quantized)

    def last_in_forward(self) -> int | None:
        """The unit that ran last in the last forward (registration order before the first), kept
        gathered after its forward with ``reshard_after_forward``: its backward comes first."""
        return self._order[-1] if self._order else None

    def held_through_backward(self, unit: int) -> bool:
        """Whether ``unit`` stays gathered from its forward to its backward (gathered once per
        micro-batch): the root, the last unit, and every unit without ``reshard_after_forward``."""
        return not self.reshard_after_forward or unit in (0, self.last_in_forward())

    # ---- hooks ------------------------------------------------------------------------------

    def _pre_forward(self, unit: int):  # noqa: ANN202 - a closure over the unit index
        @torch.compiler.disable
        def hook(module: torch.nn.Module, args: object) -> None:
            first = unit != 0 and unit not in self._running
            if unit == 0:
                self._running = []
            elif first and not _in_backward():
                self._running.append(unit)
            state = self.units[unit]
            if _in_backward():  # recomputation for activation checkpointing: the forward's values
                self.gather(unit, quantized=state.forward_quantized, strict=True)
                return
            if unit == self._kept:  # running again: held until this call's post-forward decides anew,
                self._kept = None  # never freed by a unit it calls
            self._release_kept(unit)
            training = torch.is_grad_enabled()  # evaluation computes on exact parameters
            self.gather(unit, quantized=training)
            state.forward_quantized = state.quantized
            self._prefetch(unit, self._order, training, skip_ran=first)

        return hook

    @torch.compiler.disable
    def _root_holder_pre_forward(self, module: torch.nn.Module, args: object) -> None:
        """A module holding root parameters runs: the root is gathered (it stays so until a step, or
        :meth:`free_all`, frees it). In a training forward it is gathered already: kept as it is."""
        self.gather(0, quantized=torch.is_grad_enabled() or _in_backward())

    def _post_forward(self, unit: int):  # noqa: ANN202 - a closure over the unit index
        @torch.compiler.disable
        def hook(module: torch.nn.Module, args: object, output: object) -> None:
            if _in_backward():  # recomputation for activation checkpointing: its backward follows
                return
            if unit == 0:
                self._order = list(self._running)
            try:
                outputs = grad_outputs(output, self.units[unit].name) if torch.is_grad_enabled() else []
            except TypeError:
                self.free(unit)
                raise
            if not outputs:
                self.free(unit)  # no backward will come through this forward
                return
            mode = self.units[unit].quantized  # what this forward ran on: its backward gathers that
            torch.autograd.graph.register_multi_grad_hook(outputs, self._pre_backward(unit, mode), mode="any")
            if not self.held_through_backward(unit):
                self.free(unit)
            elif self.reshard_after_forward and unit != 0:  # the last unit: its backward comes first,
                self._kept = unit  # it is freed once its gradients arrived

        return hook

    def _pre_backward(self, unit: int, quantized: bool):  # noqa: ANN202 - a closure over the unit index
        def hook(grad: torch.Tensor) -> None:
            self._queue_end_of_backward()
            self.gather(unit, quantized=quantized, strict=True)  # the values its forward computed on
            self._prefetch(unit, self._running[::-1], None)

        return hook

    def _arrival(self, index: int):  # noqa: ANN202 - a closure over the parameter index
        owner = weakref.ref(self)  # weakly: the parameter's hooks are invisible to the garbage collector

        def hook(param: torch.nn.Parameter) -> None:
            units = owner()
            if units is not None:
                units._on_gradient(index)

        return hook

    def _on_gradient(self, index: int) -> None:
        """A parameter's gradient reached the reducer (its hook, registered after the reducer's)."""
        self._queue_end_of_backward()
        unit = self.layout.of_param[index]
        state = self.units[unit]
        if not self.gathered(unit):
            raise RuntimeError(
                f"stage 3: parameter {self.plan.params[index].name!r} got a gradient while its unit "
                f"{state.name!r} was not gathered: it was used outside that module's forward. "
                "Choose units (unit_modules) whose forward uses every parameter they hold"
            )
        state.arrived.add(index)
        if unit != 0 and len(state.arrived) == len(state.params):
            self.free(unit)

    def _queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if self._running:
            self._order = list(self._running)
        for state in self.units:
            state.arrived.clear()
        for unit in range(1, len(self.units)):  # the root stays for the next micro-batch: the step frees it
            self.free(unit)

    @torch.no_grad()
    def unshard(self) -> FlatParams:
        """The end of stage 3 (all ranks): the hooks removed, and the parameters views of new flat
        buffers laid out as at stages 1 and 2, all-gathered bucket by bucket from the shards straight
        into them (the full model once; no unit is gathered on the way)."""
        self.free_all()
        self.remove_hooks()
        flat = FlatParams(self.flat.params, self.plan, self.comm.rank)  # the placeholders' NaN, overwritten
        handles = [self.comm.all_gather(flat.bucket(b), self.flat.shard(b)) for b in self.plan.buckets]
        for handle in handles:
            self.comm.wait(handle)
        return flat

    def remove_hooks(self) -> None:
        """Remove every hook, the state-dict hooks included (the units stay as they are)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.requests.remove_hooks()


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (a recomputation)."""
    return torch._C._current_graph_task_id() != -1
