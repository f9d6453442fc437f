"""The recipe with tensor (+ sequence) parallelism: `parallelism.tensor=2` trains as `parallelism.tensor=1`
on the same global batch, its checkpoint resumes at tensor 2 and at tensor 1 and consolidates into whole
tensors (one 2-rank launch of `tests/recipes/tp_recipe_fit.py`, shared by the tests below), and the sizes
it cannot split are refused before any process starts, naming the setting."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero.checkpoint.consolidate import consolidate
from recipes.checkpoints import load_module
from recipes.config.validation import ConfigError, validate
from tests.conf.compose import compose_pretrain
from tests.launch import launch_env, run_script

REPO_ROOT = Path(__file__).resolve().parents[2]
LOSS_TOL, PARAM_TOL = 1e-6, 1e-12  # losses: fp32 (the norms and loss); weights: float64


def worst_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[tuple[str, float]]:
    """Every tensor's largest absolute difference, the worst first (the key sets must be equal)."""
    assert got.keys() == want.keys()
    worst = {k: (got[k] - v).abs().max().item() for k, v in want.items()}
    return sorted(worst.items(), key=lambda kv: -kv[1])


def trained_rows(run_dir: Path) -> dict[str, list[str]]:
    """`callbacks=trained_samples`'s files of one run, by name, one row (`step index ...`) a line."""
    files = sorted((run_dir / "trained_samples").glob("*.txt"))
    return {f.name: f.read_text().splitlines() for f in files}


def samples_by_step(rows: dict[str, list[str]]) -> dict[int, list[int]]:
    """The sample indices each step trained over all files, sorted."""
    steps: dict[int, list[int]] = {}
    for lines in rows.values():
        for line in lines:
            step, *indices = map(int, line.split())
            steps.setdefault(step, []).extend(indices)
    return {step: sorted(indices) for step, indices in sorted(steps.items())}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """The one 2-rank launch of `tp_recipe_fit.py`: its saved results and its directory."""
    root = tmp_path_factory.mktemp("tp_recipe")
    out = root / "results.pt"
    command = [sys.executable, "-m", "tests.recipes.tp_recipe_fit", "--out", str(out), "--dir", str(root)]
    proc = run_script(command, 2, cwd=REPO_ROOT, env=launch_env(), timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False), root


def test_tensor_parallel_trains_as_data_parallel_on_the_same_global_batch(
    launched: tuple[dict[str, Any], Path],
) -> None:
    """Tensor 2 x data 1 against tensor 1 x data 2 (`tp_recipe_fit.py`): the same losses (fp32 norms
    and loss: <= 1e-6, 6e-8 measured) and float64 weights (<= 1e-12, 3.5e-15 measured), the same greedy
    sample, the sampler dealing by data-parallel rank, and one forward's collectives those of the plan."""
    saved, _ = launched
    tensor, data = saved["results"]["tensor"], saved["results"]["data"]
    assert tensor["split"] and not data["split"]
    # the sampler counts data-parallel ranks: both ranks of the tensor-parallel group are data rank 0
    assert [r["tensor"] for r in saved["layouts"]] == [(1, 0), (1, 0)]
    assert [r["data"] for r in saved["layouts"]] == [(2, 0), (2, 1)]
    assert list(tensor["losses"]) == list(data["losses"]) == [0, 1, 2]
    worst_loss = max(abs(tensor["losses"][s] - data["losses"][s]) for s in data["losses"])
    assert worst_loss <= LOSS_TOL, (tensor["losses"], data["losses"])
    worst = worst_difference(tensor["params"], data["params"])
    assert worst[0][1] <= PARAM_TOL, worst[:5]
    assert tensor["sample"] == data["sample"]
    # per block: the sequence gathered before attention and before the MLP, their outputs scattered
    # back; the embedding's lookup scattered, the head's input and its logits gathered
    layers = 2
    assert tensor["forward_collectives"] == {
        "reduce_scatter_tensor": 1 + 2 * layers,
        "all_gather_into_tensor": 2 * layers + 2,
    }
    assert data["forward_collectives"] == {}


@pytest.mark.parametrize(
    ("resumed", "uninterrupted"), [("tensor_resumed", "tensor"), ("data_resumed", "data")]
)
def test_a_tensor_parallel_checkpoint_resumes_the_recipe(
    launched: tuple[dict[str, Any], Path], resumed: str, uninterrupted: str
) -> None:
    """The recipe's checkpoint callback saved the tensor-parallel run at step 2
    (`<run_dir>/checkpoints/step000002.ckpt`, a directory of every tensor rank's shards); resumed from it
    at tensor 2 (the same layout) and at tensor 1 x data 2 (each parameter joined whole), the run
    trains step 2 on the samples the uninterrupted one trained there (the data position resumed) and
    ends at its loss and weights (measured: tensor 2 bit for bit; tensor 1 x data 2 against tensor 1 x
    data 2 uninterrupted: loss equal, weights 3.5e-15; against tensor 2 uninterrupted: 7e-18)."""
    saved, root = launched
    got, want = saved["results"][resumed], saved["results"][uninterrupted]
    assert list(got["losses"]) == [2], "the resumed run trains step 2 only"
    assert abs(got["losses"][2] - want["losses"][2]) <= LOSS_TOL, (got["losses"], want["losses"])
    worst = worst_difference(got["params"], want["params"])
    assert worst[0][1] <= PARAM_TOL, worst[:5]
    rows, want_rows = trained_rows(root / resumed), trained_rows(root / uninterrupted)
    assert rows.keys() == want_rows.keys()
    assert rows == {name: [r for r in lines if r.startswith("2 ")] for name, lines in want_rows.items()}


