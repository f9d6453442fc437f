"""Pipeline stages: which of a model's layers each rank runs, and the model cut down to them.

A model under pipeline parallelism is an ordered list of ``L`` layers (the LightningModule's
``pipeline_layers()``), each taking the previous one's output. A layer is a submodule, or a list of
submodules run in order (a *group*, :data:`Layer`: kept or dropped together, one layer of the cut; the
recipes' models group the embedding with the first block and the final norm and head with the last,
so that the stages hold equal numbers of blocks). ``S = P * V`` stages (``P`` pipeline
ranks, ``V`` virtual stages per rank under the interleaved schedule) each take consecutive layers,
in equal numbers (the first ``L mod S`` stages one more, :func:`stage_layers`); rank ``p`` runs stages
``p, p + P, ..., p + (V - 1) P`` (:func:`rank_stages`), as Megatron-LM and torch's interleaved schedule
lay them out.

:func:`keep_stages` cuts a model down to one rank's layers: every other layer is replaced, in its
parent, by an :class:`OnOtherStage` placeholder without parameters, so the parameters and buffers of
another stage never exist on this rank (a model on the meta device is never materialized there) and
every kept tensor keeps its name in the whole model (``blocks.5.attn.q.weight`` on the stage that
runs block 5): checkpoints of the stages join by name.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

Layer = nn.Module | Sequence[nn.Module]
"""One entry of ``pipeline_layers()``: a submodule, or a group of them run in order."""


def members(layer: Layer) -> list[nn.Module]:
    """The modules of one layer (itself, or its group's, in order)."""
    return [layer] if isinstance(layer, nn.Module) else list(layer)


def stage_layers(layers: int, stages: int) -> list[range]:
    """The layers of each of ``stages`` stages: consecutive, equal numbers, the first ``layers mod
    stages`` stages one more.

    Raises:
        ValueError: fewer layers than stages (a stage would be empty), named with both counts.
    """
    if not (isinstance(stages, int) and stages >= 1):
        raise ValueError(f"the number of pipeline stages must be a positive int, got {stages!r}")
    if layers < stages:
        raise ValueError(
            f"the model has {layers} pipeline layers, fewer than the {stages} stages it is split into "
            "(pipeline_parallel_size x virtual stages): every stage needs at least one layer"
        )
    base, extra = divmod(layers, stages)
    bounds, start = [], 0
    for s in range(stages):
        stop = start + base + (1 if s < extra else 0)
        bounds.append(range(start, stop))
        start = stop
    return bounds


def rank_stages(rank: int, ranks: int, virtual: int = 1) -> list[int]:
    """The stage indices pipeline rank ``rank`` of ``ranks`` runs: ``rank + v * ranks`` for each of its
    ``virtual`` stages (one without interleaving)."""
    if not 0 <= rank < ranks:
        raise ValueError(f"pipeline rank {rank!r} is not one of the {ranks} pipeline ranks")
    return [rank + v * ranks for v in range(virtual)]


class OnOtherStage(nn.Module):
    """A layer another pipeline stage runs: no parameters, no buffers; calling it raises."""

    def __init__(self, name: str, stage: int, param_names: Sequence[str] = ()) -> None:
        super().__init__()
        self.layer_name = name
        self.stage = stage
        self.param_names = tuple(param_names)
        """The whole model's names of the parameters the layer holds, in its ``named_parameters()``
        order (:func:`whole_order`)."""

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            f"layer {self.layer_name!r} runs on pipeline stage {self.stage}, not on this rank: under "
            "pipeline_parallel_size > 1 the strategy runs the stages' forwards (the LightningModule's "
            "pipeline_layers()), never the whole model's"
        )

    def extra_repr(self) -> str:
        return f"{self.layer_name!r}, stage={self.stage}"


