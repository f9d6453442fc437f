"""Tensor parallelism on every rank (:func:`tests.distributed.harness.run_ranks`): a tiny sequence-
parallel transformer block, parallelized with torch's ``parallelize_module`` over the ``tensor``
dimension of a ``(data, tensor)`` mesh, trained by ``ShardedAdamW`` over the ``data`` dimension, against
one unsplit copy trained by ``torch.optim.AdamW`` on the whole global batch in this process."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import lightning_zero
from lightning_zero import ShardedAdamW, ZeroConfig
from lightning_zero.comm import tensor_groups
from lightning_zero.layout.dims import ParallelDims

VOCAB, DIM, HIDDEN, SEQ, MICRO = 16, 8, 32, 8, 2


def _full(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter on this rank (a DTensor's gathered over its mesh), as a plain copy."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(param, DTensor):
        return param.detach().clone()
    whole = param.detach().redistribute(param.device_mesh, [Replicate()] * param.device_mesh.ndim)
    return whole.to_local().clone()


def full_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``module`` whole, by name (collective over the meshes of its DTensors)."""
    with torch.no_grad():
        return {name: _full(p) for name, p in module.named_parameters()}


class Norm(nn.LayerNorm):
    """A layer norm that is not the identity at initialization (so its gradients matter), drawn in
    ``reset_parameters()`` (so a model built on the meta device is initialized to the same values)."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        with torch.no_grad():
            self.weight.normal_(1.0, 0.2)
            self.bias.normal_(0.0, 0.2)


class SequenceBlock(nn.Module):
    """Embedding, one residual MLP between two layer norms, an output layer: the layers a Megatron
    plan splits (column/row parallel) and the norms sequence parallelism runs on sequence shards."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm1 = Norm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.norm2 = Norm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.down(torch.tanh(self.up(self.norm1(h))))
        return self.head(self.norm2(h))


def tensor_parallel_plan() -> dict[str, Any]:
    """torchtitan's plan, shrunk: sequence-parallel norms, column/row-parallel MLP, replicated logits."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm1": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
        "norm2": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def _batch(step: int, micro: int, data_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + data_rank)
    tokens = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))


def tp_parity(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case: ``tensor`` ranks per group, ``stage``, ``accum``, ``clip``, ``steps``, ``freeze_step``
    (a column-parallel weight and a sequence-parallel norm's bias frozen from then on), and optionally
    ``nan_step`` (rank 1 alone gets a NaN gradient in one tensor-parallel slice at that step: every
    rank must skip it, as the unsplit run does) with ``skip`` (``skip_nonfinite_steps``) and
    ``unused`` (``find_unused_parameters``); returns the largest difference to the unsplit run after
    every step, and what the tensor group did."""
    return [_tp_case(rank, world_size, **case) for case in cases]


