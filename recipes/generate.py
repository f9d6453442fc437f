"""Sample text from a checkpoint: `python -m recipes.generate CKPT prompt="Once upon" [key=value ...]`.

Options are given as `key=value` (like the Hydra overrides of `recipes.pretrain`) or as `--key value`:
`prompt` (default ""; an empty prompt starts from a newline), `max_new_tokens` (200), `temperature` (0.8;
0 = greedy), `top_k` (50; 0 = all tokens), `seed` (0), `tokenizer` (auto | byte | PATH, see
`recipes.checkpoints.load.find_tokenizer`), `device` (cpu | cuda, default cuda when available),
`no_cache` (recompute the context at every step instead of using the KV cache; for comparison).

Prints the prompt and its continuation, then one line of figures on stderr: the new tokens, the wall time
of the decoding loop and tokens/s (prefill included, model loading not).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from recipes.checkpoints import LoadError, check_vocabulary, find_tokenizer, hydra_style, load_module

EXIT_ERROR = 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m recipes.generate", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="checkpoint file or lightning-zero checkpoint directory")
    parser.add_argument("--prompt", default="")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default="auto")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-cache", action="store_true")
    args = parser.parse_args(hydra_style(argv))
    if args.max_new_tokens < 1 or args.temperature < 0 or args.top_k < 0:
        parser.error("max_new_tokens must be >= 1, temperature >= 0 and top_k >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    """Load, decode, print the text and the throughput (errors: one line, exit status 1)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        module = load_module(args.checkpoint)
        tokenizer = find_tokenizer(args.checkpoint, args.tokenizer)
        check_vocabulary(module, tokenizer)
    except LoadError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(EXIT_ERROR)
    model = module.model.to(args.device)
    prompt_ids = tokenizer.encode(args.prompt) or tokenizer.encode("\n")
    prompt = torch.tensor([prompt_ids], dtype=torch.long, device=args.device)  # (1, prompt_len)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    ids = model.generate(
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        generator=generator,
        use_cache=not args.no_cache,
    )
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    print(tokenizer.decode(ids[0].tolist()))
    cache = "no KV cache" if args.no_cache else "KV cache"
    rate = args.max_new_tokens / seconds
    print(f"{args.max_new_tokens} tokens in {seconds:.2f} s: {rate:.1f} tokens/s ({cache})", file=sys.stderr)


if __name__ == "__main__":
    main()
