"""Trainer(strategy=zero...) on 1-3 CPU ranks equals a single-process Lightning fit with torch AdamW on
the same global batch (rank r's batch i is the single process's batch i, sliced by the sampler).

The launched fits run in one launch per world size (a module fixture); each test reads its own by name."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.lit_fit import fit
from tests.launch import launch_env, run_script

ROOT = Path(__file__).resolve().parents[2]


def launch(
    cases: list[dict[str, Any]], tmp_path: Path, timeout_s: float = 240
) -> list[dict[str, torch.Tensor]]:
    """Run the fits in a fresh multi-process launch (never inside pytest: see FIELD-NOTES)."""
    out = tmp_path / "result.pt"
    env = launch_env()
    proc = run_script(
        [sys.executable, "-m", "tests.distributed.lit_fit", "--out", str(out), "--cases", json.dumps(cases)],
        max(1 if "validate_ckpt" in case else case.get("devices", 2) for case in cases),  # lit_fit's defaults
        cwd=ROOT,
        env=env,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out, weights_only=True)


def reference(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The same fit in this process, one rank, plain AdamW, the global batch in one go."""
    ref = {k: v for k, v in case.items() if k not in ("strategy", "devices", "stage", "sharded_checkpoint")}
    ref["batch_size"] = case.get("batch_size", 4) * case["devices"]
    return fit(strategy="auto", devices=1, **ref)[1]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


CASES_64 = [
    {"devices": 2, "stage": 1, "accum": 4, "clip": 0.05},
    {"devices": 2, "stage": 2, "accum": 1},
    {"devices": 2, "stage": 2, "accum": 4, "clip": 0.05},
    {"devices": 2, "stage": 1, "accum": 1},
    {"devices": 3, "stage": 1, "accum": 1, "clip": 0.05},
    {"devices": 3, "stage": 2, "accum": 4},
    {"devices": 3, "stage": 2, "accum": 1, "clip": 0.01, "clip_algorithm": "value"},
    {"devices": 1, "stage": 2, "accum": 4, "clip": 0.05},
]


REGISTERED = [
    {
        "strategy": name,
        "devices": 2,
        "precision": "32-true",
        "accum": 2,
        "clip": 0.05,
        "steps": 12,
        "unused_every": 0,
    }
    for name in ("zero", "zero1", "zero2")
]
FP16 = {"devices": 2, "precision": "16-mixed-cpu", "steps": 8, "unused_every": 0, "inf_at_step": 3}
OPTIMIZER_STATE = {"devices": 3, "stage": 2, "accum": 2, "clip": 0.05, "sharded_checkpoint": False}


def named_cases(tmp: Path) -> dict[str, dict[str, Any]]:
    """Every launched fit of this module by name (each test reads its own)."""
    named: dict[str, dict[str, Any]] = {f"f64_{i}": c for i, c in enumerate(CASES_64)}
    named.update({f"registered_{c['strategy']}": c for c in REGISTERED})
    for precision in ("bf16-mixed", "bf16-true"):
        base = {"devices": 2, "precision": precision, "steps": 8, "unused_every": 0}
        named[f"{precision}_zero2"] = dict(base, strategy="zero2")
        named[f"{precision}_ddp"] = dict(base, strategy="ddp")
    named["comm_stats"] = {"devices": 2, "stage": 2, "steps": 3, "unused_every": 0, "csv_dir": str(tmp)}
    named["comm_stats_every_3"] = dict(
        named["comm_stats"], steps=9, accum=2, log_every=3, csv_dir=str(tmp / "every_3")
    )
    named["fp16_zero2"] = dict(FP16, strategy="zero2")
    named["fp16_ddp"] = dict(FP16, strategy="ddp")
    named["fp16_clean"] = dict(FP16, strategy="zero2", inf_at_step=None)
    named["optimizer_state"] = dict(OPTIMIZER_STATE, save=str(tmp / "zero.ckpt"))
    named["save_after_gpu_teardown"] = {
        "devices": 2,
        "stage": 2,
        "steps": 4,
        "gpu_like_teardown": True,
        "save": str(tmp / "after_teardown.ckpt"),
    }
    return named


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    """One launch per world size (1, 2, 3), the cases of that size in the order of ``named_cases``."""
    tmp = tmp_path_factory.mktemp("lightning_parity")
    named = named_cases(tmp)
    results: dict[str, dict[str, torch.Tensor]] = {}
    for devices in (1, 2, 3):
        names = [name for name, c in named.items() if c["devices"] == devices]
        out = launch([named[name] for name in names], tmp, timeout_s=600)
        results.update(zip(names, out, strict=True))
    return tmp, results


@pytest.mark.parametrize("devices", [1, 2, 3])
def test_float64_parity_with_single_process_adamw(devices: int, launched: tuple[Path, dict]) -> None:
    named = [(f"f64_{i}", c) for i, c in enumerate(CASES_64) if c["devices"] == devices]
    start = fit(strategy="auto", devices=1, steps=0)[1]
    for name, case in named:
        result, expected = launched[1][name], reference(case)
        assert max_diff(result, start) > 1e-2, "parameters did not move: the comparison would be vacuous"
        assert max_diff(result, expected) <= 1e-10, (case, max_diff(result, expected))
        assert torch.equal(result["net.frozen.weight"], start["net.frozen.weight"])


