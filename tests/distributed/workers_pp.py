"""Pipeline parallelism on every rank (:func:`tests.distributed.harness.run_ranks`): a stack of tiny
layers split into stages over the ``pipeline`` dimension of a ``(pipeline, data, tensor)`` mesh, each
stage's linear layers optionally tensor-parallel over ``tensor``, its parameters (slices) sharded by
``ShardedAdamW`` over the ``data`` dimension, torch's schedules driving it
(:mod:`lightning_zero.comm.pipeline`), against one unsplit copy trained by ``torch.optim.AdamW`` on
the whole global batch in this process."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

import lightning_zero
from lightning_zero import ShardedAdamW, ZeroConfig
from lightning_zero.layout.local import is_dtensor, local

WIDTH, LAYERS, ROWS = 8, 8, 8  # ROWS samples per data-parallel rank and step


def unsplit() -> nn.Sequential:
    """``LAYERS`` linear layers with a tanh after each but the last (float64, seed 0)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(LAYERS):
        layers.append(nn.Linear(WIDTH, WIDTH))
        if i < LAYERS - 1:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def chunks(model: nn.Sequential, count: int) -> list[nn.Sequential]:
    """``model`` cut into ``count`` consecutive chunks of equal numbers of layers."""
    per = len(model) // count + 1  # a linear layer and its tanh stay together
    return [model[i * per : (i + 1) * per] for i in range(count)]


def _batch(step: int, micro: int, data_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + data_rank)
    return torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def _count_reductions(comm: Any) -> list[int]:
    """A one-element counter of the gradient reductions ``comm`` launches from now on: its
    reduce-scatters and its all-reduces other than control ones (a norm, a flag)."""
    seen = [0]
    reduce_scatter, all_reduce = comm.reduce_scatter, comm.all_reduce

    def counted_reduce_scatter(*args: Any, **kwargs: Any) -> Any:
        seen[0] += 1
        return reduce_scatter(*args, **kwargs)

    def counted_all_reduce(tensor: torch.Tensor, *args: Any, control: bool = False, **kwargs: Any) -> Any:
        seen[0] += not control
        return all_reduce(tensor, *args, control=control, **kwargs)

    comm.reduce_scatter, comm.all_reduce = counted_reduce_scatter, counted_all_reduce
    return seen


