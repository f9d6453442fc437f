"""Export a trained GPT as a Hugging Face `transformers` Llama: `python -m recipes.export CKPT OUT_DIR`.

OUT_DIR receives `config.json`, `generation_config.json`, `model.safetensors` (or
`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json` above `--max-shard-size`) and the
tokenizer (`tokenizer.json`, `tokenizer_config.json`), written into a temporary sibling directory that
replaces OUT_DIR only when complete; a non-empty OUT_DIR is kept unless `--force`. The conversion, the
fields that map and the ones refused, and the weight layout: `recipes.checkpoints.hf`.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

from recipes.checkpoints import ExportError, LoadError, export

EXIT_ERROR = 1


def parse_size(text: str) -> int:
    """Bytes in "2GB", "500MB", "10kB" (powers of 1000, as Hugging Face counts) or a plain number."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)[bB]?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MB, 1000000)")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}[match.group(2).lower()]
    return int(float(match.group(1)) * scale)


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, export, print what was written (errors: one line, exit status 1)."""
    parser = argparse.ArgumentParser(prog="python -m recipes.export", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="checkpoint file or lightning-zero checkpoint directory")
    parser.add_argument("out_dir", help="Hugging Face model directory to create")
    parser.add_argument(
        "--tokenizer", default="auto", help="auto (search the run directory), byte, or a path"
    )
    parser.add_argument(
        "--max-shard-size", type=parse_size, default="5GB", help="e.g. 5GB, 500MB (default 5GB)"
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: float32")
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    args = parser.parse_args(argv)
    try:
        files = export(
            args.checkpoint,
            args.out_dir,
            args.tokenizer,
            args.max_shard_size,
            getattr(torch, args.dtype) if args.dtype else None,
            args.force,
        )
    except (LoadError, ExportError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(EXIT_ERROR)
    print(f"wrote {Path(args.out_dir).resolve()}: {', '.join(files)}")
    print(
        "load with transformers: AutoModelForCausalLM.from_pretrained(OUT_DIR), AutoTokenizer.from_pretrained"
    )


if __name__ == "__main__":
    main()
