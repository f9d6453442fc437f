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
    in forward. When every parameter of the unit has delivered its gradient (into the reducer's
    bucket buffers), the unit is freed, and no hook nor prefetch gathers it again in that backward
    (on a rank where one of its parameters got no gradient it is still gathered, so no rank issues a
    gather the others do not); at the end of backward every unit but the root still gathered is.
    The root stays gathered until the optimizer step frees it (the next micro-batch of an
    accumulation window needs it at once). Before its gather, the hook hands the reducer the
    units whose backward is done, whose buckets then launch (:meth:`UnitGather._reduce_done`): the
    only places a stage-3 gradient collective starts besides the end of the backward, so the
    collective order depends on which units ran, never on which of their parameters got a gradient
    (a router's experts, a gate, a head used on some batches).
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

A backward that raises (a loop catching an out-of-memory error to skip the batch) never runs its
end: the next backward finds that out (:mod:`lightning_zero.engine.backward_end`) and starts from a
clean per-backward state; the next optimizer step frees every unit and forgets the forwards before it.

Limits: every rank must run the same units in the same order (the gathers are collectives);
a ``torch.autograd.grad`` through the model (a gradient penalty) runs the units' backward hooks as a
backward does, so it sends a round of zero gradients too (correct sums, one reduce-scatter more;
an optimizer step after such a pass alone, with no backward, then steps on zero gradients where
torch's would skip every parameter);
parameters are readable outside their unit's forward and backward only through
:meth:`UnitGather.gather_all` or the model's ``state_dict()``, writable only with a write-back after
:meth:`UnitGather.gather_all` or through ``load_state_dict()`` (elsewhere they read NaN, and every
write raises, naming the parameter: :mod:`lightning_zero.layout.placeholders`); a parameter used
outside its unit's forward gets a gradient from those NaN values, which raises here.
:meth:`UnitGather.unshard` removes every hook it installed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from lightning_zero.comm.communicator import Comm
from lightning_zero.comm.host_clock import timed
from lightning_zero.engine.backward_end import EndOfBackward
from lightning_zero.engine.gathered_units import GatheredUnits
from lightning_zero.engine.grad_outputs import grad_outputs
from lightning_zero.engine.reducer import GradReducer
from lightning_zero.engine.unit_requests import UnitRequests
from lightning_zero.engine.units_done import UnitsDone
from lightning_zero.layout.buckets import BucketPlan
from lightning_zero.layout.flat import FlatParams
from lightning_zero.layout.units import UnitLayout


class UnitGather(GatheredUnits):
    """The hooks and gathers of stage 3 for one model and one plan (the gathers, frees and prefetches:
    :class:`~lightning_zero.engine.gathered_units.GatheredUnits`)."""

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
        super().__init__(plan, flat, comm, layout, reshard_after_forward, prefetch_units, quantized)
        self._done = UnitsDone(len(self.units))  # which units' backward is done, at a backward hook
        self._reducer: weakref.ref[GradReducer] | None = None
        self._end = EndOfBackward(self._end_of_backward, abandoned=self._forget_backward)
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

    # ---- hooks ------------------------------------------------------------------------------

    def gather_root(self) -> None:
        """Gather the root unit before a step function that uses it without calling its forward
        (Lightning calls ``training_step``, not ``forward``); starts this step's forward order."""
        self._running = []
        self._release_kept(0)
        training = torch.is_grad_enabled()
        self.gather(0, quantized=training)
        self._record_mode(0, training)
        self._prefetch(0, self._order, training)

    def _pre_forward(self, unit: int):  # noqa: ANN202 - a closure over the unit index
        @torch.compiler.disable
        @timed
        def hook(module: torch.nn.Module, args: object) -> None:
            if module is not self.layout.modules[unit]:
                return  # a copy of the unit (copy.deepcopy copies hooks): its parameters are its own
            first = unit != 0 and unit not in self._running
            if unit == 0:
                self._running = []
            elif first and not _in_backward():
                self._running.append(unit)
            state = self.units[unit]
            if _in_backward():  # recomputation for activation checkpointing: the forward's values
                self.gather(unit, quantized=state.trained and state.forward_quantized, strict=True)
                return
            self._done.forward_starts(unit)
            if unit == self._kept:  # running again: held until this call's post-forward decides anew,
                self._kept = None  # never freed by a unit it calls
            self._release_kept(unit)
            training = torch.is_grad_enabled()  # evaluation computes on exact parameters
            self.gather(unit, quantized=training)
            self._record_mode(unit, training)
            self._prefetch(unit, self._order, training, skip_ran=first)

        return hook

    @torch.compiler.disable
    @timed
    def _root_holder_pre_forward(self, module: torch.nn.Module, args: object) -> None:
        """A module holding root parameters runs: the root is gathered (it stays so until a step, or
        :meth:`free_all`, frees it). In a training forward it is gathered already: kept as it is."""
        self.gather(0, quantized=torch.is_grad_enabled() or _in_backward())

    def _post_forward(self, unit: int):  # noqa: ANN202 - a closure over the unit index
        @torch.compiler.disable
        @timed
        def hook(module: torch.nn.Module, args: object, output: object) -> None:
            if _in_backward() or module is not self.layout.modules[unit]:
                return  # a recomputation for activation checkpointing (its backward follows), a copy
            if unit == 0:
                self._order = list(self._running)
            try:
                outputs = grad_outputs(output, self.units[unit].name) if torch.is_grad_enabled() else []
            except TypeError:
                self._done.forward_ends(unit, hooked=False)
                self.free(unit)
                raise
            ended = self._done.forward_ends(unit, hooked=bool(outputs))
            if not outputs:
                self.free(unit)  # no backward will come through this forward
                return
            mode = self.units[unit].quantized  # what this forward ran on: its backward gathers that
            hook = self._pre_backward(unit, mode, ended)
            torch.autograd.graph.register_multi_grad_hook(outputs, hook, mode="any")
            if not self.held_through_backward(unit):
                self.free(unit)
            elif self.reshard_after_forward and not self.hold_for_step and unit != 0:
                self._kept = unit  # the last unit: its backward comes first; freed once its gradients arrived

        return hook

    def _pre_backward(self, unit: int, quantized: bool, ended: int):  # noqa: ANN202 - a closure
        @timed
        def hook(grad: torch.Tensor) -> None:
            self._end.queue()
            self._reduce_done(ended)
            if not self._finished(unit):
                self.gather(unit, quantized=quantized, strict=True)  # the values its forward computed on
            self._prefetch(unit, self._running[::-1], None)

        return hook

    def _arrival(self, index: int):  # noqa: ANN202 - a closure over the parameter index
        owner = weakref.ref(self)  # weakly: the parameter's hooks are invisible to the garbage collector

        @timed
        def hook(param: torch.nn.Parameter) -> None:
            units = owner()
            if units is not None:
                units._on_gradient(index)

        return hook

    def _on_gradient(self, index: int) -> None:
        """A parameter's gradient reached the reducer (its hook, registered after the reducer's)."""
        self._end.queue()
        unit = self.layout.of_param[index]
        state = self.units[unit]
        if not self.gathered(unit):
            raise RuntimeError(
                f"stage 3: parameter {self.plan.params[index].name!r} got a gradient while its unit "
                f"{state.name!r} was not gathered: it was used outside that module's forward. "
                "Choose units (unit_modules) whose forward uses every parameter they hold"
            )
        state.arrived.add(index)
        if self._finished(unit) and not self.hold_for_step:
            self.free(unit)

    def _reduce_done(self, ended: int) -> None:
        """The backward hook of a forward that ended at tick ``ended`` fires: the reducer launches the
        buckets of the units whose backward is done (:mod:`lightning_zero.engine.units_done`)."""
        done = self._done.done_at(ended)
        reducer = None if self._reducer is None else self._reducer()
        if reducer is not None:
            reducer.launch_units(done)

    def reduce_with(self, reducer: GradReducer) -> None:
        """At each unit's backward, before its gather, ``reducer`` launches the buckets of the units
        whose backward is done (:meth:`GradReducer.launch_units`; held weakly, as the gradient hooks
        hold it)."""
        self._reducer = weakref.ref(reducer)

    def _end_of_backward(self) -> None:
        if self._running:
            self._order = list(self._running)
        self._forget_backward()
        self._done.backward_ends()
        if self.hold_for_step:  # the next micro-batch's forward and backward use them: the step frees them
            return
        for unit in range(1, len(self.units)):  # the root stays for the next micro-batch: the step frees it
            self.free(unit)

    def _forget_backward(self) -> None:
        """The per-backward state back to its start: at the end of a backward, and at the next one
        after a backward that raised (its end never ran: the units whose gradients arrived there
        would be freed after their first gradient in the next)."""
        for state in self.units:
            state.arrived.clear()
        self._done.backward_abandoned()

    def forget_step(self) -> None:
        """An optimizer step ends what the forwards before it left: every unit is freed and no backward
        is expected of them (a forward whose backward never came, or raised)."""
        self.free_all()
        self._end.forget()
        self._forget_backward()
        self._done.forget()
        for state in self.units:
            state.trained = False

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
