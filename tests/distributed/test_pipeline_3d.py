"""3-D parallelism: pipeline x tensor x data, ``PP 2 x TP 2 x DP 2`` on 8 ranks. The model's layers cut
into 2 stages over the ``pipeline`` dimension of a ``(pipeline, data, tensor)`` mesh, each stage's
linear layers column- then row-parallel over ``tensor``, each rank's slices sharded by
``ShardedAdamW`` over ``data``, torch's schedules driving it (:mod:`lightning_zero.comm.pipeline`),
equals one unsplit copy trained by ``torch.optim.AdamW`` on the whole global batch in one process
(float64, 2 pipeline steps of 4 micro-batches accumulated per optimizer step, clipped to 0.1), at ZeRO
stages 2 and 3 under GPipe and 1F1B. One launch of 8 ranks.

Each rank also holds only its stage's slice of the model, and reduces its gradients once per
optimizer step, not per micro-batch (unless ``sharded_accumulation`` is asked for)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.harness import ranks, run_ranks_each
from tests.distributed.workers_pp import LAYERS, WIDTH, pp_parity

WORLD, PIPELINE, TENSOR, DATA = 8, 2, 2, 2
MICROBATCHES, ACCUM, STEPS, CLIP = 4, 2, 3, 0.1
BASE = {"pipeline": PIPELINE, "tensor": TENSOR, "microbatches": MICROBATCHES, "accum": ACCUM, "clip": CLIP}
CASES = {
    "pp2xtp2xdp2-gpipe-stage2": {**BASE, "schedule": "gpipe", "stage": 2},
    "pp2xtp2xdp2-1f1b-stage2": {**BASE, "schedule": "1f1b", "stage": 2},
    "pp2xtp2xdp2-1f1b-stage3": {**BASE, "schedule": "1f1b", "stage": 3},
    # every backward reduce-scattered into the shard (FSDP2's way), asked for
    "pp2xtp2xdp2-gpipe-stage3-sharded-accumulation": {
        **{**BASE, "schedule": "gpipe", "stage": 3, "sharded_accumulation": True}
    },
}
LINEAR_NUMEL = WIDTH * WIDTH + WIDTH
STAGE_NUMEL = LAYERS // PIPELINE * LINEAR_NUMEL
"""A stage's part of the model: half its linear layers."""
PAIR_SLICE_NUMEL = 2 * WIDTH * WIDTH // TENSOR + WIDTH // TENSOR + WIDTH
"""One rank's slice of a column- then row-parallel pair: both weights split, the column-parallel
bias split, the row-parallel bias whole (added after the row-parallel sum)."""


@pytest.fixture(scope="module")
def runs() -> dict[str, list[Any] | RuntimeError]:
    out = run_ranks_each([(pp_parity, ([case],)) for case in CASES.values()], WORLD)
    return dict(zip(CASES, out, strict=True))


@pytest.mark.parametrize("case", list(CASES))
def test_pp2_tp2_dp2_equals_the_unsplit_model_in_float64(case: str, runs: dict) -> None:
    results = [result for (result,) in ranks(runs, case)]
    for rank, result in enumerate(results):
        assert result["moved"] > 1e-2, "parameters barely moved: the test would be vacuous"
        assert max(result["max_diff"]) <= 1e-10, (rank, result["max_diff"])
        assert len(result["norms"]) == STEPS
        for norm, unsplit in result["norms"]:  # clipping by the whole model's norm, on every rank
            assert norm == pytest.approx(unsplit, rel=1e-12, abs=0), (rank, result["norms"])
        assert max(norm for norm, _ in result["norms"]) > CLIP, (
            "nothing clipped: the clipping would be vacuous"
        )
        assert result["dtensors"] == 8  # every weight and bias of the stage is a DTensor
    # the last stage's ranks (4-7) computed the loss; every data rank of it the same mean loss
    assert all(not r["losses"] for r in results[:4]) and all(
        len(r["losses"]) == STEPS * ACCUM for r in results[4:]
    )


@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_holds_only_its_stages_slice(case: str, runs: dict) -> None:
    """Pipeline: a stage's layers only (half the model); tensor: its slice of them; data: ZeRO's
    ``1/DATA`` of that slice as its shard."""
    for rank, (result,) in enumerate(ranks(runs, case)):
        assert result["numel"] == STAGE_NUMEL, rank
        assert result["held_numel"] == LAYERS // PIPELINE // 2 * PAIR_SLICE_NUMEL, rank
        assert result["planned_numel"] == result["held_numel"], rank
        assert result["shard_numel"] * DATA == result["padded"] == result["held_numel"], rank


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_are_reduced_once_per_optimizer_step(case: str, runs: dict) -> None:
    """Every micro-batch's backward but the last runs under ``no_sync`` (and the first pipeline step
    under the caller's): one reduce-scatter per bucket and optimizer step, whatever its ``ACCUM x
    MICROBATCHES`` backwards, at stage 3 too (``sharded_accumulation`` resolves to False under a
    pipeline); with it asked for, one per backward. Elements sent: one reduce-scatter and one
    all-gather of every bucket per step (at stage 3 a unit gathered once per step), the padded size
    in all for 2 ranks. The first step is left out of the count: on the last stage torch's schedule
    runs a backward of its own to learn the gradients' shapes, which sharded accumulation reduces."""
    sharded = CASES[case].get("sharded_accumulation") is True
    for rank, (result,) in enumerate(ranks(runs, case)):
        per_step = result["buckets"] * (ACCUM * MICROBATCHES if sharded else 1)
        assert result["reductions"][1:] == [per_step] * (STEPS - 1), (rank, result["reductions"])
        if not sharded:
            assert result["reductions"][0] == per_step, (rank, result["reductions"])
            assert result["sent_per_step"] == result["padded"], rank
