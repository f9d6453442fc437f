"""KV-cache decoding: the same logits and tokens as recomputing the context, and the generate CLI."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from recipes.data.tokenizer import ByteTokenizer
from recipes.generate import main
from recipes.training.model import GPT, GPTConfig, KVCache
from tests.recipes.tiny_fit import fit_tiny

CONFIG = GPTConfig(vocab_size=64, max_seq_len=24, n_layer=2, n_head=4, n_kv_head=2, d_model=32)


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG).eval()


def test_cached_decoding_gives_the_logits_of_full_recomputation(model: GPT) -> None:
    """A 5-token prefill, single tokens, then a 4-token chunk after a prefix (the shifted causal mask)."""
    torch.manual_seed(1)
    idx = torch.randint(0, 64, (2, 14))
    with torch.no_grad():
        full = model(idx)  # (2, 14, 64)
        cache = KVCache.empty(CONFIG, batch=2)
        pieces = [model(idx[:, :5], cache)]
        pieces += [model(idx[:, t : t + 1], cache) for t in range(5, 10)]
        pieces.append(model(idx[:, 10:], cache))
    assert cache.length == 14
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=0)


def test_greedy_tokens_with_and_without_cache_are_identical(model: GPT) -> None:
    """float64 so that no near-tie can flip an argmax; 30 new tokens cross max_seq_len=24 (the window
    path after the cache is full)."""
    double = GPT(CONFIG)
    double.load_state_dict(model.state_dict())
    double = double.double().eval()
    prompt = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    cached = double.generate(prompt, 30, temperature=0.0)
    recomputed = double.generate(prompt, 30, temperature=0.0, use_cache=False)
    assert cached.shape == (2, 35)
    assert torch.equal(cached, recomputed)
    sampled = [
        double.generate(
            prompt, 10, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(3), use_cache=c
        )
        for c in (True, False)
    ]
    assert torch.equal(sampled[0], sampled[1])


def test_cache_overflow_is_refused(model: GPT) -> None:
    cache = KVCache.empty(CONFIG, batch=1, capacity=6)
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long), cache)
        with pytest.raises(ValueError, match="KV cache's 6"):
            model(torch.zeros(1, 3, dtype=torch.long), cache)


def test_cli_prints_the_greedy_continuation_and_tokens_per_s(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = tmp_path / "tiny.ckpt"
    module = fit_tiny(str(checkpoint), strategy="auto", steps=1)
    capsys.readouterr()  # the fit's own output
    prompt = ByteTokenizer().encode("hi there")
    expected = module.model.generate(torch.tensor([prompt]), 12, temperature=0.0)[0].tolist()
    for extra in ([], ["--no-cache"]):
        main(
            [
                str(checkpoint),
                "prompt=hi there",
                "max_new_tokens=12",
                "temperature=0",
                "tokenizer=byte",
                *extra,
            ]
        )
        out, err = capsys.readouterr()
        assert out == ByteTokenizer().decode(expected) + "\n"
        assert re.search(r"12 tokens in [\d.]+ s: [\d.]+ tokens/s", err)
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing.ckpt")])
    assert f"checkpoint not found: {tmp_path / 'missing.ckpt'}" in capsys.readouterr().err
