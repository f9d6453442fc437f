"""The order in which an eager build initializes a model, and what a replay of it cannot reproduce.

A model built on the meta device gets its values later (:mod:`lightning_zero.engine.deferred_init`)
by replaying, from the generators' state at the construction, the initializer calls an eager build
would have made, in the order it would have made them. Two kinds of calls are known:

  * **a module's ``reset_parameters()``** (or torch's private ``_reset_parameters()``), which torch's
    layers call at the end of their constructors: in post-order (children before their parent, in
    registration order), as construction finishes each module;
  * **a model's per-module initializer**: a Hugging Face ``PreTrainedModel`` runs
    ``self._init_weights(module)`` over its modules (children first) in ``post_init()`` at the end of
    its constructor, skipping modules an inner model's ``post_init()`` already initialized. So at a
    model's place in the post-order come its modules' ``_init_weights`` calls, each by the innermost
    model holding the module. (Built on the meta device, ``post_init()`` skips them: the replay
    makes them.)

The values equal an eager build's from the same seed when nothing else draws from the generators
during construction, and each call writes only its own module's tensors. What breaks the first, and
is refused before any work, naming the modules: a module owning tensors that neither kind of call
initializes; inside a Hugging Face model, a module owning parameters without ``reset_parameters()``
that is not a norm (``LayerNorm``/``RMSNorm`` in its class name, the rule ``_init_weights`` itself
uses; they build their weights with ``torch.ones``): such a module (GPT-2's ``Conv1D``) may draw in
its constructor, which no replay can repeat; stacks of deep-copied layers (``nn.TransformerEncoder``).
Initialization code elsewhere in a constructor (``self.apply(init)`` by hand) is not replayed and
cannot be detected; what it leaves unwritten is caught later (each tensor starts as NaN).

A third kind of call is the user's: the strategies' ``param_init_fn(module)`` (FSDP's), run on every
module, children first, after all the others, as ``model.apply(param_init_fn)`` at the end of the
model's constructor would. With it no module is refused for lacking an initializer: every one is the
function's to initialize, and what it leaves unwritten is found as above. Its values equal such an
eager build's when no constructor draws random numbers outside ``reset_parameters()``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn


class DeferredInitError(ValueError):
    """A model on the meta device that the rule above cannot initialize (named)."""


@dataclass(frozen=True)
class Call:
    """One initializer call of an eager build."""

    kind: str
    """``"reset"`` (the module's ``reset_parameters()``), ``"model"`` (a model's initializer) or
    ``"init_fn"`` (the strategies' ``param_init_fn``)."""
    name: str
    """The module's qualified name (``""``: the root)."""
    module: nn.Module
    run: Callable[[], None]


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


def model_initializer(module: nn.Module) -> Callable[[nn.Module], None] | None:
    """A Hugging Face model's per-module initializer (``_init_weights``, run by its ``post_init()``);
    ``None`` for any other module."""
    init = getattr(module, "_init_weights", None)
    return init if callable(init) and callable(getattr(module, "post_init", None)) else None


def eager_calls(root: nn.Module, init_fn: Callable[[nn.Module], None] | None = None) -> list[Call]:
    """Every initializer call an eager build of ``root`` makes, in its order (module docstring);
    ``init_fn`` (the strategies' ``param_init_fn``) then runs on every module, children first, as
    ``root.apply(init_fn)`` at the end of its constructor would."""
    names = {id(m): n for n, m in post_order(root)}
    claimed: set[int] = set()
    calls: list[Call] = []
    for name, module in post_order(root):
        reset = reset_method(module)
        if reset is not None:
            calls.append(Call("reset", name, module, reset))
        init = model_initializer(module)
        if init is None:
            continue
        for _, inner in post_order(module):
            if id(inner) not in claimed:
                claimed.add(id(inner))
                calls.append(Call("model", names[id(inner)], inner, _marked(init, inner)))
    if init_fn is not None:
        calls += [Call("init_fn", name, module, _bound(init_fn, module)) for name, module in _applied(root)]
    return calls


def _applied(module: nn.Module, name: str = "") -> list[tuple[str, nn.Module]]:
    """The modules ``module.apply(fn)`` calls ``fn`` on, in its order: children first, each parent's
    distinct children (``children()``), so a module held by two parents is visited twice (unlike
    :func:`post_order`, which visits every module once)."""
    order = []
    for child_name, child in module.named_children():
        order += _applied(child, f"{name}.{child_name}" if name else child_name)
    return [*order, (name, module)]


def _bound(init_fn: Callable[[nn.Module], None], module: nn.Module) -> Callable[[], None]:
    return lambda: init_fn(module)


def _marked(init: Callable[[nn.Module], None], module: nn.Module) -> Callable[[], None]:
    def run() -> None:
        init(module)
        module.__dict__["_is_hf_initialized"] = True  # as post_init() leaves it: init_weights() skips it

    return run


def _owned_meta(module: nn.Module, parameters: bool = True, buffers: bool = True) -> list[str]:
    found = [n for n, t in module._parameters.items() if parameters and t is not None and t.is_meta]
    return found + [n for n, t in module._buffers.items() if buffers and t is not None and t.is_meta]


def _is_norm(module: nn.Module) -> bool:
    name = type(module).__name__
    return "LayerNorm" in name or "RMSNorm" in name


def check_deferred(root: nn.Module, init_fn: Callable[[nn.Module], None] | None = None) -> None:
    """Refuse, before any work, a model the rule cannot initialize. With ``init_fn`` every module is
    the function's to initialize (what it leaves unwritten is found later).

    Raises:
        DeferredInitError: some tensors on the meta device and others not (naming one of each),
            stacks of copied layers, or modules owning meta tensors that no initializer call writes,
            or that may draw in their constructors (naming them all).
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
    if init_fn is not None:
        return
    by_model = {id(c.module) for c in eager_calls(root) if c.kind == "model"}
    lacking, drawing = [], []
    for name, module in post_order(root):
        owned = _owned_meta(module)
        if not owned or reset_method(module) is not None:
            continue
        label = f"{name or '<root>'} ({type(module).__name__}: {', '.join(owned)})"
        if id(module) not in by_model:
            lacking.append(label)
        elif _owned_meta(module, buffers=False) and not _is_norm(module):
            drawing.append(label)
    if lacking:
        raise DeferredInitError(
            "deferred initialization calls each module's reset_parameters() (children first), but these "
            f"modules own tensors on the meta device and have none: {'; '.join(lacking)}. Give each a "
            "reset_parameters() that initializes its own tensors (and call it at the end of its __init__, "
            "so that eager construction matches), or build the model without empty_init"
        )
    if drawing:
        raise DeferredInitError(
            "deferred initialization replays the model's initializer (_init_weights) and each module's "
            f"reset_parameters(), but these modules own parameters and have no reset_parameters(): "
            f"{'; '.join(drawing)}. Their constructors may draw random numbers (GPT-2's Conv1D does) that "
            "no replay can repeat, so the values could differ from an eager build's. Give them a "
            "reset_parameters() that does what the constructor does, or build the model without empty_init"
        )


_CLONING = (nn.TransformerEncoder, nn.TransformerDecoder)
"""torch's stacks whose layers are deep copies of the one layer given to them."""
