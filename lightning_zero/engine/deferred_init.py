"""Deferred initialization: a model built on the meta device gets its values here, module by module.

A model built under ``Trainer.init_module(empty_init=True)``, ``Fabric.init_module(empty_init=True)``
or, at stage 3, in ``LightningModule.configure_model()`` has its parameters and buffers on the
``meta`` device: shapes and dtypes, no memory, no values. The strategy gives them values here.

**The rule.** Modules are visited children first, in registration order (post-order; a shared
module once), and each module that defines ``reset_parameters()`` (or, lacking it, torch's private
``_reset_parameters()``, which ``nn.Transformer`` and ``nn.MultiheadAttention`` run at the end of
their constructors) has it called, under
``torch.no_grad()``, with the random-number generators (CPU and, on an accelerator, the device's)
set to the state they had when the model's construction began (the entry into ``init_module`` or
``configure_model``; rank 0's, so that every rank draws the same values without a broadcast of
the model). This is the order in which eager construction runs them when each module calls its
``reset_parameters()`` at the end of its own ``__init__`` and draws nothing else from the RNG there,
as torch's layers (``Linear``, ``Embedding``, ``LayerNorm``, ``RMSNorm``, convolutions,
``BatchNorm``) do: the values are then bit-identical to the same construction without
``empty_init``. A parameter held by two modules (tied weights) is initialized by the first one
visited; the later module's ``reset_parameters()`` still runs, on a scratch tensor (as its own
weight was initialized in its constructor and then replaced by the tied one), so the RNG advances
as in eager construction.

**What it cannot reproduce, and what happens then.**
  * A module that owns a tensor on the meta device and has no ``reset_parameters()`` (a raw
    ``nn.Parameter(torch.randn(...))`` in a constructor): refused before any work, naming every
    such module.
  * A tensor no ``reset_parameters()`` wrote: each is filled with NaN before initialization and
    checked after (as soon as its unit is initialized, at stage 3): an error names the parameter
    or buffer. A reset that reads a value not yet initialized propagates the NaN and is caught the
    same way.
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
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_zero.layout.buckets import Bucket
from lightning_zero.layout.flat import FlatParams
from lightning_zero.layout.placeholders import FreedParameterError
from lightning_zero.layout.units import UnitLayout


class DeferredInitError(ValueError):
    """A model on the meta device that the rule above cannot initialize (named)."""


@dataclass(frozen=True)
class DeferredInit:
    """Where and from which generator state a meta model is initialized (the strategy's choice)."""

    device: torch.device
    rng: RngState


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
def _rng_set_to(state: RngState, device: torch.device) -> Iterator[None]:
    """Inside: the generators hold ``state``; at the exit, what they held before."""
    accelerator = state.device is not None and device.type not in ("cpu", "meta")
    devices = [device] if accelerator else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if accelerator else "cuda"):
        torch.random.set_rng_state(state.cpu)
        if accelerator:
            assert state.device is not None
            torch.get_device_module(device.type).set_rng_state(state.device, device)
        yield


def is_deferred(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in _tensors(module))


