"""Checkpoints of tensor-parallel models: one data-parallel checkpoint per tensor-parallel rank, in one
directory, and the whole tensors they make together.

An engine whose parameters are ``DTensor``s (:mod:`lightning_zero.engine.tensor_parallel`) shards
each parameter's *local* slice over the data-parallel ranks. Its checkpoint holds, for each
tensor-parallel rank ``t`` of ``T``, the data-parallel shard files of those slices, named
``shard-RRRRR-of-NNNNN-tensor-TT-of-TT.pt`` (:func:`lightning_zero.checkpoint.format.shard_name`),
in the usual per-bucket format over that rank's bucket plan. ``meta.pt`` records:

  * ``meta["plan"]``: tensor-parallel rank 0's plan, with every parameter's *global* shape: what
    readers of whole parameters (consolidation, ``load_full_state_dict``, the exports, ``verify``)
    see, as in any checkpoint;
  * ``meta["tensor"]``: ``{"size": T, "placements": {name: ("shard", dim) | ("replicate",)},
    "plans": [the plan of tensor-parallel rank t, local shapes, for t < T]}``.

Reading (:mod:`lightning_zero.checkpoint.reshard`):

  * **the same tensor-parallel layout** (``T`` and every placement): tensor-parallel rank ``t``
    reads tensor-parallel rank ``t``'s files (:func:`view`), on any data-parallel size, exactly as any
    checkpoint is read;
  * **another layout** (``T=2`` into ``T=1`` or the reverse, another placement): each parameter is
    made whole from the saved slices (:func:`join`: a ``("shard", d)`` one concatenated along ``d``
    in tensor-parallel rank order, a replicated one taken from rank 0), and this rank's slice under
    its own placement is cut from it (:func:`cut`). Adam's moments and a weight average are
    elementwise, so they reshard as the parameter does. A rank holds one whole parameter at a time.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_zero.comm.communicator import Comm
from lightning_zero.engine.engine import ShardEngine
from lightning_zero.engine.tensor_parallel import Placement, slice_of
from lightning_zero.layout.local import is_dtensor

TENSOR = "tensor"
"""Key of the tensor-parallel layout in ``meta.pt`` (only in checkpoints of tensor-parallel models)."""
VIEW = "tensor_rank"
"""Key a :func:`view` adds to ``meta``: the tensor-parallel rank whose files it reads."""
REPLICATE: Placement = ("replicate",)
_EVERYONE: weakref.WeakKeyDictionary[ShardEngine, Comm] = weakref.WeakKeyDictionary()
"""The checkpoint communicator of a pipeline engine without tensor parallelism (built once per engine;
a tensor-parallel engine keeps it on its ``tensor.everyone``)."""


def checkpoint_comm(engine: ShardEngine) -> Comm:
    """The ranks that save and load a checkpoint together: the data-parallel ones, and with tensor or
    pipeline parallelism every rank (the default process group, which must be exactly the data x tensor
    x pipeline ranks).

    Raises:
        NotImplementedError: tensor-parallel, pipeline and data-parallel ranks that are not the whole world.
    """
    tensor, pipeline = engine.tensor, engine.pipeline
    if tensor is None and pipeline is None:
        return engine.world
    if tensor is not None and tensor.everyone is not None:
        return tensor.everyone
    if engine in _EVERYONE:
        return _EVERYONE[engine]
    everyone = Comm()
    sizes = {"data-parallel": engine.world.world_size}
    if tensor is not None:
        sizes["tensor-parallel"] = tensor.size
    if pipeline is not None:
        sizes["pipeline"] = pipeline.world_size
    if everyone.world_size != math.prod(sizes.values()):
        raise NotImplementedError(
            f"a checkpoint of a tensor- or pipeline-parallel model is written by every rank of the default "
            f"process group ({everyone.world_size}), which must be the model's "
            + " x ".join(f"{n} {k}" for k, n in sizes.items())
            + " ranks: build the mesh over the whole world"
        )
    if tensor is not None:
        tensor.everyone = everyone
    else:
        _EVERYONE[engine] = everyone
    return everyone


def engine_layout(engine: ShardEngine) -> tuple[int, int, list[Placement], list[tuple[int, ...]]]:
    """``(T, t, placements, global shapes)`` of ``engine``'s parameters in plan order (``T=1`` and
    every parameter replicated without tensor parallelism)."""
    tensor = engine.tensor
    if tensor is None:
        return 1, 0, [REPLICATE] * len(engine.plan.params), [tuple(p.shape) for p in engine.plan.params]
    return tensor.size, tensor.rank, list(tensor.placements), list(tensor.shapes)


def saved_size(meta: dict[str, Any]) -> int:
    """The tensor-parallel size that wrote a checkpoint (1 for a checkpoint without one)."""
    return int(meta[TENSOR]["size"]) if TENSOR in meta else 1


def saved_placement(meta: dict[str, Any], name: str) -> Placement:
    """How parameter ``name`` was laid out over the saving tensor-parallel group."""
    if TENSOR not in meta:
        return REPLICATE
    return tuple(meta[TENSOR]["placements"][name])  # type: ignore[return-value]


def same_layout(engine: ShardEngine, meta: dict[str, Any]) -> bool:
    """Whether this engine's ranks read the saved files of their own tensor-parallel rank as they are:
    the same tensor-parallel size and, for every parameter both know, the same placement."""
    size, _, placements, _ = engine_layout(engine)
    if size != saved_size(meta):
        return False
    if TENSOR not in meta:
        return True
    saved = meta[TENSOR]["placements"]
    return all(
        tuple(saved[p.name]) == placements[i] for i, p in enumerate(engine.plan.params) if p.name in saved
    )


def record(engine: ShardEngine, plans: Sequence[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Add the tensor-parallel layout to ``meta`` (written by a tensor-parallel engine), given every
    tensor-parallel rank's plan (``plan_meta``, in rank order): see the module docstring."""
    size, _, placements, shapes = engine_layout(engine)
    names = [p.name for p in engine.plan.params]
    meta[TENSOR] = {
        "size": size,
        "placements": {n: list(placements[i]) for i, n in enumerate(names)},
        "plans": list(plans),
    }
    whole = dict(zip(names, shapes, strict=True))
    meta["plan"] = {
        **plans[0],
        "params": [{**p, "shape": list(whole[p["name"]])} for p in plans[0]["params"]],
    }


