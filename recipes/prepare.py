"""Tokenize a corpus once into a directory of token shards: `python -m recipes.prepare INPUT... --out DIR`.

    python -m recipes.prepare 'corpus/**/*.jsonl' --out data/tok --tokenizer path/to/tokenizer.json
    python -m recipes.prepare --dataset json --data-files 'a/*.jsonl' --out data/tok --tokenizer byte
    python -m recipes.prepare --verify data/tok          # sha256 of every shard against the index
    python -m recipes.pretrain data=tokens data.path=data/tok

Steps: resolve and check the inputs and the tokenizer (every bad value fails here, before any work,
naming it) -> claim DIR (`.plan.json` records what was asked; a directory prepared from other inputs
or with another tokenizer or settings is refused, never overwritten) -> train BPE on the corpus if
`--tokenizer bpe` -> tokenize the units in `--workers` processes, each unit into its own train and
validation shard -> write `index.json` last. The pipeline is `recipes.data.preparation`; the directory
format, `recipes.data.shards`.

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
import os
import sys

from recipes.data import DataError, PrepareConfig, PrepareError, prepare, verify_shards

EXIT_ERROR = 2


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
    except DataError as error:  # a bad input, tokenizer, output directory or shard
        print(f"error: {error}", file=sys.stderr)
        return EXIT_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
