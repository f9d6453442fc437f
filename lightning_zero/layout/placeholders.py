"""Stage 3's freed parameters: placeholders that refuse every read of a value and every write,
naming the parameter.

While its unit is freed (:meth:`~lightning_zero.layout.flat.FlatParams.free`) a parameter's
``.data`` is a *placeholder*: one NaN element of its own, broadcast to the parameter's shape (stride
0). No two parameters share an element, and the bucket's NaN elements are written again at every
free, so a write that gets past the refusal below reaches no other parameter and lasts only until
that parameter's unit is next gathered.

Torch alone refuses neither: a read gives the NaN, and although an in-place op into a tensor of
stride 0 raises ("more than one element of the written-to tensor refers to a single memory
location"), ``fill_`` and ``zero_`` (which ``nn.init.zeros_``/``ones_``/``constant_`` call) skip that
check, and a tensor of one element has nothing to overlap; torch has no read-only tensor. So
:func:`refuse_writes` gives the freed parameter a class of its own, a subclass of its class whose
``__torch_function__`` raises :class:`FreedParameterError`, naming the parameter and the way to its
full value (``lightning_zero.gathered(module)``), at the op:

  * that writes into it: an in-place op (a name ending in ``_``: ``fill_``, ``zero_``, ``copy_``,
    ``add_``, ``normal_``, ``torch._foreach_*_`` over a list holding it; ``p += 1``; ``p[i] = v``), an
    op with ``out=`` it or ``inplace=True`` on it;
  * that reads its values: any other op taking it (``p.sum()``, ``p.clone()``, ``p * 2``,
    ``torch.norm(p)``, ``p.tolist()``, ``p.to(other_device)``), except those that read metadata only
    (:data:`_NO_VALUES`: ``shape``, ``dtype``, ``numel()``, ``requires_grad_``, ``.grad``, setting
    ``.data``, hooks) and conversions that return it unchanged (``module.to(its device)``).

``param.data`` and ``param.detach()`` return a tensor that refuses the same way (what a
``state_dict()`` and an EMA copy take). :func:`allow_writes` restores the class when the unit is
gathered, so the ops of a unit's forward and backward, and of ``gathered()``, meet an ordinary
parameter (no ``__torch_function__`` on that path).

Limits: a view taken through a property (``param.T``, ``param.mT``) is an ordinary tensor holding
NaN; ``copy.deepcopy`` of a freed
parameter gives an ordinary parameter holding NaN; a parameter class that defines its own
``__torch_function__`` keeps it and is not guarded. Local: no communication, no
``torch.distributed``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from lightning_zero.layout.local import is_dtensor

_NAMES: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Stage-3 parameters (and the ``.data`` tensors taken from freed ones) -> the parameter's name."""

_FREED: dict[type, type] = {}
"""A parameter class -> its refusing subclass (built once per class)."""
_REFUSING: set[type] = set()
"""The refusing classes: those of ``_FREED`` and ``_FreedData`` (added below)."""

_PASS_THROUGH = torch._C._disabled_torch_function_impl
_DATA = torch._C.TensorBase.__dict__["data"]
_METADATA_ONLY = frozenset({"requires_grad_", "share_memory_"})
"""In-place by name, yet no write of values."""
_AUGMENTED = frozenset(
    f"__i{op}__" for op in "add sub mul truediv floordiv mod pow and or xor lshift rshift".split()
)
"""``p += 1`` and its kind, should one reach ``__torch_function__`` as itself."""


class FreedParameterError(RuntimeError):
    """A write into a stage-3 parameter whose unit is freed (its values are sharded)."""


def name_parameter(param: Tensor, name: str) -> None:
    """The name a refusal of a write into ``param`` gives (set once, when the parameter is bound)."""
    _NAMES[param] = name


def refuse_writes(param: Tensor) -> None:
    """From now on an operation that writes into ``param`` (a freed parameter, its ``.data`` already a
    placeholder) raises :class:`FreedParameterError` naming it (:func:`name_parameter`)."""
    cls = type(param)
    if cls in _REFUSING:
        return
    if cls.__torch_function__ is not _PASS_THROUGH:  # a class with torch-function semantics of its own
        return
    if cls not in _FREED:
        _FREED[cls] = type(
            f"Freed{cls.__name__}",
            (cls,),
            {
                "__torch_function__": classmethod(_refusing),
                "__deepcopy__": _plain_deepcopy,
                "__repr__": _freed_repr,
                "__module__": __name__,
            },
        )
        _REFUSING.add(_FREED[cls])
    param.__class__ = _FREED[cls]


def is_freed(param: Tensor) -> bool:
    """Whether ``param`` is a placeholder now (its unit freed: reads of values and writes refused)."""
    return type(param) in _REFUSING


def allow_writes(param: Tensor) -> None:
    """``param`` is an ordinary parameter again (its unit is gathered); a no-op if it is one."""
    cls = type(param)
    if cls in _REFUSING:
        param.__class__ = cls.__mro__[1]


