"""Every case of :mod:`tests.conformance.cases` under "zero", "zero" with ``overlap_param_gather`` and
"zero3" (and "zero1" for the cases of the gradient path; or the strategies a case lists) equals the same
case under its reference — "ddp" unless the case says otherwise — in what a user sees: LR and beta1
of every param group at every optimizer step, logged metrics, callback metrics, step and epoch
counts, the parameters and buffers at the end (float64: within 1e-10) on every rank, and what
validate/test/predict/load_from_checkpoint return after fit. A case our strategy refuses must fail
with its documented message while the reference succeeds.

The cases run in a few launches of 2 CPU processes (one launch runs many cases in sequence).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conformance.cases import CASES, STAGE1
from tests.conformance.module import ConformanceModule
from tests.conformance.runner import HYBRID, launched_strategies, ours_of, run_case
from tests.launch import launch_env, run_script

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-10
CHUNKS = 4
_NAMES = list(CASES)
_GROUPS = [_NAMES[i::CHUNKS] for i in range(CHUNKS)]
_RESULTS: dict[int, list[dict[str, Any]]] = {}
HYBRID_CASES = sorted(n for n in STAGE1 if CASES[n].get("reference", "ddp") != "single")


def _launch(group: int, tmp: Path) -> list[dict[str, Any]]:
    """Both ranks' results for one group of cases (one launch, cached for the session); group -1:
    the hybrid launch (4 ranks, :data:`HYBRID_CASES`)."""
    if group not in _RESULTS:
        tmp.mkdir(parents=True, exist_ok=True)
        out = tmp / f"group{group}.pt"
        env = launch_env()
        cmd = [
            sys.executable,
            "-m",
            "tests.conformance.runner",
            "--out",
            str(out),
            "--workdir",
            str(tmp / "work"),
        ]
        hybrid = group == -1
        cases, size = (HYBRID_CASES, 4) if hybrid else (_GROUPS[group], 2)
        cmd += ["--cases", ",".join(cases), "--world-size", str(size), *(["--hybrid"] if hybrid else [])]
        proc = run_script(cmd, size, cwd=ROOT, env=env, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        _RESULTS[group] = [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(size)]
    return _RESULTS[group]


def assert_same(ours: Any, ref: Any, where: str, tol: float = TOL) -> None:
    """Equal structure; tensors and floats within ``tol``; everything else equal."""
    if isinstance(ref, dict):
        assert isinstance(ours, dict) and sorted(ours) == sorted(ref), (where, sorted(ours), sorted(ref))
        for key in ref:
            assert_same(ours[key], ref[key], f"{where}.{key}", tol)
    elif isinstance(ref, list | tuple):
        assert isinstance(ours, list | tuple) and len(ours) == len(ref), (where, len(ours), len(ref))
        for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
            assert_same(a, b, f"{where}[{i}]", tol)
    elif isinstance(ref, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and ours.shape == ref.shape and ours.dtype == ref.dtype, where
        diff = (ours.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
        assert diff <= tol, (where, diff)
    elif isinstance(ref, float):
        assert isinstance(ours, float | int), where
        assert (math.isnan(ref) and math.isnan(ours)) or abs(ours - ref) <= tol * max(1.0, abs(ref)), (
            where,
            ours,
            ref,
        )
    else:
        assert ours == ref, (where, ours, ref)


def _moved(params: dict[str, torch.Tensor], case: dict[str, Any]) -> None:
    start = ConformanceModule(**case.get("module", {}))  # the same seeded initialisation
    diffs = [
        (params[k].double() - v.double()).abs().max().item()
        for k, v in start.state_dict().items()
        if k in params
    ]
    assert max(diffs) > 1e-3, "parameters did not move: the comparison would be vacuous"


@pytest.mark.parametrize("name", _NAMES)
def test_case_equals_reference(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    case = CASES[name]
    group = next(i for i, g in enumerate(_GROUPS) if name in g)
    ranks = _launch(group, tmp_path_factory.getbasetemp() / "conformance")
    reference = case.get("reference", "ddp")
    if reference == "single":
        ref_ranks = [run_case(name, "single", tmp_path_factory.mktemp(name))] * 2
    else:
        ref_ranks = [rank[f"{name}/{reference}"] for rank in ranks]
    _compare(name, ranks, ref_ranks, ours_of(name))


@pytest.mark.parametrize("name", HYBRID_CASES)
def test_gradient_path_case_under_hybrid_2x2_equals_ddp_on_4_ranks(
    name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The cases of the gradient path (accumulation, clipping, manual rounds, re-plans, ...) under
    ``shard_group_size=2`` on 4 ranks (2 groups of 2) against "ddp" on the same 4 ranks, every rank."""
    ranks = _launch(-1, tmp_path_factory.getbasetemp() / "conformance_hybrid")
    reference = CASES[name].get("reference", "ddp")
    _compare(name, ranks, [rank[f"{name}/{reference}"] for rank in ranks], HYBRID)


def _compare(
    name: str, ranks: list[dict[str, Any]], ref_ranks: list[dict[str, Any]], strategies: list[str]
) -> None:
    """Every rank's results of ``name`` under each of ``strategies`` against the reference's."""
    case = CASES[name]
    reference = case.get("reference", "ddp")
    for ours in strategies:
        assert f"{name}/{ours}" in ranks[0], (launched_strategies(name), sorted(ranks[0]))
        for rank, (results, ref) in enumerate(zip(ranks, ref_ranks, strict=True)):
            got = results[f"{name}/{ours}"]
            where = f"{name}/{ours} rank {rank}"
            assert ref["error"] is None or case.get("both_fail"), (where, "reference failed", ref["error"])
            refused = case.get("zero3_refused") if ours.startswith("zero3") else None
            refused = refused or case.get("refused")
            if refused is not None:
                assert got["error"] is not None and refused in got["error"], (where, got["error"])
                continue
            assert got["error"] == ref["error"], (where, got["error"], ref["error"])
            if ref["error"] is not None:
                continue
            _moved(got["params"], case)
            assert got["sharded_after_fit"] == ours.startswith("zero3"), (where, "sharded after fit")
            tol = case.get("tol", TOL)
            assert_same(got["params"], ref["params"], f"{where} params", tol)
            assert_same(got["lrs"], ref["lrs"], f"{where} lrs", tol=1e-12)
            assert_same(got["recorded"], ref["recorded"], f"{where} recorded by callbacks", tol)
            assert_same(got["global_step"], ref["global_step"], f"{where} global_step")
            assert_same(got["epoch"], ref["epoch"], f"{where} epoch")
            if reference != "single":  # one process logs the global batch's loss, not rank 0's
                assert_same(got["logged"], ref["logged"], f"{where} logged", tol)
                assert_same(
                    got["callback_metrics"], ref["callback_metrics"], f"{where} callback_metrics", tol
                )
            assert_same(got["after"], ref["after"], f"{where} after", tol)
