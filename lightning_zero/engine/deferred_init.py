"""Deferred initialization: a model built on the meta device gets its values here, module by module.

A model built under ``Trainer.init_module(empty_init=True)``, ``Fabric.init_module(empty_init=True)``
or, at stage 3, in ``LightningModule.configure_model()`` has its parameters and buffers on the
``meta`` device: shapes and dtypes, no memory, no values. The strategy gives them values here.

**The rule.** The initializer calls an eager build makes are replayed
(:mod:`lightning_zero.engine.init_order`), under ``torch.no_grad()``, with the random-number
generators (CPU and, on an accelerator, the device's) set to the state they had when the model's
construction began (the entry into ``init_module`` or ``configure_model``; rank 0's, so that every
rank draws the same values without a broadcast of the model). Modules are visited children first,
in registration order (post-order; a shared module once), and each module that defines
``reset_parameters()`` (or, lacking it, torch's private ``_reset_parameters()``, which
``nn.Transformer`` and ``nn.MultiheadAttention`` run at the end of their constructors) has it called:
the order in which eager construction runs them when each module calls its ``reset_parameters()`` at
the end of its own ``__init__`` and draws nothing else from the RNG there, as torch's layers
(``Linear``, ``Embedding``, ``LayerNorm``, ``RMSNorm``, convolutions, ``BatchNorm``) do. A model with a
per-module initializer (a Hugging Face ``PreTrainedModel``: ``_init_weights(module)``, run by
``post_init()`` at the end of its constructor; any module with both methods is treated so) has it
called, at its own place in that order, on each of its modules not already initialized by a model
inside it, children first, as ``post_init()`` does. The values are then bit-identical to the same
construction without ``empty_init`` (tested: the recipe's GPT, Llama with tied embeddings, Qwen2;
rotary buffers, computed in constructors, are recomputed by the initializer). A parameter held by
two modules (tied weights) is initialized by the first call of each kind that reaches it; the later
module's call still runs, on a scratch tensor (as its own weight was initialized in its constructor
and then replaced by the tied one), so the RNG advances as in eager construction.

At stage 3, where units are initialized and sharded one at a time, a model initializer's calls
come in the eager build after every reset of its modules, so a unit's calls cannot simply run in
turn: every call is first run once, in the eager order, on scratch tensors of its module's own (one
module at a time), to note where the generators stood before it; the unit-by-unit replay then sets
them there before each call. A model of only ``reset_parameters()`` needs no such pass.

**What it cannot reproduce, and what happens then.**
  * A module that owns a tensor on the meta device and has no ``reset_parameters()`` (a raw
    ``nn.Parameter(torch.randn(...))`` in a constructor) outside a model with an initializer, or
    inside one a module owning parameters that may draw in its constructor (no ``reset_parameters()``
    and no norm: GPT-2's ``Conv1D``): refused before any work, naming every such module.
  * A tensor no initializer wrote: each is filled with NaN (an integer tensor: its dtype's minimum)
    before initialization and checked after (as soon as its unit is initialized, at stage 3): an
    error names the parameter or buffer. A reset that reads a value not yet initialized propagates
    the NaN and is caught the same way. A boolean buffer (a mask made in a constructor) has no such
    value: one no initializer writes stays ``False``, unchecked.
  * Initialization that is not in ``reset_parameters()`` (``self.apply(init_fn)`` at the end of a
    model's constructor) is not replayed: the values are those of the modules' own
    ``reset_parameters()`` instead. Undetectable in general; move such code into
    ``reset_parameters()``.
  * Layers built as copies of one layer (``nn.TransformerEncoder``/``nn.TransformerDecoder`` of
    more than one layer deep-copy the layer given to them): eager construction draws one layer's
    values and copies them; the replay would draw each copy's anew. Refused before any work,
    naming the stack.
  * Lightning's demo ``Transformer`` (``nlayers=2`` by default) is refused so, for its
    ``nn.Transformer``'s stacks; with ``nlayers=1`` it replays bit for bit, ``nn.Transformer``'s
    ``_reset_parameters()`` (re-initializing every matrix of its layers) included, at stages 1
    and 2 and at stage 3 while the layers are no units of their own (the root holds them); once
    they are (``unit_modules``, or layers above ``min_unit_numel``), that reset writes into units
    already sharded and is refused, as below.
  * Stage 3 initializes one unit at a time (:mod:`lightning_zero.layout.units`): a unit's buckets
    get memory when the first module holding one of its parameters is visited, and are cut to
    this rank's shard and freed when the unit's module has been visited. A ``reset_parameters()``
    that writes into (or reads) a unit already initialized (a model-level reset re-initializing
    every block) would need the whole model at once: it is refused at that op, naming the module
    and the parameter.

Local: no communication (the strategy agrees on the RNG state first).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from lightning_zero.engine.init_order import (
    Call,
    DeferredInitError,
    check_deferred,
    eager_calls,
    post_order,
)
from lightning_zero.engine.rng_state import RngState, capture_rng, rng_set_to, set_rng
from lightning_zero.engine.tensor_parallel import slice_of
from lightning_zero.engine.unwritten import mark_unwritten, nan_like, unwritten
from lightning_zero.layout.buckets import Bucket
from lightning_zero.layout.flat import FlatParams
from lightning_zero.layout.local import is_dtensor, local
from lightning_zero.layout.placeholders import FreedParameterError
from lightning_zero.layout.units import UnitLayout

__all__ = [
    "DeferredInit",
    "DeferredInitError",
    "RngState",
    "capture_rng",
    "check_deferred",
    "is_deferred",
    "materialize",
    "stand_ins",
    "with_eager_states",
]


@dataclass(frozen=True)
class DeferredInit:
    """Where and from which generator state a meta model is initialized (the strategy's choice)."""

    device: torch.device
    rng: RngState
    init_fn: Callable[[nn.Module], None] | None = None
    """Run on every module after the rest, children first (the strategies' ``param_init_fn``)."""
    states: dict[tuple[int, str], RngState] | None = field(default=None, compare=False)
    """Where the generators stood before each call (module id, kind) of the whole model's eager
    build (:func:`with_eager_states`): a model cut down since (pipeline stages) replays its calls
    from there, drawing what the whole model's build draws."""


def is_deferred(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in _tensors(module))


def _tensors(module: nn.Module) -> Iterator[Tensor]:
    yield from module.parameters()
    yield from module.buffers()


class _Materializer:
    """One deferred initialization (see the module docstring)."""

    def __init__(
        self,
        root: nn.Module,
        device: torch.device,
        flat: FlatParams | None,
        layout: UnitLayout | None,
        init_fn: Callable[[nn.Module], None] | None = None,
    ) -> None:
        self.root, self.device, self.flat, self.layout = root, device, flat, layout
        self.init_fn = init_fn
        self.states: dict[tuple[int, str], RngState] | None = None
        self.planned: dict[int, int] = {} if flat is None else {id(p): i for i, p in enumerate(flat.params)}
        self.bucket_of: dict[int, Bucket] = (
            {} if flat is None else {s.param_index: b for b in flat.plan.buckets for s in b.slots}
        )
        self.written: dict[str, set[int]] = {}  # parameters each kind of call has written
        self.names = {id(t): n for n, t in root.named_parameters(remove_duplicate=True)}
        self.names.update({id(t): n for n, t in root.named_buffers(remove_duplicate=True)})
        self.peak_elements = 0
        """Stage 3: the most full-bucket elements held at once during the initialization."""
        self._unit_of_module = {} if layout is None else {id(m): u for u, m in enumerate(layout.modules)}

    # ---- giving tensors memory --------------------------------------------------------------

    def _own(self, module: nn.Module) -> None:
        """``module``'s own meta tensors on the device, NaN-filled; its planned parameters' buckets
        materialized (stage 3)."""
        for param in module._parameters.values():
            if param is None:
                continue
            index = self.planned.get(id(param))
            if index is not None:
                self._materialize_bucket(index)
            elif param.is_meta:
                if is_dtensor(param):  # tensor parallelism: this rank's slice gets memory
                    real = nn.Parameter(torch.empty_like(param, device=self.device), param.requires_grad)
                    mark_unwritten(local(real))
                else:
                    real = nn.Parameter(nan_like(param, self.device), requires_grad=param.requires_grad)
                torch.utils.swap_tensors(param, real)  # the same object: optimizers keep their references
        for name, buffer in module._buffers.items():
            if is_dtensor(buffer):
                raise DeferredInitError(
                    f"deferred initialization: buffer {self.names.get(id(buffer), name)!r} is a "
                    "tensor-parallel DTensor; build the model with values, or keep its buffers plain tensors"
                )
            if buffer is not None and buffer.is_meta:
                filled = nan_like(buffer, self.device)
                module._buffers[name] = filled
                self.names[id(filled)] = self.names.get(id(buffer), name)  # the error names it

    @torch.no_grad()
    def _materialize_bucket(self, index: int) -> None:
        assert self.flat is not None
        bucket = self.bucket_of[index]
        if self.flat.is_gathered(bucket):
            return
        self.flat.materialize(bucket)
        full = self.flat.bucket(bucket)
        full.zero_()  # padding
        for slot in bucket.slots:
            full[slot.bucket_offset : slot.bucket_offset + slot.numel].fill_(float("nan"))
        held = sum(self.flat.bucket(b).numel() for b in self.flat.plan.buckets if self.flat.is_gathered(b))
        self.peak_elements = max(self.peak_elements, held)

    # ---- running the initializer calls --------------------------------------------------------

    def run(self) -> None:
        calls = eager_calls(self.root, self.init_fn)
        states: list[RngState] | None = None
        if self.states is not None:  # a model cut down: each call from where the whole build drew it
            states = [self.states[(id(call.module), call.kind)] for call in calls]
        if self.flat is None:  # the whole model at once: the calls in the eager build's order
            for _, module in post_order(self.root):
                self._own(module)
            for i, call in enumerate(calls):
                if states is not None:
                    set_rng(states[i], self.device)
                self._call(call)
        else:  # one unit at a time: each module's calls when it is visited, children first
            if states is None and not _in_post_order(calls):
                states = self._dry_run(calls)
            by_module: dict[int, list[int]] = {}
            for i, call in enumerate(calls):
                by_module.setdefault(id(call.module), []).append(i)
            for _, module in post_order(self.root):
                self._own(module)
                for i in by_module.get(id(module), []):
                    if states is not None:  # where the eager build's generators stood for this call
                        set_rng(states[i], self.device)
                    self._call(calls[i])
                unit = self._unit_of_module.get(id(module))
                if unit is not None:
                    self._finish_unit(unit)
        self._check(
            [t for t in _tensors(self.root) if id(t) not in self.planned],
            "after every initializer ran",
        )

    def _call(self, call: Call) -> None:
        """Run ``call`` on its module's tensors; a parameter an earlier call of its kind wrote (tied
        weights: one module's, held by another too) gets a scratch tensor instead, as an eager build
        initializes the second module's own tensor before the tie replaces it (not for
        ``param_init_fn``, which runs after the tie)."""
        module = call.module
        scratch: dict[str, nn.Parameter] = {}
        sliced: dict[str, nn.Parameter] = {}
        written = self.written.setdefault(call.kind, set())
        for pname, param in module._parameters.items():
            # param_init_fn runs as model.apply(fn) after the model tied its weights: the last write wins
            if param is not None and id(param) in written and call.kind != "init_fn":
                scratch[pname] = param
                module._parameters[pname] = nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device=self.device),
                    requires_grad=param.requires_grad,
                )
            elif param is not None and is_dtensor(param):  # drawn whole as eagerly, then cut to the slice
                sliced[pname] = param
                module._parameters[pname] = nn.Parameter(nan_like(param, self.device), param.requires_grad)
        try:
            with torch.no_grad():
                call.run()
        except FreedParameterError as err:
            raise DeferredInitError(
                f"deferred initialization at stage 3: {_what(call)} of module {call.name or '<root>'!r} "
                f"reads or writes a parameter of a unit initialized and sharded before it ({err}). "
                "Stage 3 initializes one unit at a time, children first: initialize a block's parameters "
                "in the reset_parameters() of modules inside the block, not in a parent's (or use stage 1 "
                "or 2, which initialize the whole model at once)"
            ) from err
        finally:
            for pname, param in sliced.items():
                whole = module._parameters[pname]
                assert whole is not None
                with torch.no_grad():
                    local(param).copy_(slice_of(param, whole))
            module._parameters.update(scratch)
            module._parameters.update(sliced)
        written.update(id(p) for p in module._parameters.values() if p is not None)

    @torch.no_grad()
    def _dry_run(self, calls: list[Call]) -> list[RngState]:
        """Stage 3 with a model initializer: its calls come after every reset of the model's modules,
        so unit by unit they would draw other numbers. Run every call once, in the eager order, on
        scratch tensors of its module's own (one module at a time), and keep where the generators
        stood before each: the replay then sets them there."""
        states = []
        for call in calls:
            states.append(capture_rng(self.device))
            # a reset may write its children's tensors (MultiheadAttention's does): they get scratch too
            with _scratch_own(call.module, self.device, subtree=call.kind == "reset"):
                try:
                    call.run()
                except RuntimeError as err:  # a stand-in of another module's parameter was written
                    raise DeferredInitError(
                        f"deferred initialization at stage 3: {_what(call)} of module "
                        f"{call.name or '<root>'!r} writes tensors of other modules ({err}); initialize "
                        "each module's own tensors only, or use stage 1 or 2"
                    ) from err
        return states

    @torch.no_grad()
    def _finish_unit(self, unit: int) -> None:
        """Stage 3: ``unit``'s parameters checked, cut to this rank's shard, their buckets freed."""
        assert self.flat is not None and self.layout is not None
        params = [self.flat.params[i] for i in self.layout.params_of(unit)]
        indices = {self.bucket_of[i].index for i in self.layout.params_of(unit)}
        chosen = [self.flat.plan.buckets[b] for b in sorted(indices)]
        for bucket in chosen:  # a unit that no module visited (none of its parameters owned)
            if not self.flat.is_gathered(bucket):
                for slot in bucket.slots:
                    self._materialize_bucket(slot.param_index)
        self._check(params, f"when unit {self.layout.names[unit] or '<root>'!r} was initialized")
        self.flat.keep_own_slices(chosen)
        for bucket in chosen:
            self.flat.free(bucket)

    def _check(self, tensors: Sequence[Tensor], when: str) -> None:
        checked = [t for t in tensors if t.dtype != torch.bool]
        if not checked:
            return
        flags = torch.stack([unwritten(local(t)).any() for t in checked]).tolist()  # a slice: no collective
        missed = [self.names.get(id(t), "<unnamed>") for t, bad in zip(checked, flags, strict=True) if bad]
        if missed:
            raise DeferredInitError(
                f"deferred initialization: {', '.join(missed)} still hold(s) NaN (an integer tensor: its "
                f"dtype's minimum, an unsigned one's maximum) {when}: no reset_parameters() nor model "
                "initializer wrote them (or one read them before they were written). Initialize every "
                "tensor a module owns in its reset_parameters(), or build the model without empty_init"
            )