def test_trained_samples_are_written_once_per_data_parallel_rank(
    launched: tuple[dict[str, Any], Path],
) -> None:
    """`callbacks=trained_samples`: the two ranks of the tensor-parallel group train the same samples,
    written once (its tensor rank 0, data-parallel rank 0's file); the same samples per step as the two
    data-parallel ranks' files of tensor 1."""
    _, root = launched
    tensor, data = trained_rows(root / "tensor"), trained_rows(root / "data")
    assert list(tensor) == ["rank0.txt"] and list(data) == ["rank0.txt", "rank1.txt"]
    assert [int(r.split()[0]) for r in tensor["rank0.txt"]] == [0, 0, 1, 1, 2, 2]  # each micro-batch once
    assert samples_by_step(tensor) == samples_by_step(data)


def test_the_tensor_parallel_checkpoint_gives_whole_tensors(
    launched: tuple[dict[str, Any], Path], tmp_path: Path
) -> None:
    """The final `last.ckpt` of the tensor-parallel run (`RunCheckpoint`'s save at the end of training,
    the requeue's save path), consolidated into one file (`lightning-zero consolidate`) and read by
    `recipes.checkpoints.load_module` (what `recipes.export` and `recipes.generate` read): whole
    tensors equal to the run's gathered weights (bit for bit: float64, and the export's float32)."""
    saved, root = launched
    want = saved["results"]["tensor"]["params"]
    last = root / "tensor" / "checkpoints" / "last.ckpt"
    consolidate(last, tmp_path / "whole.ckpt")
    whole = torch.load(tmp_path / "whole.ckpt", weights_only=True)
    assert whole["global_step"] == 3
    state = {k.removeprefix("model."): v for k, v in whole["state_dict"].items()}
    assert state.keys() == want.keys()
    assert all(torch.equal(state[k], v) for k, v in want.items()), worst_difference(state, want)[:5]
    exported = load_module(last).model.state_dict()
    assert all(torch.equal(exported[k], v.to(exported[k].dtype)) for k, v in want.items())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallelism.tensor=3", "model.n_head=4"], "parallelism.tensor=3 does not divide model.n_head=4"),
        (
            ["parallelism.tensor=2", "model.n_head=4", "model.n_kv_head=1"],
            "parallelism.tensor=2 does not divide model.n_kv_head (key/value heads)=1",
        ),
        (
            ["parallelism.tensor=2", "model.mlp_hidden=101"],
            "parallelism.tensor=2 does not divide model.mlp_hidden (the MLP width)=101",
        ),
        (["parallelism.tensor=2", "model.vocab_size=257"], "does not divide model.vocab_size=257"),
        (
            ["parallelism.tensor=2", "trainer.devices=1"],
            "parallelism.tensor=2 does not divide trainer.devices=1",
        ),
        (
            ["parallelism.tensor=2", "data.seq_len=255"],
            "parallelism.tensor=2 does not divide data.seq_len=255",
        ),
        (["parallelism.tensor=2", "strategy=ddp"], "parallelism.tensor=2 needs a lightning-zero strategy"),
        (
            ["strategy.tensor_parallel_size=2"],
            "strategy.tensor_parallel_size=2 differs from parallelism.tensor=1: set parallelism.tensor=2",
        ),
        (
            ["parallelism.tensor=2", "strategy.sharded_checkpoint=false"],
            "sharded_checkpoint=False is not supported with tensor_parallel_size=2",
        ),
        (
            ["parallelism.tensor=2", "model.compile_blocks=true"],
            "model.compile_blocks=true with parallelism.tensor=2",
        ),
        (["parallelism.tensor=0"], "parallelism.tensor=0 must be >= 1"),
    ],
)
def test_sizes_tensor_parallelism_cannot_split_are_named(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate(compose_pretrain(overrides))
    assert all(part in str(info.value) for part in message.split("(...)")), str(info.value)


def test_the_strategy_takes_its_tensor_parallel_size_from_parallelism_tensor() -> None:
    cfg = compose_pretrain(["parallelism.tensor=2", "ckpt_path=null"])  # checkpoints on: the defaults
    configs = validate(cfg)
    assert cfg.strategy.tensor_parallel_size == 2 and configs.tensor_parallel == 2
    assert compose_pretrain([]).strategy.tensor_parallel_size == 1  # the default: ZeroStrategy's own
