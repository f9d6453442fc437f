"""Tokenize a corpus once into a directory of token shards: `python -m recipes.prepare INPUT... --out DIR`.

    python -m recipes.prepare 'corpus/**/*.jsonl' --out data/tok --tokenizer path/to/tokenizer.json
    python -m recipes.prepare --dataset json --data-files 'a/*.jsonl' --out data/tok --tokenizer byte
    python -m recipes.prepare --verify data/tok          # sha256 of every shard against the index
    python -m recipes.pretrain data=tokens data.path=data/tok

Steps: resolve and check the inputs and the tokenizer (every bad value fails here, before any work,
naming it) -> claim DIR (`.plan.json` records what was asked; a directory prepared from other inputs
or with another tokenizer or settings is refused, never overwritten) -> train BPE on the corpus if
`--tokenizer bpe` -> tokenize the units (`recipes.sources`) in `--workers` processes, each unit into
its own train and validation shard -> write `index.json` last (`recipes.shards` has the format).

Parallelism and determinism: units are fixed by the inputs and `--shard-mb`; unit `i` always writes
`train-i.bin` and `val-i.bin` with the same bytes, so 1 and N processes give identical directories.
Validation split: by documents; document `j` of unit `i` is held out when
`floor((j + 1) * f + u_i) > floor(j * f + u_i)`, with `f` = `--val-fraction` and `u_i` in [0, 1) a
hash of `i`: every `1/f`-th document of each unit, at a pseudo-random phase - exactly `f` in expectation
(`u_0 = 1 - f`: the first document of the corpus is always held out, so even a small corpus has one).

Idempotence: shards are written under temporary names and renamed; each finished unit leaves
`.units/NNNNN.json`. A re-run skips every unit whose shards are present with their recorded size and
sha256 (`--no-verify`: size only), rebuilds the others (e.g. a deleted shard) and rewrites the index.

Memory: each process holds one batch of documents and its token ids, never a unit or the corpus.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from recipes.corpus import CorpusError
from recipes.prepare_plan import (
    PrepareConfig,
    PrepareError,
    claim_directory,
    plan_key,
    plan_record,
    tokenizer_into_dir,
)
from recipes.prepare_units import UnitResult, UnitTask, limit_threads, reusable_result, run_unit
from recipes.shards import (
    INDEX_NAME,
    ShardError,
    TokenIndex,
    read_index,
    token_dtype,
    verify_shards,
    write_json_atomic,
)
from recipes.sources import (
    HFSource,
    Unit,
    check_files,
    check_hf,
    plan_file_units,
    plan_hf_units,
    resolve_files,
    source_fingerprint,
)
from recipes.tokenizer import (
    Tokenizer,
    TokenizerError,
    TokenizerSpec,
    load_tokenizer_spec,
    resolve_tokenizer,
)

EXIT_ERROR = 2


@dataclass(frozen=True)
class PrepareSummary:
    """What `prepare` did."""

    directory: Path
    index: TokenIndex
    units: int
    reused_units: int
    new_tokens: int
    elapsed_s: float

    def line(self) -> str:
        tokens, docs = self.index.tokens, self.index.documents
        rate = (
            f"{self.new_tokens / max(self.elapsed_s, 1e-9):,.0f} tokens/s"
            if self.new_tokens
            else "nothing new"
        )
        return (
            f"prepared {self.directory}: {docs['train'] + docs['val']:,} documents "
            f"({docs['train']:,} train / {docs['val']:,} val), {tokens['train'] + tokens['val']:,} tokens "
            f"({tokens['train']:,} / {tokens['val']:,}), {len(self.index.shards)} shards of "
            f"{self.index.dtype}, {rate} in {self.elapsed_s:.1f} s; "
            f"{self.reused_units} of {self.units} units reused"
        )


def _run_units(tasks: list[UnitTask], workers: int, progress: bool, total_nbytes: int) -> list[UnitResult]:
    """Run every task, in this process or in a pool, updating a progress bar as units finish."""
    from tqdm.auto import tqdm

    bar = tqdm(
        total=total_nbytes or len(tasks),
        unit="B" if total_nbytes else "unit",
        unit_scale=True,
        desc="tokenizing",
        disable=not progress,
        dynamic_ncols=True,
    )
    results: list[UnitResult] = []
    tokens, start = 0, time.perf_counter()

    def done(result: UnitResult) -> None:
        nonlocal tokens
        results.append(result)
        tokens += 0 if result.reused else sum(s.tokens for s in result.shards)
        bar.update(result.nbytes if total_nbytes else 1)
        bar.set_postfix(tokens_per_s=f"{tokens / max(time.perf_counter() - start, 1e-9):,.0f}", refresh=False)

    try:
        pending = []
        for task in tasks:  # reuse checks here: sizes (and sha256) are cheap next to tokenizing
            reused = reusable_result(task)
            if reused is None:
                pending.append(task)
            else:
                done(reused)
        if workers == 1 or len(pending) <= 1:
            for task in pending:
                done(run_unit(task))
        else:
            context = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
            with ProcessPoolExecutor(
                min(workers, len(pending)), mp_context=context, initializer=limit_threads
            ) as pool:
                for future in as_completed([pool.submit(run_unit, task) for task in pending]):
                    done(future.result())
    finally:
        bar.close()
    return sorted(results, key=lambda r: r.index)


def _resolve(config: PrepareConfig) -> tuple[list[Unit], HFSource | None, str, str, TokenizerSpec | None]:
    """Inputs -> units, and the tokenizer spec (None for BPE still to train); every check before work."""
    hf_source = None
    if config.dataset is not None:
        hf_source = HFSource(config.dataset, config.dataset_config, tuple(config.data_files), config.split)
        check_hf(hf_source, config.text_field)
        units, files = plan_hf_units(hf_source), []
        description = f"datasets.load_dataset({config.dataset!r}, split={config.split!r})"
    else:
        files = resolve_files(tuple(config.inputs))
        check_files(files, config.text_field)
        units = plan_file_units(files, max(1, int(config.shard_mb * 2**20)))
        more = f", ... ({len(config.inputs)} inputs)" if len(config.inputs) > 3 else ""
        shown = ", ".join(config.inputs[:3]) + more
        description = f"{shown} ({len(files)} files)"
    if not units:
        raise CorpusError(f"the inputs hold no text: {description}")
    spec = None
    if config.tokenizer != "bpe":
        spec = resolve_tokenizer(config.tokenizer, config.eos_token)
        loaded = load_tokenizer_spec(spec)  # fails now on a bad file or a missing end-of-document token
        if spec.kind == "hf":  # the copy in the output directory has no tokenizer_config.json beside it
            spec = dataclasses.replace(spec, eos_token=loaded.eos_token)  # type: ignore[attr-defined]
    return units, hf_source, description, source_fingerprint(files, hf_source), spec


def prepare(config: PrepareConfig) -> PrepareSummary:
    """Tokenize `config`'s inputs into `config.out` (see the module docstring); idempotent.

    Raises:
        CorpusError, TokenizerError, PrepareError: a bad input, tokenizer or output directory, before
            any shard is written.
    """
    start = time.perf_counter()
    units, hf_source, description, fingerprint, spec = _resolve(config)
    out = Path(config.out).expanduser()
    plan = plan_record(config, fingerprint, spec)
    claim_directory(out, plan)
    spec = tokenizer_into_dir(config, spec, out, units, hf_source)
    tokenizer = load_tokenizer_spec(spec)
    dtype = token_dtype(tokenizer.vocab_size)
    tasks = [
        UnitTask(
            i,
            unit,
            str(out),
            spec,
            dtype.name,
            config.val_fraction,
            config.text_field,
            hf_source,
            config.verify,
            plan_key({"unit": repr(unit), "tokenizer": tokenizer.identity, **plan}),
        )
        for i, unit in enumerate(units)
    ]
    total_nbytes = sum(p.nbytes for unit in units for p in unit)
    results = _run_units(tasks, config.workers, config.progress, total_nbytes)
    shards = tuple(s for r in results for s in r.shards)
    index = TokenIndex(
        dtype=dtype.name,
        tokenizer={
            "kind": spec.kind,
            "file": None if spec.path is None else Path(spec.path).name,
            "eos_token": spec.eos_token,
            "identity": tokenizer.identity,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
        },
        max_token_id=max((s.max_token_id for s in shards), default=-1),
        documents={s: sum(r.documents[s] for r in results) for s in ("train", "val")},
        tokens={s: sum(x.tokens for x in shards if x.split == s) for s in ("train", "val")},
        val_fraction=config.val_fraction,
        source={"description": description, "fingerprint": fingerprint, "units": len(units)},
        shards=shards,
    )
    write_json_atomic(out / INDEX_NAME, index.to_json())
    summary = PrepareSummary(
        directory=out,
        index=index,
        units=len(units),
        reused_units=sum(r.reused for r in results),
        new_tokens=sum(s.tokens for r in results if not r.reused for s in r.shards),
        elapsed_s=time.perf_counter() - start,
    )
    if config.progress:
        print(summary.line(), flush=True)
    return summary


def tokenizer_from_dir(directory: str | Path, index: TokenIndex | None = None) -> Tokenizer:
    """The tokenizer recorded in a prepared directory's index (its file is inside the directory)."""
    index = index if index is not None else read_index(directory)
    info = index.tokenizer
    path = None if info["file"] is None else str(Path(directory).expanduser() / info["file"])
    return load_tokenizer_spec(TokenizerSpec(info["kind"], path, info["eos_token"]))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m recipes.prepare",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "inputs", nargs="*", help="text / .jsonl / .parquet files, directories or quoted globs"
    )
    parser.add_argument("--out", help="output directory")
    parser.add_argument(
        "--verify", metavar="DIR", help="check every shard of DIR against its sha256; no preparing"
    )
    parser.add_argument("--dataset", help="datasets.load_dataset name or builder (json, parquet, text, ...)")
    parser.add_argument("--dataset-config", help="its configuration name")
    parser.add_argument("--data-files", nargs="+", default=[], help="its data_files")
    parser.add_argument("--split", default="train", help="its split")
    parser.add_argument("--text-field", default="text", help="field of .jsonl/.parquet/datasets rows")
    parser.add_argument(
        "--tokenizer", default="byte", help="byte | bpe | tokenizer.json | .model | .tiktoken | DIR"
    )
    parser.add_argument("--eos-token", help="end-of-document token (default: the tokenizer's own)")
    parser.add_argument("--bpe-vocab-size", type=int, default=4096, help="with --tokenizer bpe")
    parser.add_argument("--bpe-train-mb", type=float, default=256.0, help="text BPE is trained on")
    parser.add_argument("--val-fraction", type=float, default=0.01, help="fraction of documents held out")
    parser.add_argument("--shard-mb", type=float, default=64.0, help="input MB per unit of work / shard")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes")
    parser.add_argument("--no-verify", action="store_true", help="reuse shards after a size check only")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (2 on a bad input)."""
    args = _parser().parse_args(argv)
    try:
        if args.verify is not None:
            bad = verify_shards(args.verify)
            print(
                f"{args.verify}: "
                + (f"{len(bad)} bad shard(s): {', '.join(bad)}" if bad else "all shards intact")
            )
            return 1 if bad else 0
        if args.out is None:
            raise PrepareError("--out DIR is required")
        config = PrepareConfig(
            out=args.out,
            inputs=tuple(args.inputs),
            dataset=args.dataset,
            dataset_config=args.dataset_config,
            data_files=tuple(args.data_files),
            split=args.split,
            text_field=args.text_field,
            tokenizer=args.tokenizer,
            eos_token=args.eos_token,
            bpe_vocab_size=args.bpe_vocab_size,
            bpe_train_mb=args.bpe_train_mb,
            val_fraction=args.val_fraction,
            shard_mb=args.shard_mb,
            workers=args.workers,
            verify=not args.no_verify,
            progress=not args.quiet,
        )
        prepare(config)
    except (CorpusError, TokenizerError, PrepareError, ShardError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
