"""`model.compile_blocks`: each block's forward compiled with `torch.compile` trains exactly as the eager
model, with and without activation checkpointing, in one process and on 2 ranks under ZeRO stages 2 and
3; parameter names, checkpoints and the export are unchanged; KV-cache decoding stays eager; a bad
backend is refused by name before anything runs.

The comparisons use the "aot_eager" backend (dynamo and AOTAutograd trace forward and backward, PyTorch's
own kernels run them: what compilation changes apart from code generation). "inductor" works here too
(g++; loss and gradients within 2.5e-7 of eager after one step of `TINY`) but its first compile took
35-125 s on the 2-core test machine, so no test uses it. Each test checks that the compiled forward
actually ran (a counter around `recipes.training.model.compiled_layers`), so an equality cannot hold
because nothing was compiled.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import recipes.training.model
from recipes.checkpoints.hf import llama_config, llama_state_dict
from recipes.config.validation import ConfigError, validate
from recipes.training.model import COMPILE_BACKENDS, GPT, GPTConfig
from recipes.training.throughput import train_flops
from tests.conf.compose import compose_pretrain
from tests.launch import launch_env, run_script
from tests.recipes.compile_fit import STEPS, TINY, counting_compiled_layers

ROOT = Path(__file__).resolve().parents[2]
ATOL = 1e-6  # float32; measured: 0.0 with "aot_eager" (same kernels in the same order)


@pytest.fixture
def compiled_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """`[n]`: how often a compiled block forward ran in this test; dynamo starts with no graphs."""
    torch._dynamo.reset()
    counters.clear()
    count = [0]
    monkeypatch.setattr(recipes.training.model, "compiled_layers", counting_compiled_layers(count))
    yield count
    torch._dynamo.reset()


def compiled(config: GPTConfig, backend: str = "aot_eager") -> GPTConfig:
    return dataclasses.replace(config, compile_blocks=True, compile_backend=backend)


def train(model: GPT, steps: int, hook_calls: list[int] | None = None) -> dict[str, Any]:
    """`steps` AdamW steps on fixed random tokens: losses, every step's gradients and compiled-graph count,
    final parameters. `hook_calls`: a forward pre-hook, registered on every block after the first step
    (after compilation), appends to it at each call."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    losses, grads, graphs = [], [], []
    for step in range(steps):
        idx = torch.randint(0, model.config.vocab_size, (2, model.config.max_seq_len), generator=generator)
        loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        graphs.append(int(counters["stats"]["unique_graphs"]))
        optimizer.step()
        optimizer.zero_grad()
        if step == 0 and hook_calls is not None:
            for block in model.blocks:
                block.register_forward_pre_hook(lambda *_: hook_calls.append(1))
    return {"losses": losses, "grads": grads, "graphs": graphs, "params": dict(model.named_parameters())}


@pytest.mark.parametrize("activation_checkpointing", [False, True])
def test_compiled_blocks_train_as_eager(activation_checkpointing: bool, compiled_calls: list[int]) -> None:
    config = dataclasses.replace(TINY, activation_checkpointing=activation_checkpointing)
    torch.manual_seed(0)
    eager = train(GPT(config), STEPS)
    torch.manual_seed(0)
    hook_calls: list[int] = []
    result = train(GPT(compiled(config)), STEPS, hook_calls)
    torch.testing.assert_close(result["losses"], eager["losses"], atol=ATOL, rtol=0)
    for got, expected in zip(result["grads"], eager["grads"], strict=True):
        assert got.keys() == expected.keys()
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(result["params"], eager["params"], atol=ATOL, rtol=0)
    runs = 2 if activation_checkpointing else 1  # the recomputation runs the compiled forward again
    assert compiled_calls[0] == STEPS * config.n_layer * runs, "the compiled forward did not run"
    assert len(hook_calls) == (STEPS - 1) * config.n_layer * runs, "a hook added after compiling was skipped"
    graphs = result["graphs"]
    assert graphs[0] >= 1 and graphs == [graphs[0]] * STEPS, f"recompiled after the first step: {graphs}"