def _tp_case(
    rank: int,
    world_size: int,
    *,
    tensor: int,
    stage: int,
    accum: int,
    clip: float | None,
    steps: int = 3,
    nan_step: int | None = None,
    skip: int = 0,
    unused: bool = False,
    sharded_accumulation: bool | None = None,
    ema: bool = False,
    shard_group_size: int | None = None,
    freeze_step: int | None = None,
) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    torch.set_default_dtype(torch.float64)
    try:
        data = world_size // tensor
        sharding: dict[str, Any] = {}
        if shard_group_size is None:
            mesh = init_device_mesh("cpu", (data, tensor), mesh_dim_names=("data", "tensor"))
            tensor_mesh, sharding["device_mesh"] = mesh["tensor"], mesh["data"]
            data_rank = mesh["data"].get_local_rank()
        else:  # node-aware: shard groups of shard_group_size data-parallel ranks, replicated across
            dims = ParallelDims.with_tensor(world_size, tensor, shard_group_size=shard_group_size)
            sharding["groups"], mesh = tensor_groups(dims, "cpu")
            tensor_mesh, data_rank = mesh["tensor_parallel"], mesh["data_parallel"].get_local_rank()
        torch.manual_seed(0)
        reference = SequenceBlock()
        model = parallelize_module(copy.deepcopy(reference), tensor_mesh, tensor_parallel_plan())
        now = {"step": 0}
        if nan_step is not None and rank == 1:  # before the optimizer's hook: its slice arrives NaN

            def poison(param: torch.Tensor) -> None:
                if now["step"] == nan_step:
                    param.grad._local_tensor.fill_(float("nan"))  # type: ignore[union-attr]

            model.up.weight.register_post_accumulate_grad_hook(poison)
        config = ZeroConfig(
            stage=stage,
            bucket_cap_mb=0.0005,
            skip_nonfinite_steps=skip,
            find_unused_parameters=unused,
            sharded_accumulation=sharded_accumulation,
        )
        opt = ShardedAdamW(
            model.parameters(),
            lr=0.05,
            weight_decay=0.1,
            config=config,
            module=model,
            **sharding,
        )
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05, weight_decay=0.1)
        ema_fn = torch.optim.swa_utils.get_ema_multi_avg_fn(0.8)
        if ema:  # the average kept on the shards against AveragedModel of the unsplit model
            opt.keep_weight_average()
            averaged = torch.optim.swa_utils.AveragedModel(reference, multi_avg_fn=ema_fn)
        names = [n for n, _ in reference.named_parameters()]
        initial = {n: p.detach().clone() for n, p in reference.named_parameters()}
        max_diff, norms = [], []
        for step in range(steps):
            now["step"] = step
            if step == freeze_step:  # a new trainable set: the engine re-plans (sharded and replicated)
                for module in (model, reference):
                    module.up.weight.requires_grad_(False)
                    module.norm1.bias.requires_grad_(False)
                opt.replan()
            for micro in range(accum):
                tokens, targets = _batch(step, micro, data_rank)
                if micro < accum - 1:
                    with opt.no_sync():
                        (_loss(model, tokens, targets) / accum).backward()
                else:
                    (_loss(model, tokens, targets) / accum).backward()
                for d in range(data):  # the unsplit run: every data rank's micro-batch, averaged
                    ref_tokens, ref_targets = _batch(step, micro, d)
                    (_loss(reference, ref_tokens, ref_targets) / (accum * data)).backward()
            if step == 0:  # lightning_zero.grad_norm's per-parameter norms, each element counted once
                _, mine, _ = opt.engine.grad_norms(2.0)
                unsplit = torch.stack([p.grad.norm() for p in reference.parameters()])  # type: ignore[union-attr]
                param_norm_diff = float((mine - unsplit).abs().max())
            if clip is not None:
                norm = opt.clip_grad_norm_(clip)
                if step != nan_step:
                    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
                    norms.append((float(norm), float(ref_norm)))
            opt.step()
            opt.zero_grad()
            if step != nan_step:  # the unsplit run skips the step the non-finite guard skips
                ref_opt.step()
            ref_opt.zero_grad()
            if ema:
                opt.update_weight_average(multi_avg_fn=ema_fn)
                averaged.update_parameters(reference)
            with torch.no_grad(), lightning_zero.gathered(model) if stage == 3 else contextlib.nullcontext():
                params = dict(model.named_parameters())
                full = {n: _full(p) for n, p in params.items()}
            ref = dict(reference.named_parameters())
            max_diff.append(max(float((full[n] - ref[n].detach()).abs().max()) for n in names))
        engine = opt.engine
        assert engine.tensor is not None
        average_diff = None
        if ema:
            opt.swap_weight_average()  # the parameters are the average now
            with torch.no_grad(), lightning_zero.gathered(model) if stage == 3 else contextlib.nullcontext():
                mine = full_parameters(model)
            theirs = dict(averaged.module.named_parameters())
            average_diff = max(float((mine[n] - theirs[n].detach()).abs().max()) for n in names)
        return {
            "average_diff": average_diff,
            "max_diff": max_diff,
            "norms": norms,
            "moved": max(float((ref[n].detach() - initial[n]).abs().max()) for n in names),
            "partial": [engine.tensor.names[i] for i, p in enumerate(engine.tensor.partial) if p],
            "tensor_elements": engine.tensor.comm.stats.elements_sent,
            "dtensors": sum(isinstance(p, DTensor) for p in model.parameters()),
            "skipped": opt.skipped_steps,
            "param_norm_diff": param_norm_diff,
        }
    finally:
        torch.set_default_dtype(torch.float32)


