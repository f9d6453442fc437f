"""``Trainer(strategy=ZeroStrategy(pipeline_parallel_size=P))`` on 4 CPU ranks: a LightningModule that
gives its layers (``pipeline_layers()``) and its loss (``pipeline_loss``) trains, validates and predicts
through torch's schedules, and equals one unsplit model under torch AdamW on the same global batches
(float64, accumulation 2, clipping 0.5) at every ZeRO stage and schedule; each rank holds only its
stage's parameters; the settings a pipeline cannot run are refused by name; a step profile splits the
schedule's time into the stages' own work and their idle time. One launch
(``tests/distributed/pp_fit.py``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.pp_fit import (
    ACCUM,
    BATCH,
    CLIP,
    LAYERS,
    LR,
    STEPS,
    WIDTH,
    PipelineModule,
    TensorParallelBlocks,
    dataset,
)
from tests.launch import launch_env, run_script

ROOT = Path(__file__).resolve().parents[2]
WORLD = 4
FITS = [
    {"name": "stage1-1f1b", "stage": 1},
    {"name": "stage2-1f1b", "stage": 2, "evaluate": True},
    {"name": "stage3-1f1b", "stage": 3, "evaluate": True},
    {"name": "stage2-gpipe", "stage": 2, "schedule": "gpipe", "profile": True},  # profile_steps=(1, 2)
    {"name": "stage3-gpipe", "stage": 3, "schedule": "gpipe"},
    # a step per batch: torch's shape inference runs in the first step's syncing backward, not in no_sync
    {"name": "stage3-1f1b-accum1", "stage": 3, "accum": 1},
    # two stages per rank: blocks 0 and 2 on the first pipeline rank, 1 and 3 on the second
    {"name": "stage2-interleaved", "stage": 2, "schedule": "interleaved_1f1b", "virtual": 2},
    # tensor parallelism inside each stage (configure_model on the "tensor_parallel" mesh dimension)
    {"name": "pp2xtp2-stage3-1f1b", "stage": 3, "tensor": 2},
    # built on the meta device (init_module(empty_init=True)): each rank initializes only its stage's
    # blocks, to the values of the whole model's eager build
    {"name": "deferred-stage2-1f1b", "stage": 2, "deferred": True},
    {"name": "deferred-stage3-gpipe", "stage": 3, "schedule": "gpipe", "deferred": True},
    # four stages, one data-parallel rank each; 5 blocks: the first stage takes two
    {"name": "pp4-stage2-1f1b", "stage": 2, "pipeline": 4, "layers": 5, "evaluate": True},
    # pipeline_layers() of groups of modules: blocks 0-2 on the first stage, 3 on the second
    {"name": "stage2-grouped", "stage": 2, "grouped": True},
    # Lightning's EMAWeightAveraging: the average kept on each stage's shards, the model's at the end
    {"name": "stage3-1f1b-ema", "stage": 3, "ema": 0.5},
]
WIRED = [  # int8 reduce-scatters (and at stage 3 gathers) inside each stage: near the exact run, not equal
    {"name": "stage2-int8", "stage": 2, "wire": "int8"},
    {"name": "stage3-int8", "stage": 3, "schedule": "gpipe", "wire": "int8"},
]
REFUSALS = {
    "manual": "manual optimization",
    "stray": "parameters outside every pipeline layer: ['scale']",
    "tied": "'blocks.0.0.weight' is used by layers of pipeline stages 0 and 1",
    "batch": "a batch of 4 samples cannot be cut into pipeline_microbatches=3",
}
CASES = FITS + WIRED + [{"name": f"refuse-{n}", "refuse": n} for n in REFUSALS]


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("pp_fit") / "result.pt"
    command = [
        sys.executable,
        "-m",
        "tests.distributed.pp_fit",
        "--out",
        str(out),
        "--cases",
        json.dumps(CASES),
    ]
    proc = run_script(command, WORLD, cwd=ROOT, env=launch_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out, weights_only=False)


def _layout(case: dict[str, Any]) -> tuple[int, int]:
    """Pipeline and data-parallel ranks (rank ``(p * D + d) * T + t``)."""
    pipeline = case.get("pipeline", 2)
    return pipeline, WORLD // (pipeline * case.get("tensor", 1))


def _data_rank(rank: int, case: dict[str, Any]) -> int:
    return (rank // case.get("tensor", 1)) % _layout(case)[1]


def _model(case: dict[str, Any]) -> PipelineModule:
    kind = TensorParallelBlocks if case.get("tensor", 1) > 1 else PipelineModule
    return kind(layers=case.get("layers", LAYERS))


def unsplit(case: dict[str, Any], seen: list[torch.Tensor]) -> tuple[PipelineModule, list[list[float]]]:
    """One process, the whole model, torch AdamW; batch ``i`` of data-parallel rank ``d`` is
    ``seen[d][i]`` (the samples that rank trained on). The losses of each data-parallel rank's batches."""
    torch.set_default_dtype(torch.float64)
    try:
        model = _model(case)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        inputs, targets, _ = dataset().tensors
        losses: list[list[float]] = [[] for _ in seen]
        average: list[torch.Tensor] = []  # EMAWeightAveraging: after every optimizer step, the first a copy
        accum = case.get("accum", ACCUM)
        for window in range(len(seen[0]) // accum):
            for micro in range(accum):
                for d, samples in enumerate(seen):
                    rows = samples[window * accum + micro]
                    loss = F.mse_loss(model(inputs[rows]), targets[rows])
                    losses[d].append(float(loss))
                    (loss / (accum * len(seen))).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            if "ema" in case:
                decay, now = case["ema"], [p.detach().clone() for p in model.parameters()]
                pairs = zip(average, now, strict=True)
                average = [decay * a + (1 - decay) * p for a, p in pairs] if average else now
        with torch.no_grad():  # at the end of the fit the average becomes the model's weights
            for param, averaged in zip(model.parameters(), average, strict=False):
                param.copy_(averaged)
        return model, losses
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("case", FITS, ids=[c["name"] for c in FITS])
def test_the_pipelined_fit_equals_the_unsplit_model(case: dict[str, Any], launched: list[dict]) -> None:
    pipeline, data = _layout(case)
    results = [everyone[case["name"]] for everyone in launched]
    tensor = case.get("tensor", 1)
    seen = [results[d * tensor]["seen"] for d in range(data)]  # the first stage's data-parallel ranks
    for rank, result in enumerate(results):  # every stage and tensor rank of a data rank: the same samples
        assert torch.equal(result["seen"], seen[_data_rank(rank, case)])
    model, losses = unsplit(case, seen)
    whole = dict(model.named_parameters())
    initial = _model(case).state_dict()
    moved = max(float((p - initial[n]).abs().max()) for n, p in whole.items())
    assert moved > 1e-2, "parameters barely moved: the comparison would be vacuous"
    held: dict[str, int] = {}
    for rank, result in enumerate(results):
        for name, param in result["params"].items():
            assert float((param - whole[name].detach()).abs().max()) <= 1e-10, (rank, name)
            held[name] = held.get(name, 0) + 1
        # the strategy's loss: the last stage's, on every rank of the pipeline, per data-parallel rank;
        # Lightning hands on_train_batch_end the loss divided by accumulate_grad_batches, as under "ddp"
        expected = [loss / case.get("accum", ACCUM) for loss in losses[_data_rank(rank, case)]]
        assert result["losses"] == pytest.approx(expected, rel=1e-10, abs=0)
    assert held == {name: data * tensor for name in whole}, (
        "every parameter on exactly one stage's data-parallel (and tensor-parallel) ranks"
    )


def test_each_rank_holds_only_its_stages_parameters(launched: list[dict]) -> None:
    """No rank holds another stage's parameters: the module's own and the engine's bucket plan, 2 of
    the 4 blocks on each rank of a 2-stage pipeline, 2-1-1-1 of 5 blocks over 4 stages, 3-1 of 4
    blocks cut as three layers (the first a group of two blocks' modules)."""
    block = WIDTH * WIDTH + WIDTH
    for name, counts in (
        ("stage2-1f1b", [2, 2, 2, 2]),
        ("pp4-stage2-1f1b", [2, 1, 1, 1]),
        ("stage2-grouped", [3, 3, 1, 1]),
    ):
        results = [everyone[name] for everyone in launched]
        assert [sum(p.numel() for p in r["params"].values()) for r in results] == [c * block for c in counts]
        assert [r["engine_numel"] for r in results] == [c * block for c in counts]


@pytest.mark.parametrize("name", ["stage2-1f1b", "stage3-1f1b", "pp4-stage2-1f1b"])
def test_validation_and_predict_run_through_the_pipeline(name: str, launched: list[dict]) -> None:
    case = next(c for c in FITS if c["name"] == name)
    pipeline, data = _layout(case)
    results = [everyone[name] for everyone in launched]
    model, _ = unsplit(case, [results[d]["seen"] for d in range(data)])
    held = dataset(seed=8)
    inputs, targets, _ = held.tensors
    with torch.no_grad():
        outputs = model(inputs)
    for rank, result in enumerate(results):
        d = rank % data
        mine = torch.arange(len(inputs))[d::data]  # Lightning's sampler for validation: no shuffle
        rows = list(mine.split(BATCH))
        expected = [float(F.mse_loss(outputs[r], targets[r])) for r in rows]
        assert result["val_losses"] == pytest.approx(expected, rel=1e-10, abs=0), rank
        torch.set_default_dtype(torch.float64)  # validated before the fit too: the initial weights
        try:
            start = _model(case)
        finally:
            torch.set_default_dtype(torch.float32)
        with torch.no_grad():
            first = [float(F.mse_loss(start(inputs[r]), targets[r])) for r in rows]
        assert result["val_before"] == pytest.approx(first, rel=1e-10, abs=0), rank
        last = rank // data == pipeline - 1
        if last:  # the last stage's outputs; None on the other stages
            assert torch.allclose(result["predictions"], outputs[torch.cat(rows)], rtol=0, atol=1e-12)
        else:
            assert result["predictions"] is None


@pytest.mark.parametrize("case", WIRED, ids=[c["name"] for c in WIRED])
def test_an_int8_wire_inside_the_stages_stays_near_the_exact_unsplit_run(
    case: dict[str, Any], launched: list[dict]
) -> None:
    """Each stage's data-parallel reduction (and at stage 3 its gathers) quantized: every parameter
    within 5 % of the exact unsplit run's movement of it, and not equal to it (the wire was int8)."""
    _, data = _layout(case)
    results = [everyone[case["name"]] for everyone in launched]
    model, _ = unsplit(case, [results[d]["seen"] for d in range(data)])
    whole, initial = dict(model.named_parameters()), _model(case).state_dict()
    worst = 0.0
    for result in results:
        for name, param in result["params"].items():
            moved = float((whole[name].detach() - initial[name]).abs().max())
            off = float((param - whole[name].detach()).abs().max())
            assert off <= 0.05 * moved, (name, off, moved)  # 0.017 measured
            worst = max(worst, off)
    assert worst > 0, "equal to the exact run: the wire was not int8"


@pytest.mark.parametrize("name", list(REFUSALS))
def test_what_a_pipeline_cannot_run_is_refused_by_name(name: str, launched: list[dict]) -> None:
    for everyone in launched:
        assert REFUSALS[name] in everyone[f"refuse-{name}"]


@pytest.mark.parametrize("name", ["stage2-1f1b", "stage3-1f1b", "stage3-gpipe", "stage3-1f1b-accum1"])
def test_one_reduction_and_at_stage_3_one_gather_per_step_whatever_the_microbatches(
    name: str, launched: list[dict]
) -> None:
    """Per optimizer step (2 batches of 4 micro-batches each, or 1 batch): one reduce-scatter and one
    all-gather of every bucket over the stage's 2 data-parallel ranks, each sending half: the padded size
    in all. At stage 3 the units gathered in a step stay so until the optimizer step (a gather per
    micro-batch's forward and backward would send 8 to 16 times as much), and torch's shape-inference
    backward of the first step (input gradients only) sends nothing (it sent a round of zeros when it
    fell outside no_sync: with a step per batch)."""
    for everyone in launched:
        result = everyone[name]
        assert result["sent"] == STEPS * result["padded"], (result["sent"], result["padded"])


def test_a_profiled_pipeline_step_splits_the_schedule_into_work_and_idle_time(
    launched: list[dict[str, Any]],
) -> None:
    """Each rank's profiled steps run the schedule in place of a forward and a backward; of its time, the
    stage was idle a part (the bubble: GPipe at P=2, M=4 leaves (P-1)/(M+P-1) = 20 % idle in theory;
    here 4 ranks share 2 cores, so only the bounds are checked): more than nothing and less than the
    whole schedule. The host's time in our code is counted too."""
    for rank, results in enumerate(launched):
        report = results["stage2-gpipe"]["profile"]
        assert report["pipeline"] and report["steps"] == [1, 2]
        assert report["world_size"] == 2  # this rank's stage's data-parallel ranks
        mine = next(r for r in report["ranks"] if r["rank"] == rank)
        for step in mine["steps"]:
            assert step["forward_s"] == step["backward_s"] == 0.0, step
            assert 0 < step["pipeline_idle_s"] < step["pipeline_s"], step
            assert 0 < step["host_s"] < step["step_s"] - step["comm_exposed_s"], step
