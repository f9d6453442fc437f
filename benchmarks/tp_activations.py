"""Activation memory per rank of the recipe's GPT with tensor + sequence parallelism against one rank.

    python benchmarks/tp_activations.py [--model tiny] [--tensor 2] [--batch 4] [--seq-len 256]

One forward of `recipes.training.model.GPT` (the `conf/model/<model>.yaml` shape, fp32, the byte
vocabulary when `vocab_size` is null) on `--batch` sequences, unsplit in one process and split by
`recipes.training.tensor_parallel.apply_tensor_parallel` over `--tensor` CPU ranks (gloo). What a
rank saves for backward is counted with `torch.autograd.graph.saved_tensors_hooks`: the bytes of the
distinct storages the autograd graph keeps (a `DTensor`'s local tensor), i.e. the activations of the
micro-batch, not the parameters (leaves are left out). Reported per rank, with the ratio to one rank
and to `1/T`. Figures, not assertions.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout, not another install


def model_config(name: str, seq_len: int) -> Any:
    import yaml

    from recipes.training.model import GPTConfig

    fields = yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml").read_text())["model"]
    fields.pop("_target_")
    fields["vocab_size"] = fields["vocab_size"] or 256
    fields["max_seq_len"] = max(fields["max_seq_len"], seq_len)
    return GPTConfig(**fields)


def saved_bytes(model: Any, idx: Any) -> int:
    """Bytes of the distinct non-parameter storages one forward saves for backward."""
    import torch
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    params = {p.to_local().data_ptr() if isinstance(p, DTensor) else p.data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if isinstance(local, AsyncCollectiveTensor):  # a collective's output still in flight: its buffer
            local = local.elem
        storage = local.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(idx)  # (B, T, vocab)
    del logits
    return sum(storages.values())


def run_rank(rank: int, args: argparse.Namespace, port: int, out: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from recipes.training.model import GPT
    from recipes.training.tensor_parallel import apply_tensor_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.tensor)
    config = model_config(args.model, args.seq_len)
    torch.manual_seed(0)
    model = GPT(config)
    apply_tensor_parallel(model, init_device_mesh("cpu", (args.tensor,), mesh_dim_names=("tensor_parallel",)))
    idx = torch.randint(0, config.vocab_size, (args.batch, args.seq_len))  # (B, T)
    out.put((rank, saved_bytes(model, idx)))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--tensor", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()

    import torch
    import torch.multiprocessing as mp

    from recipes.training.model import GPT

    config = model_config(args.model, args.seq_len)
    torch.manual_seed(0)
    whole = saved_bytes(GPT(config), torch.randint(0, config.vocab_size, (args.batch, args.seq_len)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=run_rank, args=(r, args, port, queue)) for r in range(args.tensor)]
    for proc in procs:
        proc.start()
    per_rank = dict(queue.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join()
    mib = 2**20
    print(
        f"model={args.model} ({config.n_layer} layers, d_model {config.d_model}, {config.n_head} heads, "
        f"vocab {config.vocab_size}), micro-batch {args.batch} x {args.seq_len} tokens, fp32"
    )
    print(f"  T=1: {whole / mib:.2f} MiB saved for backward")
    for rank, nbytes in sorted(per_rank.items()):
        print(
            f"  T={args.tensor} rank {rank}: {nbytes / mib:.2f} MiB = {nbytes / whole:.3f} of T=1 "
            f"(1/T = {1 / args.tensor:.3f})"
        )


if __name__ == "__main__":
    main()
