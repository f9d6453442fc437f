"""Loss and perplexity of a checkpoint on held-out tokens: `python -m recipes.evaluate CKPT [data=NAME]
[data.KEY=VALUE ...] [key=value ...]`.

CKPT is a Lightning checkpoint file, a lightning-zero sharded checkpoint directory, or a run directory
(`outputs/<run_name>`: its newest checkpoint, `checkpoints/*.ckpt` or `*.ckpt`, by modification time).
The data is the run's own (`data` of `<run_dir>/config.yaml`, found beside the checkpoint as
`recipes.checkpoints.load` finds the tokenizer) unless `data=NAME` starts from `conf/data/NAME.yaml`
instead; either way `data.KEY=VALUE` overrides single keys, checked like the recipe's (an unknown key or
a wrong type is an error naming it). The split is the data module's: `split=val` (default; the held-out
documents, or a `.bin`'s tail) or `split=train`, read in order as non-overlapping windows of
`data.seq_len` tokens, `data.batch_size` windows per batch; `limit_batches=N` stops after N batches
(0: all).

Refused before evaluating, naming both sides: data whose tokenizer is not the one the checkpoint was
trained with (its identity - kind, file hash, end-of-document id - against the run's tokenizer; a bare
checkpoint file without a run directory can only get the vocabulary check), token ids the model cannot
embed, `data.seq_len` above the model's context. A BPE trained on the fly (`data.tokenizer=bpe`) is
only known after preparation, so it is compared then.

Prints a progress bar on stderr, then one line on stdout: the mean cross-entropy per token (nats),
`perplexity = exp(loss)`, the tokens counted and the rate. Over the whole validation split this is the
`val/loss` and `val/ppl` a one-process `recipes.pretrain` logs (Lightning averages its per-batch means
weighted by batch size; every window has `seq_len` tokens, so both are the per-token mean). One process,
`device=cpu|cuda`, fp32. The checks and the loop: `recipes.checkpoints.evaluation`.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.utils.data import DataLoader

from recipes.checkpoints import LoadError, evaluate_loss, hydra_style, load_checked
from recipes.data import DataError

EXIT_ERROR = 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m recipes.evaluate", description=__doc__.split("\n")[0])
    parser.add_argument(
        "checkpoint", help="checkpoint file, lightning-zero checkpoint directory or run directory"
    )
    parser.add_argument("overrides", nargs="*", metavar="data.KEY=VALUE", help="data settings")
    parser.add_argument("--data", help="a conf/data/ config to start from instead of the run's own data")
    parser.add_argument("--split", choices=("val", "train"), default="val")
    parser.add_argument("--limit-batches", type=int, default=0, help="evaluate the first N batches (0: all)")
    parser.add_argument("--tokenizer", default="auto", help="the checkpoint's: auto | byte | PATH")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_intermixed_args(hydra_style(argv))
    if args.limit_batches < 0:
        parser.error(f"limit_batches must be >= 0 (0: all batches), got {args.limit_batches}")
    return args


def main(argv: list[str] | None = None) -> None:
    """Load, check, evaluate, print one line (errors: one line, exit status 1)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        checkpoint, datamodule, module = load_checked(
            args.checkpoint, args.data, args.overrides, args.tokenizer
        )
    except (LoadError, DataError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(EXIT_ERROR)
    dataset = datamodule.val_set if args.split == "val" else datamodule.train_set
    assert dataset is not None, "set by setup()"
    config = datamodule.config
    print(
        f"evaluating {checkpoint} on the {args.split} split of {config.path or 'the stdlib corpus'}: "
        f"{len(dataset):,} windows of {config.seq_len} tokens",
        file=sys.stderr,
    )
    loader = DataLoader(dataset, batch_size=config.batch_size, num_workers=config.num_workers)
    device = torch.device(args.device)
    result = evaluate_loss(module.model.to(device), loader, device, args.limit_batches)
    print(
        f"{args.split}: loss {result.loss:.6f} nats/token, perplexity {result.perplexity:.6g} over "
        f"{result.tokens:,} tokens ({result.windows:,} windows of {config.seq_len}) "
        f"in {result.seconds:.2f} s ({result.tokens / result.seconds:,.0f} tokens/s)"
    )


if __name__ == "__main__":
    main()
