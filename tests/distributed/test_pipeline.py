"""Pipeline parallelism inside ZeRO: a model cut into stages over the ``pipeline`` dimension of a
``(pipeline, data)`` mesh, torch's schedules streaming micro-batches through them
(:mod:`lightning_zero.comm.pipeline`), each stage's parameters sharded by ``ShardedAdamW`` over the
``data`` dimension, equals one unsplit copy trained by ``torch.optim.AdamW`` on the whole global batch
(float64, accumulation 2, clipped to 0.1: the first steps' norms are near 0.3), at every stage. One
launch of 4 ranks."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.harness import ranks, run_ranks_each
from tests.distributed.workers_pp import pp_parity

WORLD = 4
CLIP = 0.1
BASE = {"pipeline": 2, "microbatches": 4, "accum": 2, "clip": CLIP}
CASES = {
    "pp2xdp2-gpipe-stage1": {**BASE, "schedule": "gpipe", "stage": 1},
    "pp2xdp2-gpipe-stage2": {**BASE, "schedule": "gpipe", "stage": 2},
    "pp2xdp2-gpipe-stage3": {**BASE, "schedule": "gpipe", "stage": 3},
    "pp2xdp2-1f1b-stage1": {**BASE, "schedule": "1f1b", "stage": 1},
    "pp2xdp2-1f1b-stage2": {**BASE, "schedule": "1f1b", "stage": 2},
    "pp2xdp2-1f1b-stage3": {**BASE, "schedule": "1f1b", "stage": 3},
    # two chunks per rank: stages 0 and 2 on the first pipeline rank, 1 and 3 on the second
    "pp2xdp2-interleaved-stage2": {**BASE, "schedule": "interleaved_1f1b", "stage": 2, "virtual": 2},
    "pp4xdp1-1f1b-stage2": {**BASE, "pipeline": 4, "schedule": "1f1b", "stage": 2},
    # fewer micro-batches than stages
    "pp4xdp1-gpipe-one-microbatch": {
        **BASE,
        "pipeline": 4,
        "schedule": "gpipe",
        "stage": 2,
        "microbatches": 1,
    },
    # tensor parallelism inside each stage (column- then row-parallel pairs): PP 2 x TP 2
    "pp2xtp2-1f1b-stage2": {**BASE, "schedule": "1f1b", "stage": 2, "tensor": 2},
    "pp2xtp2-gpipe-stage3": {**BASE, "schedule": "gpipe", "stage": 3, "tensor": 2},
    # one rank's NaN gradient on the last stage: every stage skips that step
    "pp2xdp2-1f1b-stage2-nan": {**BASE, "schedule": "1f1b", "stage": 2, "nan_step": 1, "skip": 2},
}


@pytest.fixture(scope="module")
def runs() -> dict[str, list[Any] | RuntimeError]:
    out = run_ranks_each([(pp_parity, ([case],)) for case in CASES.values()], WORLD)
    return dict(zip(CASES, out, strict=True))


@pytest.mark.parametrize("case", list(CASES))
def test_every_stage_of_the_pipeline_equals_the_unsplit_model_in_float64(case: str, runs: dict) -> None:
    settings = CASES[case]
    for rank, (result,) in enumerate(ranks(runs, case)):
        assert result["moved"] > 1e-2, "parameters barely moved: the test would be vacuous"
        assert max(result["max_diff"]) <= 1e-10, (rank, result["max_diff"])
        assert result["skipped"] == (1 if "nan_step" in settings else 0)
        for norm, unsplit in result["norms"]:  # clipping by the whole model's norm, on every stage
            assert norm == pytest.approx(unsplit, rel=1e-12, abs=0), (rank, result["norms"])
        assert len(result["norms"]) == 3 - ("nan_step" in settings)
        assert max(norm for norm, _ in result["norms"]) > CLIP, (
            "nothing clipped: the clipping would be vacuous"
        )
        assert result["dtensors"] == (8 if "tensor" in settings else 0)  # every weight and bias split


@pytest.mark.parametrize("case", [f"pp2xdp2-{s}-stage2" for s in ("gpipe", "1f1b", "interleaved")])
def test_gradients_are_reduced_once_per_step_not_per_microbatch(case: str, runs: dict) -> None:
    """Every micro-batch's backward but the last runs under ``no_sync``: per optimizer step one
    reduce-scatter and one all-gather of each bucket (half of it sent by each of 2 ranks: the padded
    size in all), whatever the 2 x 4 micro-batches."""
    for (result,) in ranks(runs, case):
        assert result["sent_per_step"] == result["padded"]


def test_each_rank_holds_only_its_stages_parameters(runs: dict) -> None:
    """The stages of a pipeline hold disjoint parts of the model: 2 stages, each half the layers."""
    results = [result for (result,) in ranks(runs, "pp2xdp2-1f1b-stage2")]
    layer = 8 * 8 + 8
    assert [r["numel"] for r in results] == [4 * layer] * 4
