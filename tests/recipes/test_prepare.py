"""`recipes.prepare`: token shards + index, identical for any number of processes, idempotent, every
input format, a validation split by documents, and bad input refused before any work."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from recipes.data.corpus import CorpusError
from recipes.data.preparation import PrepareConfig, PrepareError, prepare
from recipes.data.preparation.documents import SourceError
from recipes.data.preparation.units import is_val_document
from recipes.data.shards import TokenStream, read_index, tokenizer_from_dir, verify_shards
from recipes.data.tokenizer import TokenizerError
from recipes.prepare import main
from tests.recipes.conftest import LINES, write_jsonl, write_parquet

UNIT_MB = 1500 / 2**20  # ~1.5 kB units: a small corpus gives many shards


def text_corpus(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(LINES):
        (directory / f"doc{i:03d}.txt").write_text(text * 3)
    return directory


def config(out: Path, *inputs: Path | str, **kwargs: object) -> PrepareConfig:
    settings = {"shard_mb": UNIT_MB, "val_fraction": 0.1, "progress": False, **kwargs}
    return PrepareConfig(out=str(out), inputs=tuple(str(i) for i in inputs), **settings)  # type: ignore[arg-type]


def contents(directory: Path) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file() and p.name != ".plan.json"
    }


def stream(directory: Path, split: str) -> np.ndarray:
    index = read_index(directory)
    tokens = TokenStream(directory, index.split(split), index.dtype)
    return tokens[0 : len(tokens)]


def test_one_and_two_processes_write_identical_shards_and_index(
    tmp_path: Path, hf_tokenizer_file: Path
) -> None:
    corpus = text_corpus(tmp_path / "corpus")
    one = prepare(config(tmp_path / "one", corpus, tokenizer=str(hf_tokenizer_file)))
    two = prepare(config(tmp_path / "two", corpus, tokenizer=str(hf_tokenizer_file), workers=2))
    assert one.units == two.units >= 8
    assert contents(tmp_path / "one") == contents(tmp_path / "two")  # every shard, tokenizer copy and index
    index = read_index(tmp_path / "one")
    assert (
        index.dtype == "uint16" and index.tokenizer["kind"] == "hf" and index.tokenizer["eos_token"] == "</s>"
    )
    assert index.tokenizer["vocab_size"] == 300 and index.max_token_id < 300
    assert index.documents["train"] + index.documents["val"] == len(LINES)
    assert sum(s.tokens for s in index.shards) == index.tokens["train"] + index.tokens["val"]
    assert all(len(s.sha256) == 64 for s in index.shards) and verify_shards(tmp_path / "one") == []
    eos = tokenizer_from_dir(tmp_path / "one").eos_id
    assert (stream(tmp_path / "one", "train") == eos).sum() == index.documents["train"]  # one per document


def test_rerun_reuses_and_a_deleted_shard_is_rebuilt_alone(tmp_path: Path) -> None:
    corpus = text_corpus(tmp_path / "corpus")
    first = prepare(config(tmp_path / "out", corpus))
    before = contents(tmp_path / "out")
    again = prepare(config(tmp_path / "out", corpus))
    assert first.reused_units == 0 and again.reused_units == again.units and again.new_tokens == 0
    victim = tmp_path / "out" / "train-00003.bin"
    victim.unlink()
    (tmp_path / "out" / "train-00005.bin").write_bytes(b"\0" * len(before["train-00005.bin"]))  # same size
    mtimes = {
        p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("*.bin") if p.name != "train-00005.bin"
    }
    rebuilt = prepare(config(tmp_path / "out", corpus))
    assert rebuilt.reused_units == rebuilt.units - 2  # sha256 caught the altered one
    assert contents(tmp_path / "out") == before
    unchanged = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("*.bin") if p.name in mtimes}
    rewritten = {k for k in mtimes if unchanged.get(k) != mtimes[k]}
    assert rewritten <= {"train-00003.bin", "val-00003.bin", "val-00005.bin"}  # those units only


def test_another_tokenizer_or_input_into_a_prepared_directory_is_refused(
    tmp_path: Path, sp_model_file: Path
) -> None:
    corpus = text_corpus(tmp_path / "corpus")
    prepare(config(tmp_path / "out", corpus))
    before = contents(tmp_path / "out")
    with pytest.raises(PrepareError, match="tokenizer differ.*refusing to overwrite"):
        prepare(config(tmp_path / "out", corpus, tokenizer=str(sp_model_file)))
    (corpus / "doc000.txt").write_text("edited")
    with pytest.raises(PrepareError, match="source differ"):
        prepare(config(tmp_path / "out", corpus))
    assert contents(tmp_path / "out") == before
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(PrepareError, match="not written by recipes.prepare"):
        prepare(config(tmp_path / "mine", corpus))


def test_jsonl_parquet_and_datasets_inputs_give_the_same_tokens(tmp_path: Path) -> None:
    jsonl = write_jsonl(tmp_path / "docs.jsonl", LINES, field="content")
    parquet = write_parquet(tmp_path / "docs.parquet", LINES, field="content")
    text = {"text_field": "content", "val_fraction": 0.0}
    prepare(config(tmp_path / "a", jsonl, **text))
    prepare(config(tmp_path / "b", parquet, **text))
    prepare(
        PrepareConfig(
            out=str(tmp_path / "c"), dataset="json", data_files=(str(jsonl),), progress=False, **text
        )
    )
    expected = np.frombuffer("".join(t + "\n\n" for t in LINES).encode(), dtype=np.uint8)
    for name in "abc":
        assert np.array_equal(stream(tmp_path / name, "train"), expected), name
    assert read_index(tmp_path / "b").source["units"] > 1  # parquet row groups are units


def test_a_large_text_file_is_cut_at_lines_and_streamed(tmp_path: Path) -> None:
    big = tmp_path / "big.txt"
    big.write_text("".join(f"line {i}\n" for i in range(2000)))
    summary = prepare(config(tmp_path / "out", big, val_fraction=0.0))
    assert summary.units > 5
    tokens = bytes(stream(tmp_path / "out", "train").astype(np.uint8))
    assert tokens.replace(b"\n\n\n", b"\n") == big.read_bytes()  # every line once, cut only between lines


def test_validation_split_is_by_documents_and_fraction_is_respected() -> None:
    picks = [is_val_document(j, unit, 0.1) for unit in range(50) for j in range(40)]
    assert sum(picks) == pytest.approx(0.1 * len(picks), rel=0.05)
    assert is_val_document(0, 0, 0.01) and not any(is_val_document(j, 3, 0.0) for j in range(100))


@pytest.mark.parametrize(
    ("inputs", "kwargs", "error", "message"),
    [
        (["MISSING/*.txt"], {}, SourceError, "no file matches"),
        (
            ["JSONL"],
            {"text_field": "body"},
            SourceError,
            "no text field 'body' \\(found: 'content', 'meta'\\)",
        ),
        (["PARQUET"], {"text_field": "body"}, SourceError, "no text field 'body'"),
        (["JSONL"], {"tokenizer": "VOCAB", "text_field": "content"}, TokenizerError, "unknown type '.txt'"),
        (["EMPTY"], {}, CorpusError, "hold no text"),
    ],
)
def test_bad_input_is_refused_before_any_work(
    tmp_path: Path, inputs: list[str], kwargs: dict, error: type, message: str
) -> None:
    paths = {
        "MISSING": str(tmp_path / "missing"),
        "JSONL": str(write_jsonl(tmp_path / "d.jsonl", LINES[:3], field="content")),
        "PARQUET": str(write_parquet(tmp_path / "d.parquet", LINES[:3], field="content")),
        "VOCAB": str(tmp_path / "vocab.txt"),
        "EMPTY": str(tmp_path / "empty.txt"),
    }
    (tmp_path / "vocab.txt").write_text("a\n")
    (tmp_path / "empty.txt").write_text("")
    resolved = [next((i.replace(k, v) for k, v in paths.items() if k in i), i) for i in inputs]
    kwargs = {k: paths.get(v, v) for k, v in kwargs.items()}
    with pytest.raises(error, match=message):
        prepare(config(tmp_path / "out", *resolved, **kwargs))
    assert not (tmp_path / "out").exists()


def test_command_line_prints_a_summary_and_fails_with_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    corpus = text_corpus(tmp_path / "corpus")
    assert main([str(corpus), "--out", str(tmp_path / "out"), "--workers", "1", "--val-fraction", "0.1"]) == 0
    out = capsys.readouterr().out
    assert f"prepared {tmp_path / 'out'}: {len(LINES)} documents" in out and "tokens/s" in out
    assert json.loads((tmp_path / "out" / "index.json").read_text())["format"] == "lightning-zero-tokens-v1"
    assert main(["--verify", str(tmp_path / "out")]) == 0
    assert main([str(tmp_path / "nothing*"), "--out", str(tmp_path / "x")]) == 2
    assert "error: input" in capsys.readouterr().err


def test_two_preparations_of_one_directory_at_once_agree(tmp_path: Path) -> None:
    """What the local rank 0 of two nodes does with `data=text` on shared storage."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    corpus = text_corpus(tmp_path / "corpus")
    settings = config(tmp_path / "out", corpus)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / ".plan.json.tmpothernode-123").write_text("{}")  # another claim, in flight
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        summaries = list(pool.map(prepare, [settings, settings]))
    assert summaries[0].index == summaries[1].index
    assert verify_shards(tmp_path / "out") == []
    prepare(config(tmp_path / "alone", corpus))
    assert contents(tmp_path / "alone") == {
        k: v for k, v in contents(tmp_path / "out").items() if not k.startswith(".plan.json.tmp")
    }
