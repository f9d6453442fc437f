"""The pipeline layout of a checkpoint without a process group: two pipeline ranks' metas joined by name
(plans, buckets, steps and param groups re-indexed), each rank's view and files, which rank a name is
read from, and when a rank reads its own files (the same ``P`` and names) or whole parameters."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_zero.checkpoint.format import all_shard_names, saved_shard_name
from lightning_zero.checkpoint.pipeline_layout import holding, own_stage, record, stage_view


def _meta(names: list[str], steps: int) -> dict[str, Any]:
    """One pipeline rank's meta as stage_save builds it: its plan (one bucket), steps, one param group."""
    return {
        "world_size": 2,
        "plan": {
            "world_size": 2,
            "params": [{"name": n, "shape": [3], "dtype": "torch.float64"} for n in names],
            "buckets": [{"slots": [[i, 3 * i, 3] for i in range(len(names))], "numel": 3 * len(names)}],
        },
        "steps": torch.full((len(names),), steps),
        "param_groups": [{"lr": 0.1, "param_indices": list(range(len(names)))}],
        "aliases": {},
    }


class _Pipeline:
    """A pipeline group whose all-gather returns the given ranks' objects (this rank's replaced)."""

    def __init__(self, rank: int, objects: list[Any]) -> None:
        self.rank, self.world_size, self.objects = rank, len(objects), objects

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj if p == self.rank else o for p, o in enumerate(self.objects)]


STAGES = [["blocks.0.w", "blocks.1.w"], ["blocks.2.w"]]


def _engine(
    rank: int, names: list[str], pipeline: list[Any] | None, order: tuple[str, ...] | None = None
) -> Any:
    return SimpleNamespace(
        pipeline=None if pipeline is None else _Pipeline(rank, pipeline),
        trainable_names=lambda: set(names),
        model_order=order,
    )


def _joined() -> dict[str, Any]:
    metas = [_meta(STAGES[0], 4), _meta(STAGES[1], 4)]
    return record(_engine(1, STAGES[1], metas), metas[1])


def test_record_joins_the_pipeline_ranks_by_name() -> None:
    joined = _joined()
    assert [p["name"] for p in joined["plan"]["params"]] == STAGES[0] + STAGES[1]
    assert [b["slots"] for b in joined["plan"]["buckets"]] == [[[0, 0, 3], [1, 3, 3]], [[2, 0, 3]]]
    assert joined["param_groups"] == [{"lr": 0.1, "param_indices": [0, 1, 2]}]
    assert joined["steps"].tolist() == [4, 4, 4]
    assert joined["pipeline"]["stage_of"] == {"blocks.0.w": 0, "blocks.1.w": 0, "blocks.2.w": 1}


def test_each_param_group_is_numbered_in_the_unsplit_models_order() -> None:
    """Interleaved stages (rank 0: blocks 0 and 2, rank 1: blocks 1 and 3): the plan stays in
    pipeline-rank order, each group's indices follow the whole model's order; a frozen parameter of a
    group (-1, not in the plan) keeps its place."""
    held = [["blocks.0.w", "blocks.2.w"], ["blocks.1.w", "blocks.3.w"]]
    metas = [_meta(held[0], 4), _meta(held[1], 4)]
    metas[1]["param_groups"][0]["param_indices"] = [0, -1, 1]
    order = tuple(f"blocks.{i}.w" for i in range(4))
    joined = record(_engine(1, held[1], metas, order), metas[1])
    assert [p["name"] for p in joined["plan"]["params"]] == held[0] + held[1]
    assert joined["param_groups"][0]["param_indices"] == [0, 2, 1, -1, 3]
    unordered = record(_engine(1, held[1], metas), metas[1])  # no order known: pipeline-rank order
    assert unordered["param_groups"][0]["param_indices"] == [0, 1, 2, -1, 3]


def test_each_pipeline_rank_has_its_own_view_and_files() -> None:
    joined = _joined()
    view = stage_view(joined, 1)
    assert [p["name"] for p in view["plan"]["params"]] == STAGES[1]
    assert saved_shard_name(view, 1) == "shard-00001-of-00002-pipeline-01-of-02.pt"
    assert holding(joined, "blocks.1.w")["pipeline_rank"] == 0
    assert sorted(all_shard_names(joined)) == sorted(
        f"shard-0000{d}-of-00002-pipeline-0{p}-of-02.pt" for d in (0, 1) for p in (0, 1)
    )


@pytest.mark.parametrize(
    ("names", "ranks", "own"),
    [
        (STAGES[1], 2, True),  # the same pipeline layout: its own files
        (["blocks.1.w", "blocks.2.w"], 2, False),  # another cut of the layers
        (STAGES[0] + STAGES[1], None, False),  # no pipeline: whole parameters
    ],
)
def test_a_rank_reads_its_own_files_only_in_the_same_layout(
    names: list[str], ranks: int | None, own: bool
) -> None:
    engine = _engine(1, names, None if ranks is None else [None] * ranks)
    view = own_stage(engine, _joined())
    assert (view is not None) == own
    if own:
        assert view is not None and view["pipeline_rank"] == 1