def layer_names(model: nn.Module, layers: Sequence[Layer]) -> list[list[str]]:
    """The names in ``model`` of each layer's modules (a module's first, if it has several).

    Raises:
        ValueError: a module that is no module of ``model``, one listed twice, ``model`` itself, or an
            empty group (named by its position in the list).
    """
    names: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), name)
    found: list[list[str]] = []
    seen: dict[str, str] = {}
    for i, layer in enumerate(layers):
        grouped = not isinstance(layer, nn.Module)
        if grouped and not (isinstance(layer, Sequence) and len(layer) > 0):
            raise ValueError(
                f"pipeline_layers()[{i}] is {layer!r}: each entry must be a submodule of the model or a "
                "non-empty list of them (a group run in order)"
            )
        found.append([])
        for j, module in enumerate(members(layer)):
            where = f"[{i}][{j}]" if grouped else f"[{i}]"
            name = names.get(id(module)) if isinstance(module, nn.Module) else None
            if not name:  # None: not in the model; "": the model itself
                raise ValueError(
                    f"pipeline_layers(){where} ({type(module).__name__}) is not a submodule of the model: "
                    "list the model's own layers, in the order its forward runs them"
                )
            if name in seen:
                raise ValueError(
                    f"pipeline_layers() lists {name!r} twice (positions {seen[name]} and {where})"
                )
            seen[name] = where
            found[-1].append(name)
    return found


def check_stage_split(model: nn.Module, layers: Sequence[Layer], bounds: Sequence[range]) -> None:
    """Every trainable tensor of ``model`` lives in exactly one stage's layers.

    Raises:
        ValueError: a parameter outside every layer (it would be trained on no stage, or on all), or one
            shared by layers of two stages (tied embeddings across the first and the last stage), named.
    """
    stage_of: dict[int, int] = {}
    for s, bound in enumerate(bounds):
        for i in bound:
            for p in (p for m in members(layers[i]) for p in m.parameters()):
                if stage_of.setdefault(id(p), s) != s:
                    name = _param_name(model, p)
                    raise ValueError(
                        f"parameter {name!r} is used by layers of pipeline stages {stage_of[id(p)]} and {s} "
                        "(tied weights across stages are not supported: untie them, e.g. "
                        "tie_embeddings=False)"
                    )
    outside = [n for n, p in model.named_parameters() if id(p) not in stage_of]
    if outside:
        raise ValueError(
            f"parameters outside every pipeline layer: {outside[:5]}{' ...' if len(outside) > 5 else ''}; "
            "every parameter must belong to one of pipeline_layers() (a parameter of no layer would exist "
            "on every stage)"
        )


def keep_stages(
    model: nn.Module, layers: Sequence[Layer], bounds: Sequence[range], mine: Sequence[int]
) -> None:
    """Replace every layer (every module of a group) of a stage not in ``mine`` by an
    :class:`OnOtherStage` in its parent, in place (see the module docstring). ``bounds``:
    :func:`stage_layers`'."""
    names = layer_names(model, layers)
    dropped = [name for s, bound in enumerate(bounds) if s not in mine for i in bound for name in names[i]]
    held: dict[str, list[str]] = {name: [] for name in dropped}
    for name, _ in model.named_parameters():  # each parameter to the layer holding it, if another stage's
        parts = name.split(".")
        layer = next((p for k in range(1, len(parts)) if (p := ".".join(parts[:k])) in held), None)
        if layer is not None:
            held[layer].append(name)
    for s, bound in enumerate(bounds):
        if s in mine:
            continue
        for name in (name for i in bound for name in names[i]):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, OnOtherStage(name, s, held[name]))


def whole_order(model: nn.Module) -> list[str]:
    """The parameter names of the whole model, in its ``named_parameters()`` order, from ``model`` cut
    by :func:`keep_stages` (each :class:`OnOtherStage` stands for its layer's parameters, at the layer's
    place): the order a torch optimizer over the unsplit model numbers its parameters in, the same on
    every pipeline rank. ``model``'s own names for a model not cut."""
    order: list[str] = []
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        if isinstance(module, OnOtherStage):
            order += module.param_names
            continue
        for key, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                order.append(f"{prefix}.{key}" if prefix else key)
    return order


def _param_name(model: nn.Module, param: nn.Parameter) -> str:
    for name, p in model.named_parameters(remove_duplicate=False):
        if p is param:
            return name
    return "<unnamed>"


def other_stage_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The state-dict prefixes (``"blocks.3."``) of the layers :func:`keep_stages` replaced in ``model``:
    the keys of a whole model's state that another pipeline rank holds (none in a model not cut)."""
    return tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, OnOtherStage))
