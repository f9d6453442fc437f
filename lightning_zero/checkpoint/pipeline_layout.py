"""Checkpoints of pipeline-parallel models: every pipeline rank's data-parallel checkpoint in one
directory, and the whole model they make together, joined by parameter name.

Under pipeline parallelism (``P`` pipeline ranks, :mod:`lightning_zero.layout.stages`) each rank holds
only its stages' layers, whose parameters keep their names in the whole model, and each pipeline rank
has its own engine (its own bucket plan) over its data-parallel ranks. Its checkpoint holds, for each
pipeline rank ``p`` of ``P``, that engine's shard files, named
``shard-RRRRR-of-NNNNN-pipeline-PP-of-PP.pt`` (and ``-tensor-TT-of-TT`` after it with tensor
parallelism inside the stages; :func:`lightning_zero.checkpoint.format.shard_name`), in the usual
per-bucket format. ``meta.pt`` records:

  * ``meta["plan"]``, ``meta["steps"]``, ``meta["param_groups"]``, ``meta["aliases"]``: the *joined*
    model, as a checkpoint of the unsplit model describes it: every pipeline rank's parameters in
    pipeline-rank order (global shapes), its buckets after the previous ranks' (slots re-indexed), each
    param group the union of the ranks' same group, its parameters in the unsplit model's
    ``named_parameters()`` order (``ShardEngine.model_order``; an interleaved rank holds blocks 0 and 2):
    the order a consolidated file numbers Adam's state in, as ``"ddp"`` loads it. What readers of whole
    parameters see (consolidation, ``load_full_state_dict``, the exports, ``verify``), and what a
    resume in another layout reads steps and hyper-parameters from by name;
  * ``meta["pipeline"]``: ``{"size": P, "stage_of": {name: p}, "stages": [pipeline rank p's own
    "plan", "steps", "param_groups" and, with tensor parallelism, its "tensor" layout]}``.

``model_extra.pt`` holds every pipeline rank's buffers and frozen parameters (gathered to global rank 0,
which writes it). Reading (:mod:`lightning_zero.checkpoint.reshard`):

  * **the same pipeline layout** (``P``, and this pipeline rank holding the same parameter names as
    the saved one): each pipeline rank reads its own files (:func:`own_stage`), on any data-parallel
    size, exactly as any checkpoint is read;
  * **another layout** (``P=2`` into ``P=1`` or the reverse, another cut of the layers): each
    parameter a rank holds is read whole from the pipeline rank that saved it (:func:`holding`), one at
    a time, as a tensor-parallel reshard does; Adam's moments and a weight average follow it.

Communication: saving gathers the pipeline ranks' plans over the pipeline group (and their buffers to
rank 0 of the group that holds global rank 0); loading gathers their parameter names (one small
all-gather), so that a name another rank holds is not "unexpected".
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_zero.checkpoint.tensor_layout import TENSOR
from lightning_zero.engine.engine import ShardEngine

PIPELINE = "pipeline"
"""Key of the pipeline layout in ``meta.pt`` (only in checkpoints of pipeline-parallel models)."""
STAGE = "pipeline_rank"
"""Key a :func:`stage_view` adds to ``meta``: the pipeline rank whose files it reads."""
_OWN = ("plan", "steps", "param_groups")
"""What each pipeline rank records of its own (beside its tensor-parallel layout)."""


def saved_size(meta: dict[str, Any]) -> int:
    """The pipeline size that wrote a checkpoint (1 for a checkpoint without one)."""
    return int(meta[PIPELINE]["size"]) if PIPELINE in meta else 1


def gather_extras(engine: ShardEngine, extras: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every pipeline rank's buffers and frozen parameters (``extras``, this rank's) on the ranks that
    write ``model_extra.pt`` (data-parallel and tensor-parallel rank 0 of the first pipeline rank: global
    rank 0); elsewhere ``extras`` as they are. Call on all ranks (one gather over every pipeline group,
    so that every rank issues the same collectives; only the group of global rank 0 sends tensors).

    Raises:
        ValueError: two pipeline ranks holding a tensor of the same name (named).
    """
    pipeline = engine.pipeline
    if pipeline is None:
        return extras
    tensor_rank = 0 if engine.tensor is None else engine.tensor.rank
    writes = engine.comm.rank == 0 and tensor_rank == 0  # the same on every rank of this pipeline group
    everyone = pipeline.gather_object(
        {k: v.detach().cpu() for k, v in extras.items()} if writes else {}, dst=0
    )
    if everyone is None or not writes:
        return extras
    joined: dict[str, torch.Tensor] = {}
    for p, held in enumerate(everyone):
        twice = sorted(set(joined) & set(held))
        if twice:
            raise ValueError(f"pipeline rank {p} holds buffers or frozen parameters another does: {twice}")
        joined.update(held)
    return joined


