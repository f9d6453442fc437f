"""Tensor parallelism composed with data-parallel sharding, on CPU ranks (gloo, one thread each): the
same Megatron-style plan (``parallelize_module`` over the ``tensor`` dimension of a ``(data, tensor)``
mesh: sequence-parallel norms, column-parallel up projections, row-parallel down projections,
a column-parallel output layer) sharded over the ``data`` dimension by ``ShardedAdamW`` at stages 2
and 3, and by FSDP2 ``fully_shard`` per block with torch AdamW (torchtitan's composition), in one run.

    python benchmarks/tensor_parallel.py [--ranks 4] [--tensor 2] [--d-model 512] [--layers 4] [--steps 8]

Per mode it reports the median step time over the steps after the first two (forward, backward,
clipping at 1.0 and the optimizer step), its ratio to FSDP2's, and the model state each rank holds
between steps (parameters, gradients or gradient shards, optimizer state) against ``16 Psi / (T N_dp)``
bytes, fp32's ``4 + 4 + 8`` per parameter, fully sharded. Figures, not assertions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from local_ranks import launch_ranks  # this folder is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout, not another install

MODES = ("fsdp2", "zero2", "zero3")


def build(args: argparse.Namespace) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(args.d_model)
            self.up = nn.Linear(args.d_model, 4 * args.d_model)
            self.down = nn.Linear(4 * args.d_model, args.d_model)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(args.vocab, args.d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(args.layers))
            self.norm = nn.LayerNorm(args.d_model)
            self.head = nn.Linear(args.d_model, args.vocab)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.embed(tokens)
            for block in self.blocks:
                h = block(h)
            return self.head(self.norm(h))

    return Net()


def plan(layers: int) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    out: dict[str, Any] = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(layers):
        out[f"blocks.{i}.norm"] = SequenceParallel()
        out[f"blocks.{i}.up"] = ColwiseParallel(input_layouts=Shard(1))
        out[f"blocks.{i}.down"] = RowwiseParallel(output_layouts=Shard(1))
    return out


def _nbytes(tensors: Any) -> int:
    from lightning_zero.layout.local import local

    return sum(local(t).numel() * local(t).element_size() for t in tensors if t is not None)


def worker(mode: str, args: argparse.Namespace, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import lightning_zero
    from lightning_zero.comm import end_process_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    data = args.ranks // args.tensor
    mesh = init_device_mesh("cpu", (data, args.tensor), mesh_dim_names=("data", "tensor"))
    torch.manual_seed(0)
    model = parallelize_module(build(args), mesh["tensor"], plan(args.layers))
    psi = sum(p.numel() for p in model.parameters())  # global numbers of the DTensors
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh["data"])
        fully_shard(model, mesh=mesh["data"])
        opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        config = lightning_zero.ZeroConfig(stage=int(mode[-1]))
        opt = lightning_zero.ShardedAdamW(
            model.parameters(), lr=1e-4, config=config, device_mesh=mesh["data"], module=model
        )
    g = torch.Generator().manual_seed(mesh["data"].get_local_rank())
    step_s = []
    for _ in range(args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        dist.barrier()
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        if mode == "fsdp2":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        step_s.append(time.perf_counter() - start)
    if mode == "fsdp2":  # sharded parameters; gradients freed by zero_grad(); AdamW's moments
        moments = [t for state in opt.state.values() for t in state.values() if t.ndim > 0]
        state = _nbytes(model.parameters()) + _nbytes(moments)
        grads = _nbytes(model.parameters())  # what the gradients take while they live (same shards)
    else:
        memory = opt.engine.memory()
        params = opt.engine.flat.shards if mode == "zero3" else list(opt.engine.flat.buffers.values())
        state = _nbytes(params) + memory.state_bytes
        grads = memory.grad_shard_bytes
    result = {"step_s": statistics.median(step_s[2:]), "model_state_bytes": state + grads, "psi": psi}
    if dist.get_rank() == 0:
        out.write_text(json.dumps(result))
    end_process_group()


def launch(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    return launch_ranks(__file__, args.ranks, [mode], mode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tensor", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args, args.out)
        return
    results = {mode: launch(mode, args) for mode in MODES}
    data = args.ranks // args.tensor
    psi = results["fsdp2"]["psi"]
    ideal = 16 * psi / (args.tensor * data)
    print(f"{psi / 1e6:.1f}M parameters, {args.ranks} ranks: tensor {args.tensor} x data {data}")
    print(f"{'mode':8} {'step s':>8} {'vs fsdp2':>9} {'state MB/rank':>14} {'vs 16Psi/(T N_dp)':>18}")
    for mode, r in results.items():
        print(
            f"{mode:8} {r['step_s']:8.3f} {r['step_s'] / results['fsdp2']['step_s']:9.2f} "
            f"{r['model_state_bytes'] / 2**20:14.1f} {r['model_state_bytes'] / ideal:18.2f}"
        )


if __name__ == "__main__":
    main()
