"""A Hugging Face Llama (random weights, made here by ``transformers``) read straight into a stage-3 model
on 2 ranks: the recipe's GPT, built on the meta device and initialized unit by unit, then filled by
``lightning_zero.checkpoint.load_parameters`` from a ``SafetensorsReader`` (one file, or shards with
an index), gives ``transformers``' logits within 1e-4, and each rank reads exactly its shards' elements
(never the whole model). Also at stage 2 (every rank reads its shards, the all-gather completes them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tests.distributed.harness import ranks, run_ranks_each
from tests.launch import ROOT, launch_env, run_script

CONFIG = {
    "vocab_size": 96,
    "max_seq_len": 16,
    "n_layer": 2,
    "n_head": 4,
    "n_kv_head": 2,
    "d_model": 64,
    "mlp_hidden": 128,
    "tie_embeddings": False,
}


def _hf_model(directory: Path, shards: bool) -> None:
    from recipes.checkpoints.hf import llama_config
    from recipes.training import GPTConfig

    torch.manual_seed(3)
    config = llama_config(GPTConfig(**CONFIG), None, None, torch.float32)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # norms away from 1, so that a wrong mapping of them shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="60KB" if shards else "10GB")


def import_and_compare(rank: int, world_size: int, directory: str, stage: int) -> dict[str, Any]:
    from lightning_zero import ShardedAdamW, ZeroConfig
    from lightning_zero.checkpoint import SafetensorsReader, load_parameters
    from lightning_zero.engine.deferred_init import DeferredInit, capture_rng
    from recipes.checkpoints.hf import llama_sources
    from recipes.training import GPT, GPTConfig

    config = GPTConfig(**CONFIG)
    cpu = torch.device("cpu")
    if stage == 3:
        with torch.device("meta"):
            model = GPT(config)
        init = DeferredInit(cpu, capture_rng(cpu))
        zero = ZeroConfig(stage=3, min_unit_numel=1000)
        opt = ShardedAdamW(model.parameters(), lr=1e-3, config=zero, module=model, deferred_init=init)
    else:
        model = GPT(config)
        opt = ShardedAdamW(model.parameters(), lr=1e-3, config=ZeroConfig(stage=2), module=model)
    reader = SafetensorsReader(directory, sources=llama_sources(config))
    asked = []

    def counting(name: str, start: int, end: int) -> torch.Tensor:
        asked.append(end - start)
        return reader(name, start, end)

    loaded = load_parameters(model, counting, engine=opt.engine)
    tokens = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
        theirs = transformers.LlamaForCausalLM.from_pretrained(directory).eval()(tokens).logits
    shard_elements = sum(
        seg.numel for b in opt.engine.plan.buckets for seg in opt.engine.plan.segments(b, rank)
    )
    return {
        "max_diff": (ours - theirs).abs().max().item(),
        "scale": theirs.abs().max().item(),
        "read": sum(asked),
        "shard_elements": shard_elements,
        "total": sum(p.numel() for p in model.parameters()),
        "loaded": len(loaded),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("hf")
    one, sharded = tmp / "one_file", tmp / "sharded"
    _hf_model(one, shards=False)
    _hf_model(sharded, shards=True)
    assert (sharded / "model.safetensors.index.json").is_file() and not (
        one / "model.safetensors.index.json"
    ).exists()
    calls = [
        (import_and_compare, (str(one), 3)),
        (import_and_compare, (str(sharded), 3)),
        (import_and_compare, (str(one), 2)),
    ]
    out = run_ranks_each(calls, 2)
    result = tmp / "recipe.pt"
    proc = run_script(
        [sys.executable, "-m", "tests.distributed.pretrained_fit", "--hf", str(sharded)]
        + ["--config", json.dumps(CONFIG), "--out", str(result)],
        2,
        cwd=ROOT,
        env=launch_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    recipe = torch.load(result, weights_only=True)
    return {
        "stage3_one_file": out[0],
        "stage3_sharded": out[1],
        "stage2": out[2],
        "recipe": recipe,
        "dir": one,
    }


@pytest.mark.parametrize("case", ["stage3_one_file", "stage3_sharded", "stage2"])
def test_imported_llama_gives_transformers_logits_and_each_rank_reads_only_its_shards(
    runs: dict[str, Any], case: str
) -> None:
    results = ranks(runs, case)
    for result in results:
        assert result["max_diff"] <= 1e-4, result
        assert result["scale"] > 0.1, "logits near zero would make the comparison vacuous"
        assert result["read"] == result["shard_elements"], result
    assert sum(r["read"] for r in results) == results[0]["total"], "the ranks together read the model once"


def test_the_recipe_module_starts_from_the_llama_with_init_from(runs: dict[str, Any]) -> None:
    """`PretrainModule` with `model.init_from=DIR`, built on the meta device under "zero3" (2 ranks)."""
    recipe = runs["recipe"]
    assert recipe["max_diff"] <= 1e-4 and recipe["scale"] > 0.1, recipe


def test_init_from_a_directory_of_another_shape_is_refused_naming_the_fields(runs: dict[str, Any]) -> None:
    from recipes.training import GPTConfig, OptimConfig, PretrainModule
    from recipes.training.llama import InitFromError

    config = GPTConfig(**{**CONFIG, "d_model": 32, "n_layer": 3}, init_from=str(runs["dir"]))
    with pytest.raises(
        InitFromError, match=r"model.n_layer: 3 here, num_hidden_layers=2 .*model.d_model: 32 here"
    ):
        PretrainModule(config, OptimConfig())