def test_parameter_names_checkpoints_and_export_are_unchanged(compiled_calls: list[int]) -> None:
    torch.manual_seed(0)
    eager = GPT(TINY)
    model = GPT(compiled(TINY))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in eager.named_parameters()]
    assert list(model.state_dict()) == list(eager.state_dict())
    model.load_state_dict(eager.state_dict(), strict=True)
    idx = torch.randint(0, TINY.vocab_size, (2, TINY.max_seq_len))
    torch.testing.assert_close(model(idx), eager(idx), atol=ATOL, rtol=0)
    assert compiled_calls[0] == TINY.n_layer
    eager.load_state_dict(model.state_dict(), strict=True)  # what a compiled run's checkpoint holds
    hf = llama_config(compiled(TINY), bos_id=None, eos_id=None, dtype=torch.float32).to_dict()
    assert hf == llama_config(TINY, bos_id=None, eos_id=None, dtype=torch.float32).to_dict()
    assert not any("compile" in key for key in hf)
    exported = llama_state_dict(model.state_dict(), compiled(TINY))
    assert exported.keys() == llama_state_dict(eager.state_dict(), TINY).keys()


def test_kv_cache_decoding_stays_eager(compiled_calls: list[int]) -> None:
    torch.manual_seed(0)
    eager = GPT(TINY)
    model = GPT(compiled(TINY))
    model.load_state_dict(eager.state_dict())
    prompt = torch.randint(0, TINY.vocab_size, (2, 4))
    tokens = model.generate(prompt, max_new_tokens=TINY.max_seq_len - 4, temperature=0)
    assert compiled_calls[0] == 0 and counters["stats"]["unique_graphs"] == 0
    assert torch.equal(tokens, eager.generate(prompt, max_new_tokens=TINY.max_seq_len - 4, temperature=0))


def test_flop_count_compiles_nothing(compiled_calls: list[int]) -> None:
    assert train_flops(compiled(TINY), (2, 16)) == train_flops(TINY, (2, 16))
    assert compiled_calls[0] == 0 and counters["stats"]["unique_graphs"] == 0


def test_a_bad_backend_is_refused_by_name_before_anything_runs() -> None:
    with pytest.raises(ValueError) as refused:
        compiled(TINY, backend="tensorrt")
    assert (
        str(refused.value) == f"model.compile_backend='tensorrt' is not one of {', '.join(COMPILE_BACKENDS)}"
    )
    with pytest.raises(
        ConfigError, match="model.compile_backend='tensorrt' is not one of inductor, aot_eager"
    ):
        validate(compose_pretrain(["model.compile_blocks=true", "model.compile_backend=tensorrt"]))
    assert validate(compose_pretrain(["model.compile_blocks=true"])).model.compile_backend == "inductor"


FIT_CASES = [
    {"stage": stage, "activation_checkpointing": ac, "compile_blocks": on}
    for stage, ac in ((2, True), (3, True), (3, False))
    for on in (False, True)
]


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    """results[rank][case] of one 2-rank launch of `FIT_CASES`, in order."""
    out = tmp_path_factory.mktemp("compile") / "result.pt"
    command = [sys.executable, "-m", "tests.recipes.compile_fit", "--out", str(out)]
    run = run_script([*command, "--cases", json.dumps(FIT_CASES)], 2, cwd=ROOT, env=launch_env(), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [torch.load(f"{out}.rank{rank}", weights_only=False) for rank in (0, 1)]
    for rank_results in results:
        for case, result in zip(FIT_CASES, rank_results, strict=True):
            assert "error" not in result, (case, result.get("traceback"))
    return results


def test_two_ranks_under_zero2_and_zero3_train_as_eager(fits: list[list[dict[str, Any]]]) -> None:
    for rank_results in fits:
        for i in range(0, len(FIT_CASES), 2):
            eager, result = rank_results[i], rank_results[i + 1]
            assert (eager["compiled_calls"], result["compiled_calls"]) == (
                0,
                STEPS * TINY.n_layer * (2 if FIT_CASES[i]["activation_checkpointing"] else 1),
            ), FIT_CASES[i + 1]
            torch.testing.assert_close(result["losses"], eager["losses"], atol=ATOL, rtol=0)
            assert list(result["state"]) == list(eager["state"])
            torch.testing.assert_close(result["state"], eager["state"], atol=ATOL, rtol=0)


def test_stage3_gathers_around_compiled_blocks_without_recompiling(fits: list[list[dict[str, Any]]]) -> None:
    """At stage 3 each block is a unit: its pre/post forward hooks stay outside the compiled graph, and
    parameters that are freed and gathered again (new views of the same flat buffer) still pass the
    graph's guards: the one graph compiled in the first step serves every later step and fit."""
    for rank_results in fits:
        for case, result in zip(FIT_CASES, rank_results, strict=True):
            assert result["block_hooks"] == ([2] * TINY.n_layer if case["stage"] == 3 else [0] * TINY.n_layer)
        graphs = [g for result in rank_results if result["compiled_calls"] for g in result["graphs"]]
        assert graphs, "no compiled fit"
        assert graphs[0] >= 1 and graphs == [graphs[0]] * len(graphs), graphs
