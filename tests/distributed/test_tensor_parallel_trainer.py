"""``Trainer(strategy=ZeroStrategy(tensor_parallel_size=2))`` on 4 CPU ranks runs a LightningModule
written for Lightning's ``ModelParallelStrategy`` (``configure_model`` calls ``parallelize_module`` on
``self.device_mesh["tensor_parallel"]``) and equals that strategy (FSDP2 over the data-parallel mesh,
the peer) and one unsplit model under torch AdamW on the same global batches, in float64 with
accumulation 2 and clipping 0.5, at every stage. One launch."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.tp_fit import ACCUM, BATCH, CLIP, LR, STEPS, VOCAB, dataset
from tests.distributed.workers_tp import SequenceBlock
from tests.launch import launch_env, run_script

ROOT = Path(__file__).resolve().parents[2]
CASES = [
    {"name": "model_parallel", "strategy": "model_parallel"},
    {"name": "zero1", "strategy": "zero", "stage": 1},
    {"name": "zero2", "strategy": "zero", "stage": 2},
    {"name": "zero3", "strategy": "zero", "stage": 3},
    # node-aware beside tensor parallelism: the 2 data-parallel ranks of each tensor rank as 2 replicas
    # of a shard group of 1 (each replica holds the whole slice, the gradients all-reduced across)
    {"name": "zero2_hybrid", "strategy": "zero", "stage": 2, "shard_group_size": 1},
    {"name": "fabric2", "strategy": "fabric", "stage": 2},
    {"name": "fabric3", "strategy": "fabric", "stage": 3, "deferred": True},  # built on the meta device
    # saved by a stage-2 fit at step 2, resumed at stage 3 to step 3
    {"name": "resume", "strategy": "resume", "stage": 3},
    # built on the meta device (init_module(empty_init=True)), parallelized there in configure_model
    {"name": "deferred2", "strategy": "zero", "stage": 2, "deferred": True},
    {"name": "deferred3", "strategy": "zero", "stage": 3, "deferred": True},
]
DATA = 2  # data-parallel ranks: 4 ranks, tensor-parallel groups of 2


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("tp_fit") / "result.pt"
    command = [sys.executable, "-m", "tests.distributed.tp_fit", "--out", str(out)]
    command += ["--cases", json.dumps(CASES)]
    proc = run_script(command, 4, cwd=ROOT, env=launch_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out, weights_only=True)


def unsplit(seen: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """One process, the whole model, torch AdamW; global batch ``i`` is every data-parallel rank's batch
    ``i`` (``seen``: the samples each data-parallel rank trained on, in order)."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = SequenceBlock()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        tokens, targets, _ = dataset().tensors
        for step in range(STEPS):
            for micro in range(ACCUM):
                i = (step * ACCUM + micro) * BATCH
                batch = torch.cat([samples[i : i + BATCH] for samples in seen])
                logits = model(tokens[batch])
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets[batch].reshape(-1))
                (loss / ACCUM).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        torch.set_default_dtype(torch.float32)


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "zero2_hybrid", "fabric2", "fabric3", "resume"])
def test_every_stage_equals_model_parallel_strategy_and_the_unsplit_model(name: str, launched: dict) -> None:
    """Each run against the unsplit model on the batches it saw; the Trainer's against the peer too
    (a Fabric loop's sampler deals the samples in another order than the Trainer's)."""
    results = launched["results"]
    for run in ("model_parallel", name):
        data_ranks = [launched["seen"][rank][run] for rank in (0, 2)]  # tensor groups: ranks 0, 1 and 2, 3
        moved = _diff(results[run]["params"], {n: p for n, p in SequenceBlock().named_parameters()})
        assert moved > 1e-2, "parameters barely moved: the test would be vacuous"
        assert _diff(results[run]["params"], unsplit(data_ranks)) <= 1e-10, run
    if name not in ("fabric2", "fabric3", "resume"):
        assert _diff(results[name]["params"], results["model_parallel"]["params"]) <= 1e-10
        assert results[name]["layout"] == ("2x1" if name.endswith("hybrid") else "1x2")


def test_the_ranks_of_a_tensor_parallel_group_see_the_same_batches(launched: dict) -> None:
    """The sampler follows the data-parallel rank (ranks 0, 1 and ranks 2, 3 form tensor groups)."""
    for name in ("zero1", "zero2", "zero3", "zero2_hybrid", "model_parallel", "fabric2", "fabric3"):
        seen = [rank[name] for rank in launched["seen"]]
        assert torch.equal(seen[0], seen[1]) and torch.equal(seen[2], seen[3]), name
        assert not torch.equal(seen[0], seen[2]), name


def test_a_sharded_checkpoint_resumes_the_fit_and_loads_for_validation(launched: dict) -> None:
    """ModelCheckpoint saves a tensor-parallel fit (stage 2, step 2) as a sharded directory with each
    tensor rank's files; a stage-3 fit resumed from it to step 3 equals the unsplit model on the
    batches both fits saw (the parametrized test above), and ``validate(ckpt_path=...)`` of a zeroed
    module loads the step-2 weights exactly (each rank cuts its slices from the whole tensors); Fabric's
    save and load round-trip at stages 2 and 3."""
    result = launched["results"]["resume"]
    assert result["loaded_diff"] == 0.0
    for fabric in ("fabric2", "fabric3"):  # fabric.save, then fabric.load into the zeroed model
        assert launched["results"][fabric]["loaded_diff"] == 0.0
    assert Path(result["path"], "shard-00001-of-00002-tensor-01-of-02.pt").is_file()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_model_built_on_the_meta_device_trains_as_one_built_with_values(stage: int, launched: dict) -> None:
    """Under ``init_module(empty_init=True)`` the plan parallelizes meta tensors; each rank draws every
    parameter whole, as the eager build does, and keeps its slice: the fit is bit-identical."""
    results = launched["results"]
    assert _diff(results[f"deferred{stage}"]["params"], results[f"zero{stage}"]["params"]) == 0.0
