"""Tensor (and sequence) parallelism inside ZeRO: a model parallelized with torch's
``parallelize_module`` over the ``tensor`` dimension of a ``(data, tensor)`` mesh, its ``DTensor``
parameters sharded by ``ShardedAdamW`` over the ``data`` dimension, equals one unsplit copy trained by
``torch.optim.AdamW`` on the whole global batch (float64, accumulation 2, clipping 0.5), at every stage
(:mod:`lightning_zero.engine.tensor_parallel`). One launch of 4 ranks."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.harness import ranks, run_ranks_each
from tests.distributed.workers_tp import tp_checkpoints, tp_parity, tp_refusals

WORLD = 4
NAN = {"nan_step": 1, "skip": 2}  # rank 1's slice of up.weight's gradient is NaN at step 1
CASES = {
    "tp2xdp2-stage1": {"tensor": 2, "stage": 1, "accum": 2, "clip": 0.5},
    "tp2xdp2-stage2": {"tensor": 2, "stage": 2, "accum": 2, "clip": 0.5},
    "tp2xdp2-stage3": {"tensor": 2, "stage": 3, "accum": 2, "clip": 0.5},
    "tp4xdp1-stage2": {"tensor": 4, "stage": 2, "accum": 2, "clip": 0.5},
    # one tensor-parallel slice of one rank non-finite: every rank skips that step (the flags agree over
    # the tensor group too), through the guard's own all-reduce and riding on the used-parameter mask
    "tp2xdp2-stage2-nan": {"tensor": 2, "stage": 2, "accum": 2, "clip": 0.5, **NAN},
    "tp2xdp2-stage3-nan-unused": {"tensor": 2, "stage": 3, "accum": 2, "clip": None, "unused": True, **NAN},
    # reduce-scatters every micro-batch (the partial sums too), and a weight average on the shards
    "tp2xdp2-stage2-sharded-accumulation-ema": {
        **{"tensor": 2, "stage": 2, "accum": 3, "clip": 0.5, "sharded_accumulation": True, "ema": True}
    },
    "tp2xdp2-stage3-ema": {"tensor": 2, "stage": 3, "accum": 1, "clip": None, "ema": True},
    # the trainable set changes after step 1: new buckets over the slices, state carried over
    "tp2xdp2-stage2-freeze": {"tensor": 2, "stage": 2, "accum": 2, "clip": 0.5, "freeze_step": 1},
}
SEQUENCE_PARALLEL_NORMS = ["norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any] | RuntimeError]:
    root = str(tmp_path_factory.mktemp("tp-checkpoints"))
    calls = [(tp_parity, ([case],)) for case in CASES.values()]
    calls += [(tp_refusals, ()), (tp_checkpoints, (root,))]
    out = run_ranks_each(calls, WORLD)
    return dict(zip([*CASES, "refusals", "checkpoints"], out, strict=True))


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_equals_the_unsplit_model_in_float64(case: str, runs: dict) -> None:
    for rank, (result,) in enumerate(ranks(runs, case)):
        assert result["moved"] > 1e-2, "parameters barely moved: the test would be vacuous"
        assert result["dtensors"] == 11, "the plan left parameters unsplit: not a tensor-parallel test"
        assert max(result["max_diff"]) <= 1e-10, (rank, result["max_diff"])
        assert result["skipped"] == (1 if "nan_step" in CASES[case] else 0)
        assert result["param_norm_diff"] <= 1e-12  # per-parameter norms (lightning_zero.grad_norm)
        if CASES[case].get("ema"):  # the weight average on the shards equals AveragedModel's
            assert result["average_diff"] <= 1e-10, (rank, result["average_diff"])
        for norm, unsplit in result["norms"]:  # the clipping norm counts a replicated weight once
            assert norm == pytest.approx(unsplit, rel=1e-12, abs=0), (rank, result["norms"])


@pytest.mark.parametrize("case", list(CASES))
def test_sequence_parallel_norms_get_partial_gradients_summed_over_the_tensor_group(
    case: str, runs: dict
) -> None:
    """The norms' gradients arrive as ``Partial`` sums (the trap FSDP2 fixed in pytorch PR #136237);
    the engine sums them over the tensor group, and counts what it sends there."""
    frozen = ["norm1.bias"] if "freeze_step" in CASES[case] else []  # out of the plan since
    for (result,) in ranks(runs, case):
        assert result["partial"] == [n for n in SEQUENCE_PARALLEL_NORMS if n not in frozen]
        assert result["tensor_elements"] > 0


def test_checkpoints_resume_on_another_tensor_parallel_layout_as_the_unsplit_run(runs: dict) -> None:
    """A checkpoint saved at TP2 x DP2 resumes at TP1 x DP4 (slices joined), that one at TP2 x DP2 (cut
    into slices), that one on another bucket plan (each tensor rank its own files), each equal to the
    unsplit model trained without a break; the files alone give whole parameters and Adam moments
    (``load_full_state_dict``, ``consolidate``) and pass ``verify``."""
    for rank, result in enumerate(ranks(runs, "checkpoints")):
        assert set(result["diff"]) == {"A", "B", "C", "D"}
        assert max(result["diff"].values()) <= 1e-10, (rank, result["diff"])
        if rank == 0:
            assert max(result["whole"].values()) <= 1e-10, result["whole"]
            assert result["verify A"] == result["verify C"] == 0
            shards = [f for f in result["files A"] if f.startswith("shard-")]
            assert shards == [f"shard-0000{r}-of-00002-tensor-0{t}-of-02.pt" for r in (0, 1) for t in (0, 1)]
            assert [f for f in result["files C"] if f.startswith("shard-")] == shards


def test_what_does_not_compose_yet_is_refused_by_name(runs: dict) -> None:
    """Never a silent difference: the optimizer's torch-format state dict (it cannot tell the
    tensor-parallel slices apart), parameters that are not on a 1-D tensor-parallel mesh and a
    tensor-parallel group overlapping the data-parallel one raise, naming what to do."""
    for messages in ranks(runs, "refusals"):
        assert set(messages) == {
            "consolidate_state_dict",
            "load_state_dict",
            "2-D parameters",
            "overlapping groups",
        }
        assert messages["consolidate_state_dict"].startswith("NotImplementedError: consolidate_state_dict")
        assert messages["load_state_dict"].startswith("NotImplementedError: load_state_dict")
        assert "mesh['tensor']" in messages["2-D parameters"]
        assert "share ranks" in messages["overlapping groups"]


HYBRID = {  # 8 ranks: tensor 2 x (2 replica groups x 2 shard ranks), the layout of 2 nodes' data ranks
    "tp2-hybrid2x2-stage2": {"tensor": 2, "stage": 2, "accum": 2, "clip": 0.5, "shard_group_size": 2},
    "tp2-hybrid2x2-stage3": {"tensor": 2, "stage": 3, "accum": 2, "clip": 0.5, "shard_group_size": 2},
}


@pytest.fixture(scope="module")
def hybrid_runs() -> dict[str, list[Any] | RuntimeError]:
    out = run_ranks_each([(tp_parity, ([case],)) for case in HYBRID.values()], 8)
    return dict(zip(HYBRID, out, strict=True))


@pytest.mark.parametrize("case", list(HYBRID))
def test_node_aware_sharding_beside_tensor_parallelism_equals_the_unsplit_model(
    case: str, hybrid_runs: dict
) -> None:
    """``comm.tensor_groups``: shard groups and replicas of each tensor rank's data-parallel ranks; the
    partial sums over the tensor group come before the reduction inside the shard group and the
    all-reduce across the replicas."""
    for rank, (result,) in enumerate(ranks(hybrid_runs, case)):
        assert result["moved"] > 1e-2
        assert max(result["max_diff"]) <= 1e-10, (rank, result["max_diff"])
        assert result["param_norm_diff"] <= 1e-12
        assert result["partial"] == SEQUENCE_PARALLEL_NORMS