def pp_parity(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case: ``pipeline`` stages, ``schedule``, ``microbatches``, ``stage`` (ZeRO), ``accum``
    (pipeline steps per optimizer step), ``clip``, optionally ``nan_step`` (a NaN in one gradient of
    the last stage on one rank at that step: every stage must skip it, as the unsplit run does) with
    ``skip``, ``virtual`` (stages per rank), ``tensor`` (the stage's linear layers column- then
    row-parallel over that many ranks), ``sharded_accumulation`` (``ZeroConfig``'s); returns the
    largest difference to the unsplit run after every step, the norms, the numels this rank holds
    (the stage's, its tensor-parallel slice, the ZeRO plan's and shard's) and the gradient
    reductions launched per optimizer step."""
    return [_pp_case(rank, world_size, **case) for case in cases]


def _pp_case(
    rank: int,
    world_size: int,
    *,
    pipeline: int,
    schedule: str,
    microbatches: int,
    stage: int,
    accum: int,
    clip: float | None,
    steps: int = 3,
    nan_step: int | None = None,
    skip: int = 0,
    virtual: int = 1,
    tensor: int = 1,
    sharded_accumulation: bool | None = None,
) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lightning_zero.comm.pipeline import ShardedStage
    from lightning_zero.comm.pipeline import schedule as make_schedule
    from tests.distributed.workers_tp import full_parameters

    torch.set_default_dtype(torch.float64)
    try:
        data = world_size // (pipeline * tensor)
        dims = (pipeline, data, tensor)
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=("pipeline", "data", "tensor"))
        index, data_rank = mesh["pipeline"].get_local_rank(), mesh["data"].get_local_rank()
        reference = unsplit()
        parts = chunks(unsplit(), pipeline * virtual)
        mine = [parts[index + v * pipeline] for v in range(virtual)]  # interleaved: every P-th chunk
        if tensor > 1:  # Megatron's pairs inside each stage: column- then row-parallel, whole outputs
            for chunk in mine:
                linear = [name for name, m in chunk.named_children() if isinstance(m, nn.Linear)]
                plan = {
                    n: ColwiseParallel() if k % 2 == 0 else RowwiseParallel() for k, n in enumerate(linear)
                }
                parallelize_module(chunk, mesh["tensor"], plan)
        module = mine[0] if virtual == 1 else nn.ModuleList(mine)
        held_numel = sum(local(p).numel() for p in module.parameters())  # before ZeRO flattens them
        now = {"step": 0}
        last = index == pipeline - 1
        if nan_step is not None and last and data_rank == 1:  # before the optimizer's hook

            def poison(param: torch.Tensor) -> None:
                if now["step"] == nan_step:
                    param.grad.fill_(float("nan"))  # type: ignore[union-attr]

            mine[-1][-1].weight.register_post_accumulate_grad_hook(poison)
        config = ZeroConfig(
            stage=stage,
            bucket_cap_mb=0.0002,
            skip_nonfinite_steps=skip,
            sharded_accumulation=sharded_accumulation,
        )
        opt = ShardedAdamW(
            module.parameters(),
            lr=0.05,
            weight_decay=0.1,
            config=config,
            module=module,
            device_mesh=mesh["data"],
            pipeline_group=mesh["pipeline"],
        )
        reductions = _count_reductions(opt.engine.comm)
        stages = [
            ShardedStage(
                chunk,
                index + v * pipeline,
                pipeline * virtual,
                torch.device("cpu"),
                mesh["pipeline"],
                opt.no_sync,
            )
            for v, chunk in enumerate(mine)
        ]

        def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # accumulation: as any loss
            return _mse(out, target) / accum

        runner = make_schedule(schedule, stages if virtual > 1 else stages[0], microbatches, loss)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05, weight_decay=0.1)
        ref_parts = chunks(reference, pipeline * virtual)
        ref_mine = [ref_parts[index + v * pipeline] for v in range(virtual)]
        initial = [p.detach().clone() for p in reference.parameters()]
        max_diff, norms, losses, reduced = [], [], [], []
        stats, compared = opt.engine.comm.stats, 0  # compared: what the comparison's gathers send
        for step in range(steps):
            now["step"] = step
            for micro in range(accum):
                inputs, targets = _batch(step, micro, data_rank)
                window = opt.no_sync() if micro < accum - 1 else contextlib.nullcontext()
                with window:
                    if index == 0:
                        runner.step(inputs)
                    elif last:
                        seen: list[torch.Tensor] = []
                        runner.step(target=targets, losses=seen)
                        losses.append(float(sum(seen)))
                    else:
                        runner.step()
                for d in range(data):  # the unsplit run: every data rank's batch, averaged
                    ref_inputs, ref_targets = _batch(step, micro, d)
                    (_mse(reference(ref_inputs), ref_targets) / (accum * data)).backward()
            if clip is not None:
                norm = opt.clip_grad_norm_(clip)
                if step != nan_step:
                    norms.append(
                        (float(norm), float(torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)))
                    )
            opt.step()
            opt.zero_grad()
            reduced.append(reductions[0] - sum(reduced))
            if step != nan_step:  # the unsplit run skips the step the non-finite guard skips
                ref_opt.step()
            ref_opt.zero_grad()
            before = stats.elements_sent
            with torch.no_grad(), lightning_zero.gathered(module) if stage == 3 else contextlib.nullcontext():
                mine_now = [p for chunk in mine for p in full_parameters(chunk).values()]
            compared += stats.elements_sent - before
            theirs = [p.detach() for chunk in ref_mine for p in chunk.parameters()]
            max_diff.append(max(float((a - b).abs().max()) for a, b in zip(mine_now, theirs, strict=True)))
        moved = max(
            float((p.detach() - q).abs().max()) for p, q in zip(reference.parameters(), initial, strict=True)
        )
        return {
            "max_diff": max_diff,
            "norms": norms,
            "losses": losses,
            "moved": moved,
            "skipped": opt.skipped_steps,
            "numel": sum(p.numel() for chunk in mine for p in chunk.parameters()),
            "dtensors": sum(is_dtensor(p) for p in module.parameters()),
            "sent_per_step": (stats.elements_sent - compared) / steps,  # the training's own
            "padded": sum(b.padded_numel for b in opt.engine.plan.buckets),
            "held_numel": held_numel,
            "planned_numel": sum(spec.numel for spec in opt.engine.plan.params),
            "shard_numel": sum(opt.engine.plan.shard_numel(b) for b in opt.engine.plan.buckets),
            "buckets": len(opt.engine.plan.buckets),
            "reductions": reduced,
        }
    finally:
        torch.set_default_dtype(torch.float32)
