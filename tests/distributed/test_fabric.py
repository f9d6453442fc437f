"""``Fabric(strategy="zero")``: the same Fabric loop under "ddp" is the expected value (float64,
<= 1e-10), checkpoints reload on 1, 2 and 3 ranks and across stages, Fabric and Trainer read each
other's checkpoints, and the refusals match the Trainer strategy's.

The loops run in ``tests/distributed/fabric_loop.py`` launches (one per world size, many cases each).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero.checkpoint import read_meta, verify_files
from tests.launch import launch_env, run_script

ROOT = Path(__file__).resolve().parents[2]
BASE = {"steps": 8, "accum": 2, "clip": 0.05}  # warmup + cosine schedule, two param groups


def launch(
    cases: list[dict[str, Any]], devices: int, tmp_path: Path, launcher: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """Run the cases in one launch of ``devices`` processes (Lightning's launcher, or ``launcher``)."""
    out = tmp_path / f"result-{devices}.pt"
    env = launch_env()
    command = [*(launcher or [sys.executable]), "-m", "tests.distributed.fabric_loop", "--out", str(out)]
    command += ["--devices", str(devices), "--cases", json.dumps(cases)]
    proc = run_script(command, 1 if launcher else devices, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out, weights_only=False)


def diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    keys = [k for k in a if isinstance(a[k], torch.Tensor)]
    assert keys and keys == [k for k in b if isinstance(b[k], torch.Tensor)]
    return max((a[k].double() - b[k].double()).abs().max().item() for k in keys)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every launch of this module, once: 2 ranks, then resumes on 1 and 3 ranks."""
    tmp = tmp_path_factory.mktemp("fabric")
    paths = {
        k: str(tmp / k)
        for k in ("loop.ckpt", "loop3.ckpt", "plain.ckpt", "trainer.ckpt", "consolidated.pt", "bf16.pt")
    }
    plain = {"steps": 8, "schedule": False}  # the Trainer twin has no schedule
    named: dict[str, dict[str, Any]] = {
        "ddp": dict(BASE, strategy="ddp"),
        "zero": dict(BASE, strategy="zero"),
        "zero1": dict(BASE, strategy="zero1"),
        "zero3": dict(BASE, strategy="zero3", save_at=4, save=paths["loop3.ckpt"]),
        "zero_from_zero3": dict(BASE, strategy="zero", resume=paths["loop3.ckpt"]),
        "overlap": dict(BASE, strategy="zero", overlap_param_gather=True),
        "registered": dict(BASE, strategy="zero1", by_name=True, teacher=True),
        "ddp_value": {"strategy": "ddp", "clip_value": 0.01},
        "zero_value": {"strategy": "zero", "clip_value": 0.01},
        "saving": dict(
            BASE, strategy="zero", save_at=4, save=paths["loop.ckpt"], consolidate=paths["consolidated.pt"]
        ),
        "resumed": dict(BASE, strategy="zero", resume=paths["loop.ckpt"]),
        "resumed_zero1": dict(BASE, strategy="zero1", resume=paths["loop.ckpt"]),
        "load_raw": dict(BASE, strategy="zero", load_raw=paths["consolidated.pt"]),
        "ddp_loads_consolidated": dict(BASE, strategy="ddp", resume=paths["consolidated.pt"]),
        "plain": dict(plain, strategy="zero", save_at=4, save=paths["plain.ckpt"]),
        "trainer_from_fabric": {"trainer": True, "steps": 4, "offset": 4, "resume": paths["plain.ckpt"]},
        "trainer_start": {"trainer": True, "steps": 4, "save": paths["trainer.ckpt"]},
        "fabric_from_trainer": dict(plain, strategy="zero", resume_trainer=paths["trainer.ckpt"]),
        "fp16_ddp": {"strategy": "ddp", "precision": "16-mixed-cpu", "inf_at_step": 3},
        "fp16_zero": {"strategy": "zero", "precision": "16-mixed-cpu", "inf_at_step": 3},
        "bf16_ddp": {"strategy": "ddp", "precision": "bf16-mixed", "accum": 2},
        "bf16_zero": {"strategy": "zero", "precision": "bf16-mixed", "accum": 2},
        "bf16_true_ddp": {"strategy": "ddp", "precision": "bf16-true"},
        "bf16_true_zero": {"strategy": "zero", "precision": "bf16-true"},
        "bf16_true_zero3": {"strategy": "zero3", "precision": "bf16-true"},
        "bn_ddp": {"strategy": "ddp", "batchnorm": True, "accum": 2},
        "bn_zero": {"strategy": "zero", "batchnorm": True, "accum": 2},
        "unfreeze": dict(BASE, strategy="zero", unfreeze_at=3, schedule=False),
        "bf16_saving": dict(
            BASE,
            strategy="zero",
            precision="bf16-true",
            save_at=4,
            save=str(tmp / "b.ckpt"),
            consolidate=paths["bf16.pt"],
        ),
        "bf16_load_raw": dict(BASE, strategy="zero", precision="bf16-true", load_raw=paths["bf16.pt"]),
        "two_optimizers": {"strategy": "zero", "two_optimizers": True, "expect_error": True},
        "sgd": {"strategy": "zero", "optimizer": "SGD", "expect_error": True},
        "separate_setup": {"strategy": "zero", "separate_setup": True, "expect_error": True},
    }
    two = dict(zip(named, launch(list(named.values()), 2, tmp), strict=True))
    resume_elsewhere = [dict(BASE, strategy="zero", resume=paths["loop.ckpt"])]
    single = dict(BASE, strategy="auto", unfreeze_at=3, schedule=False)  # torch schedulers refuse new groups
    stage3_on_one = dict(BASE, strategy="zero3", resume=paths["loop3.ckpt"])
    one, unfreeze_single, one_stage3 = launch(resume_elsewhere + [single, stage3_on_one], 1, tmp)
    two["unfreeze_single"] = unfreeze_single
    three = launch(
        resume_elsewhere
        + [dict(BASE, strategy="zero1", resume=paths["loop.ckpt"])]
        + [dict(BASE, strategy="zero3", resume=paths["loop.ckpt"])],
        3,
        tmp,
    )
    return {"two": two, "one": one, "three": three, "paths": paths, "one_stage3": one_stage3}


def test_zero_and_zero1_equal_ddp(runs: dict[str, Any]) -> None:
    """Accumulation with no_backward_sync, norm clipping, two param groups, warmup + cosine."""
    two = runs["two"]
    start = launch_free_start()
    assert diff(two["ddp"], start) > 1e-2, "parameters did not move: the comparison would be vacuous"
    for name in ("zero", "zero1", "zero3", "overlap", "registered"):
        assert diff(two[name], two["ddp"]) <= 1e-10, name
        assert two[name]["recorded"]["lrs"] == two["ddp"]["recorded"]["lrs"], name
        torch.testing.assert_close(
            torch.tensor(two[name]["recorded"]["norms"]),
            torch.tensor(two["ddp"]["recorded"]["norms"]),
            rtol=1e-12,
            atol=0,
        )
    assert len(set(map(tuple, two["ddp"]["recorded"]["lrs"]))) > 3, "the schedule must change the LR"
    assert diff(two["zero_value"], two["ddp_value"]) <= 1e-10
    assert torch.equal(two["zero"]["net.frozen.weight"], start["net.frozen.weight"])


def launch_free_start() -> dict[str, torch.Tensor]:
    from tests.distributed.fabric_loop import Holder

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # as the loop creates its model for "64-true"
    try:
        return {n: p.detach() for n, p in Holder().named_parameters()}
    finally:
        torch.set_default_dtype(default)


def test_save_reloads_on_one_two_three_ranks_and_other_stage(runs: dict[str, Any]) -> None:
    two, path = runs["two"], Path(runs["paths"]["loop.ckpt"])
    assert sorted(p.name for p in path.glob("shard-*")) == [
        "shard-00000-of-00002.pt",
        "shard-00001-of-00002.pt",
    ]
    assert verify_files(path, read_meta(path)) == []
    assert diff(two["resumed"], two["saving"]) == 0.0, "same world size: bit-identical"
    assert two["resumed"]["recorded"]["lrs"] == two["saving"]["recorded"]["lrs"][4:], "the schedule resumes"
    for name, result in [
        ("zero1", two["resumed_zero1"]),
        ("1 rank", runs["one"]),
        ("3 ranks", runs["three"][0]),
    ]:
        assert diff(result, two["saving"]) <= 1e-10, name
    assert diff(runs["three"][1], two["saving"]) <= 1e-10, "3 ranks, stage 1"


def test_stage3_keeps_shards_and_its_checkpoints_move_across_stages_and_world_sizes(
    runs: dict[str, Any],
) -> None:
    """``"zero3"`` under Fabric: placeholders between steps (the model is sharded), no hook left after
    ``unshard``, a save at step 4 that resumes at stage 2 on 2 ranks and at stage 3 on 1 rank, and a
    stage-2 save resumed at stage 3 on 3 ranks, each equal to the uninterrupted run."""
    two = runs["two"]
    assert two["zero3"]["placeholders"], "stage 3 must hold only shards between steps"
    assert two["zero3"]["hooks_after_unshard"] == [], "unshard leaves a plain module"
    assert sorted(p.name for p in Path(runs["paths"]["loop3.ckpt"]).glob("shard-*")) == [
        "shard-00000-of-00002.pt",
        "shard-00001-of-00002.pt",
    ]
    assert read_meta(Path(runs["paths"]["loop3.ckpt"]))["stage"] == 3
    assert diff(two["zero_from_zero3"], two["zero3"]) <= 1e-10, "stage 3 -> stage 2"
    assert diff(runs["one_stage3"], two["zero3"]) <= 1e-10, "2 ranks -> 1 rank at stage 3"
    assert diff(runs["three"][2], two["saving"]) <= 1e-10, "stage 2 on 2 ranks -> stage 3 on 3 ranks"


def test_consolidated_file_is_ddp_layout_and_load_raw_works(runs: dict[str, Any]) -> None:
    two = runs["two"]
    full = torch.load(runs["paths"]["consolidated.pt"], weights_only=True)
    assert {"model", "optimizer", "step", "scheduler"} <= full.keys() and full["step"] == 4
    assert diff(two["ddp_loads_consolidated"], two["saving"]) <= 1e-10
    assert diff(two["load_raw"], two["saving"]) <= 1e-10


def test_load_raw_into_16_bit_parameters_sets_the_fp32_masters(runs: dict[str, Any]) -> None:
    """bf16-true: load_raw writes bf16 parameters; the fp32 masters must follow them (the next step
    updates the masters, so stale ones would take the model back to its initial values)."""
    two = runs["two"]
    assert diff(two["bf16_saving"], launch_free_start()) > 5e-2
    assert diff(two["bf16_load_raw"], two["bf16_saving"]) <= 2e-2


def test_fabric_and_trainer_resume_each_other(runs: dict[str, Any]) -> None:
    two = runs["two"]
    assert diff(two["trainer_from_fabric"], two["plain"]) <= 1e-10
    assert diff(two["fabric_from_trainer"], two["plain"]) <= 1e-10
    assert diff(two["trainer_start"], two["plain"]) > 1e-3, "4 steps differ from 8: the test is not vacuous"


def test_fp16_overflow_on_one_rank_skips_everywhere_as_ddp(runs: dict[str, Any]) -> None:
    two = runs["two"]
    assert two["fp16_zero"]["loss_scale"] == two["fp16_ddp"]["loss_scale"] == 2.0**9
    assert diff(two["fp16_zero"], two["fp16_ddp"]) <= 2e-2


@pytest.mark.parametrize("name", ["bf16", "bf16_true", "bf16_true:3"])
def test_bf16_close_to_ddp(runs: dict[str, Any], name: str) -> None:
    """bf16 rounding differs with summation order: 2e-2 on weights of O(1), as for the Trainer."""
    two = runs["two"]
    name, _, stage = name.partition(":")
    assert diff(two[f"{name}_zero{stage}"], two[f"{name}_ddp"]) <= 2e-2


def test_refusals_match_the_trainer_strategy(runs: dict[str, Any]) -> None:
    two = runs["two"]
    assert "exactly one optimizer" in two["two_optimizers"]["error"]
    assert "shards torch.optim.AdamW and torch.optim.Adam; got SGD" in two["sgd"]["error"]
    assert "fabric.setup(model, optimizer)" in two["separate_setup"]["error"]


def test_fabric_only_options_are_refused_at_construction() -> None:
    from lightning_zero import ZeroFabricStrategy

    for option in ("async_checkpoint", "log_comm_stats"):
        with pytest.raises(ValueError, match=option):
            ZeroFabricStrategy(**{option: True})
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        ZeroFabricStrategy(bucket_cap_mb=-1)


def test_no_backward_sync_sends_nothing_on_accumulating_micro_batches(runs: dict[str, Any]) -> None:
    """Stage 2 sends exactly 2·Ψ·(N−1)/N per optimizer step with 2 micro-batches; stage 1 1.5× that."""
    two = runs["two"]
    zero, zero1 = two["zero"]["recorded"], two["zero1"]["recorded"]
    assert zero["elements"] == [zero["minimum"]] * 8
    assert zero1["elements"] == [zero1["minimum"] * 3 // 2] * 8


def test_buffers_follow_ddp_broadcast_rule(runs: dict[str, Any]) -> None:
    """BatchNorm running statistics of both ranks, after accumulation windows, equal "ddp"'s."""
    two = runs["two"]
    buffers = [k for k in two["bn_ddp"] if k.startswith("buffer:")]
    assert buffers and not torch.equal(
        two["bn_ddp"]["buffer:bn.running_mean"][0], two["bn_ddp"]["buffer:bn.running_mean"][1]
    )
    assert diff(two["bn_zero"], two["bn_ddp"]) <= 1e-10


def test_unfreezing_a_layer_replans_like_single_process_adamw(runs: dict[str, Any]) -> None:
    """requires_grad flipped and add_param_group at step 3; DDP cannot follow (its ranks drift
    apart), so one process with the global batch is the reference."""
    two = runs["two"]
    assert diff(two["unfreeze"], two["unfreeze_single"]) <= 1e-10
    assert diff(two["unfreeze"], two["zero"]) > 1e-3, "the unfrozen layer must have trained"


def test_torchrun_launch_matches_lightning_launcher(runs: dict[str, Any], tmp_path: Path) -> None:
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    result = launch([dict(BASE, strategy="zero")], 2, tmp_path, launcher=torchrun)[0]
    assert diff(result, runs["two"]["zero"]) == 0.0
    assert result["recorded"] == runs["two"]["zero"]["recorded"]
