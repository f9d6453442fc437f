"""Which models complete a whole training life at a fixed memory budget: build, setup, 3 optimizer
steps, a save, and a resume (a new model, its setup, the checkpoint load, one more step), 4 ranks.

    python benchmarks/largest_lifecycle.py --probes ddp:6,ddp:10,zero3:30 [--budget-gib 11] [--ranks 4]
        [--d-model 1024] [--vocab 32768] [--steps 3]

Each probe ``STRATEGY:LAYERS`` is one launch of ``benchmarks/stage3_setup_memory.py``'s phases (the
recipe's GPT at that depth; ``"ddp"`` builds it whole on every rank, ``"zero3"`` under
``trainer.init_module(empty_init=True)``, initialized unit by unit into the shards) under
``largest_model.py``'s watchdog: the RSS summed over every rank, sampled every ``--poll-s``; over
``--budget-gib`` the launch is killed and the probe does not fit. Printed per probe: the parameters,
fits or not, the watchdog's peak, and (when it fits) each phase's peak RSS per rank. Then, for each
``"zero3"`` probe that fits, its parameters against the smallest ``"ddp"`` probe that does not: a
lower bound on how much larger a model ``"zero3"`` carries through the same life at the same budget.
Figures, not assertions.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # largest_model imports step_time as a top-level module
sys.path.insert(0, str(HERE.parent))
from largest_model import watch  # noqa: E402


def params_of(layers: int, args: argparse.Namespace) -> int:
    import torch

    from recipes.training.model import GPT, GPTConfig

    config = GPTConfig(
        vocab_size=args.vocab,
        max_seq_len=args.seq,
        n_layer=layers,
        n_head=args.d_model // 64,
        d_model=args.d_model,
        tie_embeddings=True,
    )
    with torch.device("meta"):
        return GPT(config).num_params()


def probe(strategy: str, layers: int, args: argparse.Namespace) -> dict:
    out = Path(args.out, f"{strategy}.layers{layers}")
    out.mkdir(parents=True, exist_ok=True)
    mode = "deferred" if strategy == "zero3" else "eager"
    for stale in out.glob("*.json"):
        stale.unlink()
    cmd = [sys.executable, str(HERE / "stage3_setup_memory.py"), "--launch", mode, "--out", str(out)]
    cmd += [f"--strategy={strategy}", f"--steps={args.steps}", f"--ranks={args.ranks}", f"--layers={layers}"]
    cmd += [f"--d-model={args.d_model}", f"--vocab={args.vocab}", f"--seq={args.seq}"]
    start = time.perf_counter()
    returncode, killed, peak = watch(cmd, out / "stderr.log", args)
    result = {
        "strategy": strategy,
        "layers": layers,
        "params": params_of(layers, args),
        "peak_gib": peak / 2**30,
        "seconds": time.perf_counter() - start,
        "fits": not killed and returncode == 0,
        "why": killed or (f"exit status {returncode}" if returncode else "ok"),
    }
    if result["fits"]:
        ranks = [json.loads((out / f"{mode}.rank{r}.json").read_text()) for r in range(args.ranks)]
        names = list(ranks[0]["phases"])
        result["phases"] = {n: max(r["phases"][n] for r in ranks) for n in names}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--probes", required=True, help="comma-separated STRATEGY:LAYERS (ddp or zero3)")
    parser.add_argument("--budget-gib", type=float, default=11.0, help="RSS summed over the ranks")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--poll-s", type=float, default=0.1)
    parser.add_argument("--probe-timeout-s", type=float, default=3600.0)
    parser.add_argument("--out", default="benchmarks/results/largest_lifecycle")
    args = parser.parse_args()
    probes = []
    for item in args.probes.split(","):
        strategy, _, layers = item.partition(":")
        if strategy not in ("ddp", "zero3") or not layers.isdigit():
            parser.error(f"--probes: {item!r} is not STRATEGY:LAYERS with STRATEGY ddp or zero3")
        probes.append((strategy, int(layers)))
    print(
        f"recipe GPT d_model={args.d_model} vocab={args.vocab} seq={args.seq}, {args.ranks} ranks, "
        f"fp32 AdamW; life: build, setup, {args.steps} steps, save, resume (setup, load, 1 step); "
        f"budget {args.budget_gib} GiB summed over the ranks",
        flush=True,
    )
    results = []
    for strategy, layers in probes:
        r = probe(strategy, layers, args)
        results.append(r)
        outcome = "fits" if r["fits"] else r["why"]
        print(
            f"\n{strategy} {layers} layers, {r['params'] / 1e6:.1f}M params: {outcome} "
            f"(watchdog peak {r['peak_gib']:.2f} GiB, {r['seconds']:.0f} s)",
            flush=True,
        )
        for name, mb in r.get("phases", {}).items():
            print(f"  {name}: {mb:.0f} MB per rank", flush=True)
    failing_ddp = [r["params"] for r in results if r["strategy"] == "ddp" and not r["fits"]]
    for r in results:
        if r["strategy"] == "zero3" and r["fits"] and failing_ddp:
            ratio = r["params"] / min(failing_ddp)
            print(
                f"\nzero3 completed the life at {r['params'] / 1e6:.1f}M parameters; ddp did not at "
                f"{min(failing_ddp) / 1e6:.1f}M: zero3 carries at least {ratio:.2f}x ddp's largest here"
            )


if __name__ == "__main__":
    main()
