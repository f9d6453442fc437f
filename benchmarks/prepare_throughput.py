"""Data preparation throughput, its peak memory, and the loader's rate against the training step's need.

    python benchmarks/prepare_throughput.py [--mb 200] [--workers 1 2] [--tokenizers byte bpe]

1. Generates a corpus of at least `--mb` MB of text from the embedded source (the standard library's
   `.py` files, every one of them, repeated and shuffled with a fixed seed) as `.jsonl` files in a
   temporary directory (one document per row).
2. Runs `python -m recipes.prepare` on it once per tokenizer and worker count, each into a fresh
   directory, and prints wall time, tokens/s, input MB/s and peak RSS, of the largest single process
   and of the whole process tree (main process + workers), both sampled from /proc every 50 ms.
   `bpe` is a byte-level BPE of 4096 ids trained beforehand on 16 MB of the corpus (not timed).
3. Reads windows of the default recipe (`seq_len` 256, batch 8, shuffled) from the byte-tokenized
   shards with the recipe's DataLoader, one process, and prints samples/s next to what the default
   recipe consumes per rank (`--recipe-tokens-per-s`, global, from `benchmarks/recipe_throughput.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))


def make_corpus(directory: Path, target_mb: float, n_files: int = 8) -> int:
    """Write >= `target_mb` MB of shuffled stdlib source into `n_files` .jsonl files; returns bytes."""
    from recipes.data.corpus import stdlib_corpus

    texts = [p.read_text(errors="replace") for p in stdlib_corpus(10_000).files]
    rng = random.Random(0)
    handles = [(directory / f"part{i:02d}.jsonl").open("w") for i in range(n_files)]
    written, row = 0, 0
    while written < target_mb * 2**20:
        rng.shuffle(texts)
        for text in texts:
            line = json.dumps({"text": text}) + "\n"
            handles[row % n_files].write(line)
            written += len(text.encode())
            row += 1
    for handle in handles:
        handle.close()
    return written


def tree_rss_bytes(pid: int) -> tuple[int, int]:
    """Resident memory of `pid` and all its descendants (sum, largest single process), from /proc."""
    total, largest, stack = 0, 0, [pid]
    while stack:
        current = stack.pop()
        try:
            with open(f"/proc/{current}/status") as handle:
                rss = next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmRSS"))
            total, largest = total + rss, max(largest, rss)
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as handle:
                    stack.extend(int(c) for c in handle.read().split())
        except (OSError, StopIteration):
            continue
    return total, largest


def run_prepare(corpus: Path, out: Path, tokenizer: str, workers: int) -> dict[str, float]:
    """One preparation in a subprocess: wall time, tokens, peak RSS (largest process, whole tree)."""
    cmd = [
        sys.executable,
        "-m",
        "recipes.prepare",
        str(corpus),
        "--out",
        str(out),
        "--tokenizer",
        tokenizer,
        "--workers",
        str(workers),
        "--quiet",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env)
    peak_tree = peak_process = 0

    def sample() -> None:
        nonlocal peak_tree, peak_process
        while proc.poll() is None:
            tree, largest = tree_rss_bytes(proc.pid)
            peak_tree, peak_process = max(peak_tree, tree), max(peak_process, largest)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    proc.wait()
    sampler.join()
    elapsed = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"prepare failed with status {proc.returncode}")
    index = json.loads((out / "index.json").read_text())
    return {
        "s": elapsed,
        "tokens": index["tokens"]["train"] + index["tokens"]["val"],
        "peak_process_mb": peak_process / 2**20,
        "peak_tree_mb": peak_tree / 2**20,
        "shards": len(index["shards"]),
    }


def loader_rate(directory: Path, seconds: float = 5.0) -> float:
    """Samples/s of the default recipe's training DataLoader over `directory` (one process)."""
    from recipes.data.config import DataConfig
    from recipes.data.module import PretrainDataModule

    datamodule = PretrainDataModule(
        DataConfig(path=str(directory), tokenizer=None, seq_len=256, batch_size=8)
    )
    datamodule.setup("fit")
    samples, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for x, _ in datamodule.train_dataloader():
            samples += len(x)
            if time.perf_counter() - start >= seconds:
                break
    return samples / (time.perf_counter() - start)


def train_bpe_file(corpus: Path, path: Path) -> None:
    from recipes.data.preparation.documents import plan_file_units, read_piece, resolve_files
    from recipes.data.tokenizer import train_bpe

    units = plan_file_units(resolve_files((str(corpus),)), 64 * 2**20)
    budget, seen = 16 * 2**20, 0

    def sample():
        nonlocal seen
        for piece in (p for unit in units for p in unit):
            for document in read_piece(piece, "text"):
                if seen >= budget:
                    return
                seen += len(document)
                yield document

    train_bpe(sample(), 4096, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokenizers", nargs="+", default=["byte", "bpe"])
    parser.add_argument(
        "--recipe-tokens-per-s",
        type=float,
        default=10_842.0,
        help="global tokens/s of the default recipe (README, recipe_throughput.py)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="prepare-bench-") as tmp:
        root = Path(tmp)
        (root / "corpus").mkdir()
        nbytes = make_corpus(root / "corpus", args.mb)
        print(
            f"corpus: {nbytes / 2**20:.0f} MB of text in 8 .jsonl files ({os.cpu_count()} CPUs)", flush=True
        )
        tokenizers = {"byte": "byte"}
        if "bpe" in args.tokenizers:
            train_bpe_file(root / "corpus", root / "bpe.json")
            tokenizers["bpe"] = str(root / "bpe.json")
        print(
            f"\n{'tokenizer':<10}{'workers':>8}{'s':>8}{'Mtokens':>9}{'tokens/s':>12}{'MB/s':>7}"
            f"{'peak RSS/process MB':>21}{'peak RSS/tree MB':>18}",
            flush=True,
        )
        for name in args.tokenizers:
            for workers in args.workers:
                out = root / f"out-{name}-{workers}"
                r = run_prepare(root / "corpus", out, tokenizers[name], workers)
                print(
                    f"{name:<10}{workers:>8}{r['s']:>8.1f}{r['tokens'] / 1e6:>9.1f}"
                    f"{r['tokens'] / r['s']:>12,.0f}"
                    f"{nbytes / 2**20 / r['s']:>7.1f}{r['peak_process_mb']:>21.0f}{r['peak_tree_mb']:>18.0f}",
                    flush=True,
                )
        rate = loader_rate(root / f"out-byte-{args.workers[0]}")
        need = args.recipe_tokens_per_s / 256 / 2
        print(
            f"\nloader (seq_len 256, batch 8, shuffled, 1 process): {rate:,.0f} samples/s; the default "
            f"recipe consumes {need:,.1f} samples/s per rank ({args.recipe_tokens_per_s:,.0f} tokens/s "
            "over 2 ranks): "
            f"{rate / need:,.0f}x headroom"
        )


if __name__ == "__main__":
    main()