@contextmanager
def _scratch_own(module: nn.Module, device: torch.device, subtree: bool = False) -> Iterator[None]:
    """Inside: ``module``'s own parameters and buffers (``subtree``: its descendants' too) are empty
    tensors on ``device`` of their shapes."""
    kept: list[tuple[dict[str, Any], str, Tensor]] = []
    for owner in dict.fromkeys(module.modules()) if subtree else (module,):
        stores: tuple[dict[str, Any], ...] = (owner._parameters, owner._buffers)
        for store in stores:
            for name, tensor in list(store.items()):
                if tensor is None:
                    continue
                kept.append((store, name, tensor))
                empty = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                is_param = store is owner._parameters
                store[name] = nn.Parameter(empty, requires_grad=tensor.requires_grad) if is_param else empty
    try:
        yield
    finally:
        for store, name, tensor in kept:
            store[name] = tensor


def _in_post_order(calls: list[Call]) -> bool:
    """Whether ``calls`` are each module's own, children first (no model initializer, no
    ``param_init_fn``): the order a unit-by-unit replay makes them in anyway."""
    return all(call.kind == "reset" for call in calls)


def _what(call: Call) -> str:
    return (
        f"{type(call.module).__name__}.reset_parameters()"
        if call.kind == "reset"
        else "the model's _init_weights()"
    )