def record(engine: ShardEngine, meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` (this pipeline rank's, as :func:`~lightning_zero.checkpoint.format.stage_save` builds it)
    made the whole model's, given every pipeline rank's: see the module docstring. Call on all ranks
    (one all-gather over the pipeline group); ``meta`` itself without pipeline parallelism.

    Raises:
        ValueError: pipeline ranks whose optimizers have different numbers of param groups (named).
    """
    pipeline = engine.pipeline
    if pipeline is None:
        return meta
    own = {key: meta[key] for key in (*_OWN, "aliases", TENSOR) if key in meta}
    stages: list[dict[str, Any]] = pipeline.all_gather_object(own)
    counts = [len(s["param_groups"]) for s in stages]
    if len(set(counts)) > 1:
        raise ValueError(
            f"the pipeline ranks' optimizers have {counts} param groups (in pipeline-rank order): a "
            "checkpoint joins them group by group: configure_optimizers must give every stage the same groups"
        )
    params: list[dict[str, Any]] = []
    buckets: list[dict[str, Any]] = []
    groups = [{**g, "param_indices": []} for g in stages[0]["param_groups"]]
    for stage in stages:
        offset = len(params)
        params += stage["plan"]["params"]
        for bucket in stage["plan"]["buckets"]:
            buckets.append({**bucket, "slots": [[i + offset, at, n] for i, at, n in bucket["slots"]]})
        for group, own_group in zip(groups, stage["param_groups"], strict=True):
            group["param_indices"] += [i + offset if i >= 0 else i for i in own_group["param_indices"]]
    if engine.model_order is not None:  # each group in the unsplit model's order (interleaved stages)
        at = {name: k for k, name in enumerate(engine.model_order)}
        position = [at.get(p["name"], len(at)) for p in params]
        for group in groups:  # a frozen parameter (-1, not in the plan) keeps its place
            indices = group["param_indices"]
            planned = iter(sorted((i for i in indices if i >= 0), key=position.__getitem__))
            group["param_indices"] = [next(planned) if i >= 0 else i for i in indices]
    joined = {k: v for k, v in meta.items() if k != TENSOR}
    joined["plan"] = {**meta["plan"], "params": params, "buckets": buckets}
    joined["steps"] = torch.cat([s["steps"] for s in stages])
    joined["param_groups"] = groups
    joined["aliases"] = {k: v for s in stages for k, v in s.get("aliases", {}).items()}
    joined[PIPELINE] = {
        "size": pipeline.world_size,
        "stage_of": {p["name"]: s for s, stage in enumerate(stages) for p in stage["plan"]["params"]},
        "stages": [{k: v for k, v in s.items() if k != "aliases"} for s in stages],
    }
    return joined


def stage_view(meta: dict[str, Any], rank: int) -> dict[str, Any]:
    """``meta`` as pipeline rank ``rank``'s own checkpoint: its plan, steps, param groups, tensor-parallel
    layout and files. A checkpoint without pipeline parallelism is its own view at rank 0."""
    if PIPELINE not in meta:
        return meta
    stage = meta[PIPELINE]["stages"][rank]
    return {**meta, **stage, STAGE: rank}


def stage_views(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Every pipeline rank's :func:`stage_view`."""
    return [stage_view(meta, p) for p in range(saved_size(meta))]


def holding(meta: dict[str, Any], name: str) -> dict[str, Any]:
    """The :func:`stage_view` of the pipeline rank that saved parameter ``name`` (``meta`` itself
    without pipeline parallelism)."""
    if PIPELINE not in meta:
        return meta
    return stage_view(meta, int(meta[PIPELINE]["stage_of"][name]))


def own_stage(engine: ShardEngine, meta: dict[str, Any]) -> dict[str, Any] | None:
    """What this rank reads as its own checkpoint: ``meta`` (no pipeline parallelism saved or loading),
    the saved view of its own pipeline rank (the same ``P``, and the same parameter names), or ``None``:
    another pipeline layout, read parameter by parameter (:func:`holding`)."""
    pipeline = engine.pipeline
    if pipeline is None and PIPELINE not in meta:
        return meta
    if pipeline is None or saved_size(meta) != pipeline.world_size:
        return None
    view = stage_view(meta, pipeline.rank)
    names = {p["name"] for p in view["plan"]["params"]}
    return view if names == engine.trainable_names() else None


def held_elsewhere(engine: ShardEngine) -> set[str]:
    """The parameter names the other pipeline ranks hold (empty without pipeline parallelism). Call on
    all ranks (one all-gather of names over the pipeline group)."""
    pipeline = engine.pipeline
    if pipeline is None:
        return set()
    everyone = pipeline.all_gather_object(sorted(engine.trainable_names()))
    return {name for p, names in enumerate(everyone) if p != pipeline.rank for name in names}
