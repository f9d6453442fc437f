"""Models that leave the repo: `load_from_checkpoint` with no arguments, and the Hugging Face export.

Two checkpoints, trained a few steps: a lightning-zero sharded directory (tied embeddings, grouped-query
attention; written by a subprocess, since the "zero" strategy sets up a process group) and an ordinary
Lightning file (untied head, plain multi-head attention; `strategy="auto"` in this process). The export
of each is loaded by `transformers` and must give our logits on the same tokens in fp32.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from recipes.checkpoints.hf import ExportError, export, hf_tokenizer, llama_config
from recipes.checkpoints.load import LoadError, find_tokenizer, load_module
from recipes.data.tokenizer import ByteTokenizer, SentencePieceTokenizer, TiktokenTokenizer, train_bpe
from recipes.export import main
from recipes.training.model import GPTConfig
from recipes.training.module import PretrainModule
from tests.recipes.tiny_fit import TINY, fit_tiny

ROOT = Path(__file__).resolve().parents[2]
UNTIED = dataclasses.replace(TINY, n_kv_head=None, tie_embeddings=False, norm_eps=1e-6, rope_theta=500.0)
TEXTS = ["héllo wörld ✓", "def f(x):\n    return x  # ünïcode\n\nnext", "   spaces  and\ttabs "]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("ckpts")
    sharded, params = root / "sharded.ckpt", root / "params.pt"
    command = [
        sys.executable,
        "-m",
        "tests.recipes.tiny_fit",
        "--save",
        str(sharded),
        "--params-out",
        str(params),
    ]
    subprocess.run(command, cwd=ROOT, check=True, timeout=300, capture_output=True)
    assert (sharded / "meta.pt").is_file(), "not a sharded checkpoint directory"
    file = root / "plain.ckpt"
    module = fit_tiny(str(file), strategy="auto", config=UNTIED)
    return {
        "sharded": (sharded, TINY, torch.load(params)),
        "file": (file, UNTIED, {k: v.detach().clone() for k, v in module.state_dict().items()}),
    }


@pytest.mark.parametrize("kind", ["sharded", "file"])
def test_load_from_checkpoint_needs_no_arguments(kind: str, checkpoints: dict[str, Any]) -> None:
    path, config, params = checkpoints[kind]
    module = PretrainModule.load_from_checkpoint(path, map_location="cpu")
    assert module.model_config == config
    state = module.state_dict()
    assert state.keys() == params.keys()
    assert all(torch.equal(state[k], params[k]) for k in params)


@pytest.mark.parametrize(("kind", "max_shard_bytes"), [("sharded", 5 * 10**9), ("file", 20_000)])
def test_transformers_gives_our_logits(
    kind: str, max_shard_bytes: int, checkpoints: dict[str, Any], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    path, config, _ = checkpoints[kind]
    out = tmp_path / "hf"
    files = export(path, out, tokenizer_spec="byte", max_shard_bytes=max_shard_bytes)
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    if kind == "sharded":
        assert "model.safetensors" in files
    else:
        assert "model.safetensors.index.json" in files and "model-00002-of-" in " ".join(files)
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(theirs).__name__ == "LlamaForCausalLM"
    assert theirs.config.tie_word_embeddings == config.tie_embeddings
    ours = load_module(path).model
    idx = torch.randint(
        0, config.vocab_size, (2, config.max_seq_len), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, ours(idx), atol=1e-4, rtol=0)
    assert GenerationConfig.from_pretrained(out).eos_token_id is None  # bytes: no end-of-text token
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf")], "temporary directory left"


def test_tokenizers_round_trip_through_transformers(checkpoints: dict[str, Any], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    export(checkpoints["sharded"][0], tmp_path / "hf", tokenizer_spec="byte")
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in TEXTS:
        assert theirs(text)["input_ids"] == ByteTokenizer().encode(text)
        assert theirs.decode(ByteTokenizer().encode(text)) == text
    bpe = train_bpe(
        [t.encode() * 20 for t in TEXTS], vocab_size=300, path=tmp_path / "bpe" / "tokenizer.json"
    )
    hf_tokenizer(bpe).save_pretrained(tmp_path / "bpe_hf")
    theirs = AutoTokenizer.from_pretrained(tmp_path / "bpe_hf")
    assert theirs.eos_token == "<|endoftext|>"
    for text in TEXTS:
        assert theirs(text)["input_ids"] == bpe.encode(text)
        assert theirs.decode(bpe.encode(text)) == bpe.decode(bpe.encode(text)) == text


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml")))
def test_every_shipped_model_config_maps_to_llama(name: str) -> None:
    node = OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml")  # `# @package _global_`: under model
    fields = dict(OmegaConf.to_container(node.model))  # type: ignore[arg-type]
    fields.pop("_target_")
    config = GPTConfig(**{**fields, "vocab_size": fields["vocab_size"] or 256})
    hf = llama_config(config, bos_id=None, eos_id=None, dtype=torch.float32)
    assert (hf.hidden_size, hf.num_key_value_heads, hf.intermediate_size) == (
        config.d_model,
        config.kv_heads,
        config.hidden_dim,
    )
    assert hf.rope_parameters["rope_theta"] == config.rope_theta and hf.rms_norm_eps == config.norm_eps


def test_a_field_llama_lacks_is_refused_by_name() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class WithQKNorm(GPTConfig):
        qk_norm: bool = True

    config = WithQKNorm(vocab_size=256, max_seq_len=8, n_layer=1, n_head=2, d_model=8)
    with pytest.raises(ExportError, match="model.qk_norm has no Llama equivalent"):
        llama_config(config, bos_id=None, eos_id=None, dtype=torch.float32)


def test_bad_paths_fail_clearly_and_keep_out_dir(
    checkpoints: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.ckpt"
    with pytest.raises(LoadError, match=f"checkpoint not found: {missing}"):
        export(missing, tmp_path / "a")
    corrupt = tmp_path / "corrupt.ckpt"
    corrupt.write_bytes(b"not a checkpoint")
    with pytest.raises(LoadError, match=f"cannot read checkpoint {corrupt}"):
        export(corrupt, tmp_path / "a", tokenizer_spec="byte")
    old = tmp_path / "old.ckpt"  # what checkpoints held before the hyper-parameters were saved
    torch.save({"state_dict": checkpoints["file"][2]}, old)
    with pytest.raises(LoadError, match=f"{old} has no saved model config"):
        export(old, tmp_path / "a", tokenizer_spec="byte")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        main([str(checkpoints["sharded"][0]), str(busy), "--tokenizer", "byte"])
    assert exit_info.value.code == 1
    assert "busy exists and is not empty" in capsys.readouterr().err
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    main([str(checkpoints["sharded"][0]), str(busy), "--tokenizer", "byte", "--force"])
    assert "keep.txt" not in {p.name for p in busy.iterdir()} and (busy / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "corrupt.ckpt", "old.ckpt"]


def test_tokenizer_is_found_in_the_run_directory(tmp_path: Path) -> None:
    checkpoint = tmp_path / "run" / "checkpoints" / "last.ckpt"
    checkpoint.parent.mkdir(parents=True)
    with pytest.raises(LoadError, match="--tokenizer byte"):
        find_tokenizer(checkpoint)
    (tmp_path / "run" / "config.yaml").write_text("data:\n  tokenizer: byte\n")
    assert isinstance(find_tokenizer(checkpoint), ByteTokenizer)
    bpe = train_bpe([t.encode() for t in TEXTS], vocab_size=270, path=tmp_path / "run" / "tokenizer.json")
    assert find_tokenizer(checkpoint).identity == bpe.identity


def test_every_tokenizer_kind_is_found_for_a_run(
    hf_tokenizer_file: Path, sp_model_file: Path, tiktoken_file: Path, tmp_path: Path
) -> None:
    """A run with data.tokenizer=FILE (any kind) is found as training left it: the run's
    copy of the file (`TokenizerCopy`), else the configured path; a tokens run (data.tokenizer null)
    by the copied file alone; an explicit path of any kind; a missing one is named."""
    checkpoint = tmp_path / "sp" / "checkpoints" / "last.ckpt"
    checkpoint.parent.mkdir(parents=True)
    (tmp_path / "sp" / "config.yaml").write_text(f"data:\n  tokenizer: {sp_model_file}\n  eos_token: null\n")
    assert isinstance(find_tokenizer(checkpoint), SentencePieceTokenizer)
    assert find_tokenizer(checkpoint).path == sp_model_file  # no copy yet: the configured file
    copy = tmp_path / "sp" / sp_model_file.name
    copy.write_bytes(sp_model_file.read_bytes())
    assert find_tokenizer(checkpoint).path == copy  # the run's own copy first
    original = tmp_path / "elsewhere" / "custom.json"  # a tokenizer.json under another name
    original.parent.mkdir()
    original.write_bytes(hf_tokenizer_file.read_bytes())
    hf_checkpoint = tmp_path / "hf" / "checkpoints" / "last.ckpt"
    hf_checkpoint.parent.mkdir(parents=True)
    (tmp_path / "hf" / "config.yaml").write_text(f"data:\n  tokenizer: {original}\n")
    assert find_tokenizer(hf_checkpoint).path == original
    (tmp_path / "hf" / "custom.json").write_bytes(original.read_bytes())
    assert find_tokenizer(hf_checkpoint).path == tmp_path / "hf" / "custom.json"
    tokens_checkpoint = tmp_path / "tokens" / "checkpoints" / "step000010.ckpt"
    tokens_checkpoint.parent.mkdir(parents=True)
    (tmp_path / "tokens" / "config.yaml").write_text("data:\n  tokenizer: null\n")
    with pytest.raises(LoadError, match="--tokenizer byte"):
        find_tokenizer(tokens_checkpoint)
    (tmp_path / "tokens" / tiktoken_file.name).write_bytes(tiktoken_file.read_bytes())
    found = find_tokenizer(tokens_checkpoint)
    assert isinstance(found, TiktokenTokenizer) and found.vocab_size == 265
    assert isinstance(find_tokenizer(checkpoint, str(tiktoken_file)), TiktokenTokenizer)
    assert isinstance(find_tokenizer(checkpoint, str(sp_model_file)), SentencePieceTokenizer)
    with pytest.raises(LoadError, match="tokenizer file not found: .*nothing.model"):
        find_tokenizer(checkpoint, str(tmp_path / "nothing.model"))
    # export has no Hugging Face form for it: refused before the checkpoint (not one here) is read
    checkpoint.write_bytes(b"not read")
    with pytest.raises(ExportError, match="no Hugging Face equivalent known for the tokenizer Sentence"):
        export(checkpoint, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_dtype_casts_the_weights_and_the_config(checkpoints: dict[str, Any], tmp_path: Path) -> None:
    from safetensors import safe_open

    main([str(checkpoints["file"][0]), str(tmp_path / "hf"), "--tokenizer", "byte", "--dtype", "bfloat16"])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}  # noqa: SIM118