def tp_refusals(rank: int, world_size: int) -> dict[str, str]:
    """What does not compose with tensor parallelism yet is refused, each with its message."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("data", "tensor"))
    messages = {}

    def refused(name: str, fn: Any) -> None:
        try:
            fn()
        except (ValueError, NotImplementedError) as err:
            messages[name] = f"{type(err).__name__}: {err}"

    def build(**config: Any) -> tuple[nn.Module, ShardedAdamW]:
        model = parallelize_module(SequenceBlock(), mesh["tensor"], tensor_parallel_plan())
        opt = ShardedAdamW(model.parameters(), config=ZeroConfig(**config), device_mesh=mesh["data"])
        return model, opt

    model, opt = build()
    refused("consolidate_state_dict", opt.consolidate_state_dict)
    refused("load_state_dict", lambda: opt.load_state_dict({"state": {}, "param_groups": []}))
    whole = parallelize_module(
        SequenceBlock(), init_device_mesh("cpu", (world_size,)), tensor_parallel_plan()
    )
    refused("overlapping groups", lambda: ShardedAdamW(whole.parameters(), device_mesh=mesh["data"]))
    two_d = nn.Parameter(distribute_tensor(torch.zeros(4, 4), mesh, [Replicate(), Shard(0)]))
    refused("2-D parameters", lambda: ShardedAdamW([two_d], device_mesh=mesh["data"]))
    return messages


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: 4 sequences (what 2 data ranks see in :func:`_tp_case`)."""
    parts = [_batch(step, 0, d) for d in range(2)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _sharded_block(
    world_size: int, tensor: int, stage: int, cap_mb: float
) -> tuple[nn.Module, ShardedAdamW, int]:
    """A fresh (differently initialised) block on a ``(data, tensor)`` mesh, its optimizer, its data rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (world_size // tensor, tensor), mesh_dim_names=("data", "tensor"))
    torch.manual_seed(123)
    model = SequenceBlock()
    if tensor > 1:
        model = parallelize_module(model, mesh["tensor"], tensor_parallel_plan())
    config = ZeroConfig(stage=stage, bucket_cap_mb=cap_mb)
    opt = ShardedAdamW(
        model.parameters(), lr=0.05, weight_decay=0.1, config=config, module=model, device_mesh=mesh["data"]
    )
    return model, opt, mesh["data"].get_local_rank()


def tp_checkpoints(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Sharded checkpoints across tensor-parallel layouts, each resumed run against the unsplit model
    trained without a break (float64): A, TP2 x DP2 at stage 2, 2 steps, saved; B, TP1 x DP4 at stage 3,
    loads A (slices joined), 1 step, saved; C, TP2 x DP2 at stage 1, loads B (cut into slices), 1 step,
    saved; D, TP2 x DP2 at stage 2 with another bucket plan, loads C (each tensor rank its own files),
    1 step. Rank 0 also reads A and C whole without a process group (parameters and Adam moments)."""
    from pathlib import Path

    from lightning_zero.checkpoint import load_full_state_dict, read_meta, save_sharded
    from lightning_zero.checkpoint.consolidate import consolidate
    from lightning_zero.checkpoint.reshard import load_sharded, preflight, read_full_param
    from lightning_zero.cli import verify

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(123)
        reference = SequenceBlock()
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05, weight_decay=0.1)
        layouts = [("A", 2, 2, 0.0005), ("B", 1, 3, 0.0005), ("C", 2, 1, 0.0005), ("D", 2, 2, 0.002)]
        out: dict[str, Any] = {"diff": {}, "whole": {}}
        done, previous = 0, None
        for name, tensor, stage, cap in layouts:
            model, opt, data_rank = _sharded_block(world_size, tensor, stage, cap)
            data = world_size // tensor
            if previous is not None:
                meta = read_meta(previous)
                preflight(opt.engine, previous, meta)
                load_sharded(opt.engine, previous, meta)
            for step in range(done, 2 if previous is None else done + 1):
                tokens, targets = _global_batch(step)
                rows = slice(data_rank * 4 // data, (data_rank + 1) * 4 // data)
                _loss(model, tokens[rows], targets[rows]).backward()
                opt.step()
                opt.zero_grad()
                _loss(reference, tokens, targets).backward()
                ref_opt.step()
                ref_opt.zero_grad()
                done = step + 1
            with torch.no_grad(), lightning_zero.gathered(model) if stage == 3 else contextlib.nullcontext():
                mine = full_parameters(model)
            ref = dict(reference.named_parameters())
            out["diff"][name] = max(float((mine[n] - ref[n].detach()).abs().max()) for n in ref)
            if name == "D":
                break
            previous = Path(root, name)
            save_sharded(opt.engine, previous, {}, {}, stage)
            if rank == 0 and name in ("A", "C"):  # whole tensors from the files alone
                meta = read_meta(previous)
                whole = load_full_state_dict(previous)
                diffs = [float((whole[n] - ref[n].detach()).abs().max()) for n in ref]
                for n, p in ref.items():
                    for key in ("exp_avg", "exp_avg_sq"):
                        saved = read_full_param(previous, meta, n, key)
                        assert saved is not None
                        diffs.append(float((saved - ref_opt.state[p][key]).abs().max()))
                consolidate(previous, Path(root, f"{name}.ckpt"))
                state = torch.load(Path(root, f"{name}.ckpt"), weights_only=True)["state_dict"]
                diffs += [float((state[n] - ref[n].detach()).abs().max()) for n in ref]
                out["whole"][name] = max(diffs)
                out[f"verify {name}"] = verify(previous)
                out[f"files {name}"] = sorted(p.name for p in previous.iterdir())
        return out
    finally:
        torch.set_default_dtype(torch.float32)