def _tensors(module: nn.Module) -> Iterator[Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def post_order(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """``root``'s modules, children before their parent, in registration order; a shared module once."""
    seen: set[int] = set()
    order: list[tuple[str, nn.Module]] = []

    def visit(module: nn.Module, name: str) -> None:
        seen.add(id(module))
        for child_name, child in module._modules.items():
            if child is not None and id(child) not in seen:
                visit(child, f"{name}.{child_name}" if name else child_name)
        order.append((name, module))

    visit(root, "")
    return order


def reset_method(module: nn.Module) -> Callable[[], None] | None:
    """``module.reset_parameters``, or, lacking it, torch's private ``_reset_parameters`` (what
    ``nn.Transformer`` and ``nn.MultiheadAttention`` call at the end of their constructors)."""
    for name in ("reset_parameters", "_reset_parameters"):
        method = getattr(module, name, None)
        if callable(method):
            return method
    return None


def check_deferred(root: nn.Module) -> None:
    """Refuse, before any work, a model the rule cannot initialize.

    Raises:
        DeferredInitError: some tensors on the meta device and others not (naming one of each),
            stacks of copied layers, or modules owning meta tensors without ``reset_parameters()``
            (naming them all).
    """
    named = list(root.named_parameters()) + list(root.named_buffers())
    meta = [n for n, t in named if t.is_meta]
    real = [f"{n} ({t.device})" for n, t in named if not t.is_meta]
    if meta and real:
        raise DeferredInitError(
            f"the model is partly on the meta device ({meta[0]}, {len(meta)} in all) and partly not "
            f"({real[0]}, {len(real)} in all): build all of it under init_module(empty_init=True) or "
            "configure_model(), or none of it"
        )
    cloned = [
        f"{name or '<root>'} ({type(module).__name__} of {len(module.layers)} layers)"
        for name, module in post_order(root)
        if isinstance(module, _CLONING) and module.layers is not None and len(module.layers) > 1
    ]
    if cloned:
        raise DeferredInitError(
            f"{'; '.join(cloned)}: these build their layers as copies of one layer (torch's _get_clones, "
            "copy.deepcopy): eager construction draws one layer's values and copies them, a replay of "
            "each layer's reset_parameters() would draw every layer's anew, so the values would differ "
            "from eager construction. Build this model without empty_init (or with one layer per stack)"
        )
    lacking = []
    for name, module in post_order(root):
        owned = [
            n
            for n, t in (*module._parameters.items(), *module._buffers.items())
            if t is not None and t.is_meta
        ]
        if owned and reset_method(module) is None:
            lacking.append(f"{name or '<root>'} ({type(module).__name__}: {', '.join(owned)})")
    if lacking:
        raise DeferredInitError(
            "deferred initialization calls each module's reset_parameters() (children first), but these "
            f"modules own tensors on the meta device and have none: {'; '.join(lacking)}. Give each a "
            "reset_parameters() that initializes its own tensors (and call it at the end of its __init__, "
            "so that eager construction matches), or build the model without empty_init"
        )


_CLONING = (nn.TransformerEncoder, nn.TransformerDecoder)
"""torch's stacks whose layers are deep copies of the one layer given to them."""


class _Materializer:
    """One deferred initialization (see the module docstring)."""

    def __init__(
        self,
        root: nn.Module,
        device: torch.device,
        flat: FlatParams | None,
        layout: UnitLayout | None,
    ) -> None:
        self.root, self.device, self.flat, self.layout = root, device, flat, layout
        self.planned: dict[int, int] = {} if flat is None else {id(p): i for i, p in enumerate(flat.params)}
        self.bucket_of: dict[int, Bucket] = (
            {} if flat is None else {s.param_index: b for b in flat.plan.buckets for s in b.slots}
        )
        self.initialized: set[int] = set()
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
                real = nn.Parameter(_nan_like(param, self.device), requires_grad=param.requires_grad)
                torch.utils.swap_tensors(param, real)  # the same object: optimizers keep their references
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = _nan_like(buffer, self.device)

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

    # ---- running the resets -----------------------------------------------------------------

    def _reset(self, name: str, module: nn.Module) -> None:
        reset = reset_method(module)
        if reset is None:
            return
        scratch: dict[str, nn.Parameter] = {}
        for pname, param in module._parameters.items():
            if param is not None and id(param) in self.initialized:  # tied: an earlier module's
                scratch[pname] = param
                module._parameters[pname] = nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device=self.device),
                    requires_grad=param.requires_grad,
                )
        try:
            with torch.no_grad():
                reset()
        except FreedParameterError as err:
            raise DeferredInitError(
                f"deferred initialization at stage 3: {type(module).__name__}.reset_parameters() of "
                f"module {name or '<root>'!r} reads or writes a parameter of a unit initialized and "
                f"sharded before it ({err}). Stage 3 initializes one unit at a time, children first: "
                "initialize a block's parameters in the reset_parameters() of modules inside the block, "
                "not in a parent's (or use stage 1 or 2, which initialize the whole model at once)"
            ) from err
        finally:
            module._parameters.update(scratch)
        for param in module._parameters.values():
            if param is not None:
                self.initialized.add(id(param))

    def run(self) -> None:
        for name, module in post_order(self.root):
            self._own(module)
            self._reset(name, module)
            unit = self._unit_of_module.get(id(module))
            if unit is not None:
                self._finish_unit(unit)
        self._check(
            [t for t in _tensors(self.root) if id(t) not in self.planned],
            "after every reset_parameters() ran",
        )

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
        floating = [t for t in tensors if t.is_floating_point() or t.is_complex()]
        if not floating:
            return
        flags = torch.stack([torch.isnan(t).any() for t in floating]).tolist()
        missed = [self.names.get(id(t), "<unnamed>") for t, bad in zip(floating, flags, strict=True) if bad]
        if missed:
            raise DeferredInitError(
                f"deferred initialization: {', '.join(missed)} still hold(s) NaN {when}: no "
                "reset_parameters() wrote them (or one read them before they were written). Initialize "
                "every tensor a module owns in its reset_parameters(), or build the model without empty_init"
            )


def _nan_like(tensor: Tensor, device: torch.device) -> Tensor:
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    if out.is_floating_point() or out.is_complex():
        out.fill_(float("nan"))
    return out


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
    materializer = _Materializer(root, init.device, flat, layout)
    with _rng_set_to(init.rng, init.device):
        materializer.run()
    return materializer.peak_elements
