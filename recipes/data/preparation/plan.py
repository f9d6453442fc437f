"""What a token directory is prepared from, and taking possession of it.

`PrepareConfig` is what the user asked (`python -m recipes.prepare` arguments). Its plan record -
format, inputs' fingerprint (paths, sizes, modification times), tokenizer (kind and file sha256, or the
BPE settings), end-of-document token, text field, validation fraction, unit size - is written to
`DIR/.plan.json` before any shard. A later run into the same directory must ask for exactly the same
plan, else it is refused naming what differs; a non-empty directory without a plan is not ours and is
refused too. Nothing here ever deletes or overwrites a user's file. The tokenizer is copied into the
directory (or BPE trained there) so the directory is self-contained for every node that reads it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recipes.data.errors import DataError
from recipes.data.preparation.documents import HFSource, Unit, read_piece
from recipes.data.shards import FORMAT, file_sha256, temporary_name
from recipes.data.tokenizer import Document, TokenizerSpec, train_bpe

PLAN_NAME = ".plan.json"


class PrepareError(DataError):
    """A preparation that cannot run; the message names the setting or directory."""


@dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    """What to tokenize, with what, and where to."""

    out: str
    """Output directory (created; refused if it holds another preparation or foreign files)."""
    inputs: tuple[str, ...] = ()
    """Local text / .jsonl / .parquet files, directories or globs, in order."""
    dataset: str | None = None
    """A `datasets.load_dataset` name or builder (`json`, `parquet`, `text`, a hub name) instead of inputs."""
    dataset_config: str | None = None
    """Its configuration name."""
    data_files: tuple[str, ...] = ()
    """Its `data_files`."""
    split: str = "train"
    """Its split."""
    text_field: str = "text"
    """Field holding the text in .jsonl, .parquet and datasets rows."""
    tokenizer: str = "byte"
    """"byte", "bpe" (trained on the corpus), or a tokenizer.json / .model / .tiktoken file or directory."""
    eos_token: str | None = None
    """End-of-document token, overriding the tokenizer's own."""
    bpe_vocab_size: int = 4096
    """Vocabulary of a trained BPE."""
    bpe_train_mb: float = 256.0
    """Text (from the start of the corpus) that BPE is trained on."""
    val_fraction: float = 0.01
    """Fraction of documents held out for validation."""
    shard_mb: float = 64.0
    """Input MB per unit (one train + one validation shard each)."""
    workers: int = 1
    """Processes tokenizing units in parallel."""
    verify: bool = True
    """Check the sha256 of shards before reusing them (else their size only)."""
    progress: bool = True
    """Show a progress bar and print the summary."""

    def __post_init__(self) -> None:
        if bool(self.inputs) == (self.dataset is not None):
            raise PrepareError("give input files/directories/globs or --dataset, exactly one of the two")
        if not 0.0 <= self.val_fraction < 1.0:
            raise PrepareError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.shard_mb <= 0 or self.workers < 1 or self.bpe_train_mb <= 0:
            raise PrepareError("shard_mb and bpe_train_mb must be > 0 and workers >= 1")


def plan_record(config: PrepareConfig, fingerprint: str, tokenizer: TokenizerSpec | None) -> dict[str, Any]:
    """What the directory is prepared from; a re-run must ask for exactly the same.

    `fingerprint` is `source_fingerprint` of the inputs, `tokenizer` the resolved spec (None: BPE).
    """
    if tokenizer is None:
        tokenizer_id = f"bpe-{config.bpe_vocab_size}-{config.bpe_train_mb}"
    elif tokenizer.path is None:
        tokenizer_id = tokenizer.kind
    else:
        tokenizer_id = f"{tokenizer.kind}-{file_sha256(Path(tokenizer.path))}"
    return {
        "format": FORMAT,
        "source": fingerprint,
        "tokenizer": tokenizer_id,
        "eos_token": config.eos_token,
        "text_field": config.text_field,
        "val_fraction": config.val_fraction,
        "shard_mb": config.shard_mb,
    }


def plan_key(plan: dict[str, Any]) -> str:
    """Short stable hash of a plan record (names cache directories)."""
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:20]


def claim_directory(out: Path, plan: dict[str, Any]) -> None:
    """Create `out` for `plan`, or accept it if it was prepared (or is being prepared) for the same plan.

    Several processes may claim at once (the local rank 0 of every node, on shared storage): the plan
    file is created exclusively (`os.link`), the first one wins and the others compare against it.

    Raises:
        PrepareError: `out` holds another preparation (naming what differs) or files that are not ours.
    """
    plan_path = out / PLAN_NAME
    if not plan_path.is_file():
        ours = (PLAN_NAME, f".{PLAN_NAME}.tmp")
        if out.exists() and (not out.is_dir() or any(not p.name.startswith(ours) for p in out.iterdir())):
            raise PrepareError(f"{out} exists and was not written by recipes.prepare; choose another --out")
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / temporary_name(PLAN_NAME)
        tmp.write_text(json.dumps(plan, indent=1, sort_keys=True) + "\n")
        try:
            os.link(tmp, plan_path)  # fails if another process claimed first
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    previous = json.loads(plan_path.read_text())
    differs = sorted(k for k in plan.keys() | previous.keys() if plan.get(k) != previous.get(k))
    if differs:
        raise PrepareError(
            f"{out} was prepared with other settings ({', '.join(differs)} differ: the inputs, the "
            "tokenizer or the split); refusing to overwrite it. Choose another --out or delete it."
        )


def tokenizer_into_dir(
    config: PrepareConfig,
    spec: TokenizerSpec | None,
    out: Path,
    units: list[Unit],
    files_source: HFSource | None,
) -> TokenizerSpec:
    """Copy the tokenizer file into `out` (or train BPE there); the spec every worker loads."""
    if spec is None:  # --tokenizer bpe
        path = out / "tokenizer.json"
        if not path.is_file():
            budget = int(config.bpe_train_mb * 2**20)

            def sample() -> Iterator[Document]:
                seen = 0
                for piece in (p for unit in units for p in unit):
                    for document in read_piece(piece, config.text_field, files_source):
                        if seen >= budget:
                            return
                        seen += len(document)
                        yield document

            train_bpe(sample(), config.bpe_vocab_size, path)
        return TokenizerSpec("hf", str(path), config.eos_token)
    if spec.path is None:
        return spec
    source = Path(spec.path)
    name = {"hf": "tokenizer.json", "sentencepiece": "tokenizer.model"}.get(spec.kind, source.name)
    if not (out / name).is_file() or file_sha256(out / name) != file_sha256(source):
        tmp = out / temporary_name(name)
        shutil.copyfile(source, tmp)
        os.replace(tmp, out / name)
    return dataclasses.replace(spec, path=str(out / name))