def stand_ins(params: list[nn.Parameter], device: torch.device) -> None:
    """Stage 3, before the flat buffers are built: each meta parameter becomes a zero-stride tensor on
    ``device`` (one element, no memory of its size), the same object, so that the buffers bind it."""
    for param in params:
        if param.is_meta:
            one = torch.zeros(1, dtype=param.dtype, device=device).expand(param.shape)
            torch.utils.swap_tensors(param, nn.Parameter(one, requires_grad=param.requires_grad))


def materialize(
    root: nn.Module,
    init: DeferredInit,
    flat: FlatParams | None = None,
    layout: UnitLayout | None = None,
) -> int:
    """Give ``root``'s meta tensors their values by the rule (module docstring), on ``init.device``.

    Args:
        flat, layout: stage 3: the sharded flat buffers (built over :func:`stand_ins`) and their
            units; each unit is initialized, cut to this rank's shard and freed in turn. ``None``:
            every tensor full on ``device``.

    Returns:
        The most full-bucket elements held at once (stage 3; 0 otherwise).

    Call :func:`check_deferred` first (before the stage-3 buffers replace the planned parameters).

    Raises:
        DeferredInitError: a tensor left uninitialized; at stage 3, a reset writing into a unit
            already sharded.
    """
    materializer = _Materializer(root, init.device, flat, layout, init.init_fn)
    materializer.states = init.states
    with rng_set_to(init.rng, init.device):
        materializer.run()
    return materializer.peak_elements


def with_eager_states(root: nn.Module, init: DeferredInit) -> DeferredInit:
    """``init`` with the generators' state before each initializer call of ``root``'s eager build,
    found by running every call once on scratch tensors of its module's own (one module at a time,
    nothing kept). For a meta model about to be cut down (a rank's pipeline stages): the calls of what
    remains, replayed from these states, draw the values the whole model's build gives them."""
    calls = eager_calls(root, init.init_fn)
    with rng_set_to(init.rng, init.device):
        states = _Materializer(root, init.device, None, None, init.init_fn)._dry_run(calls)
    return replace(init, states={(id(c.module), c.kind): s for c, s in zip(calls, states, strict=True)})