def view(meta: dict[str, Any], rank: int) -> dict[str, Any]:
    """``meta`` as tensor-parallel rank ``rank``'s own checkpoint: its plan (local shapes) and files.
    A checkpoint without tensor parallelism is its own view at rank 0."""
    if TENSOR not in meta:
        return meta
    return {**meta, "plan": meta[TENSOR]["plans"][rank], VIEW: rank}


def views(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Every tensor-parallel rank's :func:`view`."""
    return [view(meta, t) for t in range(saved_size(meta))]


def join(slices: Sequence[Tensor], where: Placement) -> Tensor:
    """The whole tensor made of every tensor-parallel rank's slice (in rank order) laid out as
    ``where``."""
    if where[0] != "shard" or len(slices) == 1:
        return slices[0]
    return torch.cat(list(slices), dim=where[1])  # type: ignore[misc]


@torch.no_grad()
def copy_slices(module: torch.nn.Module, state: dict[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
    """Copy into each tensor-parallel (``DTensor``) parameter of ``module`` this rank's slice of its
    whole tensor in ``state`` (what ``load_state_dict`` cannot do: it copies whole tensors). Returns
    the other entries of ``state``, for ``load_state_dict``, and the names of the parameters filled.

    Raises:
        ValueError: a whole tensor whose shape is not the parameter's global shape (names both).
    """
    rest, filled = dict(state), []
    for name, param in module.named_parameters():
        if not is_dtensor(param) or name not in rest:
            continue
        whole = rest.pop(name)
        if tuple(whole.shape) != tuple(param.shape):
            raise ValueError(
                f"{name}: the checkpoint holds shape {list(whole.shape)}, the model's tensor-parallel "
                f"parameter is {list(param.shape)} whole"
            )
        param._local_tensor.copy_(slice_of(param, whole))  # type: ignore[attr-defined]
        filled.append(name)
    return rest, filled
