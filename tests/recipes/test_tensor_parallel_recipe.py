"""The recipe with tensor (+ sequence) parallelism: `parallelism.tensor=2` trains as `parallelism.tensor=1`
on the same global batch (one 2-rank launch of `tests/recipes/tp_recipe_fit.py`), and the sizes it cannot
split are refused before any process starts, naming the setting."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from recipes.config.validation import ConfigError, validate
from tests.conf.compose import compose_pretrain
from tests.launch import launch_env, run_script

REPO_ROOT = Path(__file__).resolve().parents[2]
LOSS_TOL, PARAM_TOL = 1e-6, 1e-6


def test_tensor_parallel_trains_as_data_parallel_on_the_same_global_batch(tmp_path: Path) -> None:
    """Tensor 2 x data 1 against tensor 1 x data 2 (`tp_recipe_fit.py`): the same losses and weights
    (float64 but for the fp32 norms and loss: <= 1e-6; 6e-8 measured), the same greedy sample, the
    sampler dealing by data-parallel rank, and one forward's collectives those of the plan."""
    out = tmp_path / "results.pt"
    command = [sys.executable, "-m", "tests.recipes.tp_recipe_fit", "--out", str(out), "--dir", str(tmp_path)]
    proc = run_script(command, 2, cwd=REPO_ROOT, env=launch_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    saved = torch.load(out, weights_only=False)
    tensor, data = saved["results"]["tensor"], saved["results"]["data"]
    assert tensor["split"] and not data["split"]
    # the sampler counts data-parallel ranks: both ranks of the tensor-parallel group are data rank 0
    assert [r["tensor"] for r in saved["layouts"]] == [(1, 0), (1, 0)]
    assert [r["data"] for r in saved["layouts"]] == [(2, 0), (2, 1)]
    assert len(tensor["losses"]) == len(data["losses"]) == 3
    worst_loss = max(abs(a - b) for a, b in zip(tensor["losses"], data["losses"], strict=True))
    assert worst_loss <= LOSS_TOL, (tensor["losses"], data["losses"])
    assert tensor["params"].keys() == data["params"].keys()
    worst = {k: (tensor["params"][k] - v).abs().max().item() for k, v in data["params"].items()}
    assert max(worst.values()) <= PARAM_TOL, sorted(worst.items(), key=lambda kv: -kv[1])[:5]
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
            ["parallelism.tensor=2"],
            "does not save or resume the recipe's checkpoints yet (...): add callbacks.model_checkpoint=null "
            "trainer.enable_checkpointing=false",
        ),
        (
            [
                "parallelism.tensor=2",
                "callbacks.model_checkpoint=null",
                "trainer.enable_checkpointing=false",
                "model.compile_blocks=true",
            ],
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
    cfg = compose_pretrain(
        ["parallelism.tensor=2", "callbacks.model_checkpoint=null", "trainer.enable_checkpointing=false"]
    )
    configs = validate(cfg)
    assert cfg.strategy.tensor_parallel_size == 2 and configs.tensor_parallel == 2
    assert compose_pretrain([]).strategy.tensor_parallel_size == 1  # the default: ZeroStrategy's own