def _refusing(
    cls: type, func: Callable[..., Any], types: tuple[type, ...], args: tuple = (), kwargs: dict | None = None
) -> Any:
    kwargs = kwargs or {}
    op = getattr(func, "__name__", str(func))
    for tensor in _written(func, args, kwargs):
        if type(tensor) in _REFUSING:
            raise FreedParameterError(_message(_NAMES.get(tensor, "<unnamed>"), op))
    freed = [t for t in _inputs(args, kwargs) if type(t) in _REFUSING]
    if freed and op not in _NO_VALUES:
        if op in _CONVERSIONS:  # module.to(device) where the parameter already is: itself, allowed
            result = _PASS_THROUGH(func, types, args, kwargs)
            if result is args[0]:
                return result
        raise FreedParameterError(_read_message(_NAMES.get(freed[0], "<unnamed>"), op))
    result = _PASS_THROUGH(func, types, args, kwargs)
    data = getattr(func, "__self__", None) is _DATA and op == "__get__"
    if (data or op == "detach") and isinstance(result, Tensor) and freed:
        # param.data, param.detach() (a state_dict): a tensor that refuses as the parameter does
        name = _NAMES.get(freed[0], "<unnamed>")
        if is_dtensor(result):  # a tensor-parallel parameter's: its own class, refusing
            refuse_writes(result)
        else:
            result = result.as_subclass(_FreedData)
        _NAMES[result] = name
    return result


def _inputs(args: tuple, kwargs: dict[str, Any]) -> list[object]:
    """The arguments of an op, and the items of those that are lists or tuples (``torch._foreach_*``)."""
    found: list[object] = []
    for value in (*args, *kwargs.values()):
        found += list(value) if isinstance(value, (list, tuple)) else [value]
    return found


def _written(func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> list[object]:
    """The tensors ``func(*args, **kwargs)`` would write into."""
    name = getattr(func, "__name__", "")
    out = kwargs.get("out")
    written: list[object] = list(out) if isinstance(out, (list, tuple)) else [out]
    inplace = name.endswith("_") and not name.startswith("__") and name not in _METADATA_ONLY
    if inplace or name in _AUGMENTED or name == "__setitem__" or kwargs.get("inplace") is True:
        # the written tensor comes first; nn.init's functions pass it as ``tensor=``
        first = args[0] if args else kwargs.get("tensor", kwargs.get("input"))
        written += list(first) if isinstance(first, (list, tuple)) else [first]
    return written


def _message(name: str, op: str) -> str:
    return (
        f"stage 3: {op} would write into parameter {name!r}, which is sharded: outside its unit's "
        "forward and backward it is a placeholder (NaN) and the write would be lost. Write full "
        "parameters inside `with lightning_zero.gathered(module, writeback=True):` (module: the model or "
        "the submodule holding them), with `model.load_state_dict(...)`, or after "
        "`lightning_zero.unshard(model)`; on every rank"
    )


def _read_message(name: str, op: str) -> str:
    return (
        f"stage 3: {op} reads parameter {name!r}, which is sharded: outside its unit's forward and "
        "backward it is a placeholder (NaN), not its value. Read full parameters inside "
        "`with lightning_zero.gathered(module):` (module: the model or the submodule holding them; its "
        "units are gathered for the block, then freed), through `model.state_dict()`, or after "
        "`lightning_zero.unshard(model)`; on every rank"
    )


_NO_VALUES = frozenset(
    {
        "__get__",  # properties: shape, dtype, device, requires_grad, grad, is_leaf, ...
        "__set__",  # param.data = ..., param.grad = ..., param.requires_grad = ...
        "__delete__",
        "__hash__",
        "__len__",
        "size",
        "dim",
        "numel",
        "nelement",
        "element_size",
        "stride",
        "storage_offset",
        "is_contiguous",
        "is_floating_point",
        "is_complex",
        "is_signed",
        "is_shared",
        "is_pinned",
        "get_device",
        "data_ptr",
        "requires_grad_",
        "share_memory_",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "_has_compatible_shallow_copy_type",  # Module._apply (module.to)
        "_is_view",
        "detach",  # a tensor that refuses as the parameter does (state_dict, EMA copies)
        "empty_like",  # the *_like factories take the shape, dtype and device
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
    }
)
"""Ops on a freed parameter that read no value (metadata, hooks, rebinding)."""
_CONVERSIONS = frozenset({"to", "cpu", "cuda", "type", "float", "double", "half", "bfloat16", "contiguous"})
"""Ops allowed on a freed parameter when they return it unchanged (no copy of its values)."""


def _freed_repr(self: Tensor) -> str:
    return (
        f"{type(self).__mro__[1].__name__} {_NAMES.get(self, '')!r} of shape {tuple(self.shape)}, sharded "
        "(stage 3): a NaN placeholder while its unit is freed"
    )


def _plain_deepcopy(self: Tensor, memo: dict[int, Any]) -> Tensor:
    """A copy of a freed parameter is an ordinary parameter of its class (holding NaN)."""
    if id(self) in memo:
        return memo[id(self)]
    base = type(self).__mro__[1]
    self.__class__ = base
    try:
        result = copy.deepcopy(self, memo)
    finally:
        self.__class__ = _FREED[base]
    return result


class _FreedData(Tensor):
    """``param.data`` of a freed parameter: refuses writes; what is computed from it is plain."""

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: tuple[type, ...], args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        return _refusing(cls, func, types, args, kwargs)

    def __reduce_ex__(self, proto: Any) -> Any:  # pickled as a plain tensor
        return self.as_subclass(Tensor).__reduce_ex__(proto)

    def __deepcopy__(self, memo: dict[int, Any]) -> Tensor:
        return copy.deepcopy(self.as_subclass(Tensor), memo)


_REFUSING.add(_FreedData)