def test_registered_names_fp32_parity(launched: tuple[Path, dict]) -> None:
    """ "zero", "zero1", "zero2" by name, default buckets, 32-true: within 1e-4 of one process."""
    for case in REGISTERED:
        assert max_diff(launched[1][f"registered_{case['strategy']}"], reference(case)) <= 1e-4, case


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_close_to_ddp_under_same_precision(precision: str, launched: tuple[Path, dict]) -> None:
    """bf16 rounding differs by summation order; the stated tolerance is 2e-2 on weights of O(1)."""
    zero, ddp = launched[1][f"{precision}_zero2"], launched[1][f"{precision}_ddp"]
    start = fit(strategy="auto", devices=1, steps=0)[1]
    assert max_diff(ddp, start) > 5e-2
    assert max_diff(zero, ddp) <= 2e-2


def test_checkpoint_optimizer_state_is_torch_adamw_state(launched: tuple[Path, dict], tmp_path: Path) -> None:
    """With sharded_checkpoint=False, the single file of a 3-rank zero2 fit holds the state that
    single-process AdamW would."""
    reference(dict(OPTIMIZER_STATE, save=str(tmp_path / "ref.ckpt")))
    assert_same_adamw_state(launched[0] / "zero.ckpt", tmp_path / "ref.ckpt")


def assert_same_adamw_state(ours_file: Path, ref_file: Path) -> None:
    """Two single-file Lightning checkpoints hold the same ``torch.optim.AdamW`` state (1e-10)."""
    ours = torch.load(ours_file, weights_only=True)["optimizer_states"][0]
    ref = torch.load(ref_file, weights_only=True)["optimizer_states"][0]
    assert ours["state"].keys() == ref["state"].keys() and len(ref["state"]) == 7  # frozen layer: no state
    for i, entry in ref["state"].items():
        assert entry.keys() == ours["state"][i].keys()
        assert float(entry["step"]) == float(ours["state"][i]["step"])
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours["state"][i][name], entry[name], rtol=0, atol=1e-10)
    assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in ref["param_groups"]]
    assert [g["lr"] for g in ours["param_groups"]] == [g["lr"] for g in ref["param_groups"]]


def test_a_save_after_a_gpu_teardown_writes_the_sharded_directory(launched: tuple[Path, dict]) -> None:
    """Lightning's teardown on a GPU gives the parameters new (CPU) storage; the sharded state follows
    them, so ``trainer.save_checkpoint`` after ``fit`` still writes the directory, holding the final
    parameters (and the Adam state of the fit)."""
    from lightning_zero.checkpoint import is_sharded_checkpoint, read_meta
    from lightning_zero.checkpoint.consolidate import load_module_checkpoint

    path = launched[0] / "after_teardown.ckpt"
    assert is_sharded_checkpoint(path), "the save after fit switched to a single file"
    saved = load_module_checkpoint(path)["state_dict"]
    final = launched[1]["save_after_gpu_teardown"]
    for name, value in final.items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0)
    assert int(read_meta(path)["steps"].max()) == 4


def test_comm_stats_are_logged(launched: tuple[Path, dict]) -> None:
    rows = (launched[0] / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    ratio = [r.split(",")[header.index("zero/elements_sent_vs_min")] for r in rows[1:]]
    assert [float(v) for v in ratio if v] == [1.0, 1.0, 1.0]
    waits = [float(r.split(",")[header.index("zero/comm_wait_frac")]) for r in rows[1:] if r.split(",")[0]]
    assert all(0.0 <= w < 1.0 for w in waits)


def test_comm_stats_synchronise_only_at_logging_steps(launched: tuple[Path, dict]) -> None:
    """With ``log_every_n_steps=3`` (9 steps, 2 micro-batches each) the device timings are read at the
    logged batches only, and the logged figures are means over the interval: still 1.0x the minimum."""
    rows = (launched[0] / "every_3" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    logged = [r.split(",") for r in rows[1:] if r.split(",")[header.index("zero/elements_sent_vs_min")]]
    assert [int(r[header.index("step")]) for r in logged] == [2, 5, 8]
    assert [float(r[header.index("zero/elements_sent_vs_min")]) for r in logged] == [1.0, 1.0, 1.0]
    bytes_per_element = [
        float(r[header.index("zero/bytes_sent")]) / float(r[header.index("zero/elements_sent")])
        for r in logged
    ]
    assert bytes_per_element == [8.0, 8.0, 8.0]  # float64 parameters and gradients on the wire
    for r in logged:  # the ranks' mean batch times over the interval, across ranks
        for name in ("step_time", "busy_time"):
            low, mid, high = (float(r[header.index(f"zero/{name}_{k}_s")]) for k in ("min", "median", "max"))
            assert 0.0 < low <= mid <= high, (name, low, mid, high)
        assert float(r[header.index("zero/busy_time_max_s")]) <= float(
            r[header.index("zero/step_time_max_s")]
        )
        assert float(r[header.index("zero/slowest_rank")]) in (0.0, 1.0)
    flushes = int(launched[1]["comm_stats_every_3"]["flushes"])
    assert flushes == len(logged), "timings read outside the logged steps (a device sync each)"


def test_fp16_loss_scaling_overflow_on_one_rank_skips_everywhere(launched: tuple[Path, dict]) -> None:
    """16-mixed with a GradScaler (on CPU through an explicit plugin): an inf on rank 1 alone at step 3
    must skip that step on both ranks and back the scale off, exactly as "ddp" does."""
    zero, ddp, clean = (launched[1][f"fp16_{name}"] for name in ("zero2", "ddp", "clean"))
    assert float(zero["loss_scale"]) == float(ddp["loss_scale"]) < float(clean["loss_scale"])
    assert max_diff(zero, ddp) <= 2e-2
    assert max_diff(zero, clean) > 1e-3, "the skipped step must show"
