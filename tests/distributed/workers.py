"""Functions run on every rank by :func:`tests.distributed.harness.run_ranks` (importable by spawn)."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from lightning_zero import ShardedAdamW, ZeroConfig
from lightning_zero.comm import hybrid_mesh
from tests.distributed.models import BlockNet, RootedBlockNet, TinyNet, batch, param_groups, uses_extra

NETS = {"tiny": TinyNet, "blocks": BlockNet, "rooted": RootedBlockNet}


def parity(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each case, train ShardedAdamW on N ranks and a torch.optim.AdamW on the full global batch
    (recomputed on this rank), and return the max parameter difference after every step."""
    return [_parity_case(rank, world_size, **case) for case in cases]


def _parity_case(
    rank: int,
    world_size: int,
    *,
    stage: int,
    accum: int,
    clip: float | None,
    dtype: str = "float64",
    steps: int = 10,
    micro_size: int = 4,
    amsgrad: bool = False,
    reduce_dtype: str | None = None,
    overlap: bool = True,
    no_sync: bool = True,
    param_overlap: bool = False,
    width: int = 13,
    align_numel: int = 1,
    net: str = "tiny",
    reshard: bool = True,
    prefetch: int = 1,
    bucket_cap_mb: float = 0.0004,
    shard_group_size: int | None = None,
    slow_rank: int | None = None,
    sharded_accumulation: bool | None = None,
) -> dict[str, Any]:
    """``slow_rank``: that rank issues each collective inside its shard group 20 ms late (a slow
    peer), so its group's reductions finish later than the other groups' (the collective-order check
    of tests/conftest.py must still find every rank's sequence the same).
    ``shard_group_size``: hybrid sharding, buckets split over groups of that many ranks and
    replicated across the groups (flat over all ranks when it is the world size).
    ``no_sync=False``: every micro-batch's backward communicates (accumulation by hand, as a
    manual-optimization loop does under DDP); the sum must be the same. ``param_overlap``: the
    parameter gathers stay in flight into the next forward, and they only happen when waited for
    (:func:`_defer_gathers`), so any read before the right wait sees stale parameters."""
    torch_dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    model = NETS[net](width).to(torch_dtype)
    reference = copy.deepcopy(model)
    config = ZeroConfig(
        stage=stage,
        bucket_cap_mb=bucket_cap_mb,
        first_bucket_cap_mb=bucket_cap_mb / 2,
        overlap_comm=overlap,
        find_unused_parameters=True,
        reduce_dtype=reduce_dtype,
        overlap_param_gather=param_overlap,
        align_numel=align_numel,
        sharded_accumulation=sharded_accumulation,
        **(_stage3_settings(reshard, prefetch) if stage == 3 else {}),
    )
    names = {p: n for n, p in model.named_parameters()}
    opt = ShardedAdamW(
        param_groups(model),
        lr=3e-2,
        amsgrad=amsgrad,
        config=config,
        param_order=model.parameters(),
        param_names=names,
        module=model if stage == 3 else None,
        device_mesh=None if shard_group_size is None else hybrid_mesh(shard_group_size, "cpu"),
    )
    ref_opt = torch.optim.AdamW(param_groups(reference), lr=3e-2, amsgrad=amsgrad)
    if slow_rank == rank:
        _slow_down(opt.engine.comm.backend)
    if param_overlap:
        _defer_gathers(opt.engine.comm)
        opt.install_forward_waits(model)
    max_diff, elements, replica_elements, gathers = [], [], [], []
    gathered_units = _record_unit_gathers(opt) if stage == 3 else []
    for step in range(steps):
        opt.engine.reset_comm_stats()
        gathered_units.clear()
        for micro in range(accum):
            x, y = batch(step, micro, rank, micro_size, torch_dtype)
            loss = torch.nn.functional.mse_loss(model(x, uses_extra(step, rank)), y) / accum
            if micro < accum - 1 and no_sync:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
            # the reference sees every rank's micro-batch: the same global batch
            ref_loss = sum(
                torch.nn.functional.mse_loss(
                    reference(*_xy_extra(step, micro, r, micro_size, torch_dtype)[0:2]),
                    _xy_extra(step, micro, r, micro_size, torch_dtype)[2],
                )
                for r in range(world_size)
            ) / (accum * world_size)
            ref_loss.backward()
        if param_overlap and step > 0:  # both hold the last step's parameters, ours complete only
            max_diff.append(_max_diff(model, reference))  # through the forward waits of this step
        if clip is not None:
            opt.clip_grad_norm_(clip)
            torch.nn.utils.clip_grad_norm_([p for p in reference.parameters() if p.grad is not None], clip)
        opt.step()
        elements.append(opt.engine.comm_stats.elements_sent)
        gathers.append({u: gathered_units.count(u) for u in sorted(set(gathered_units))})
        replica_elements.append(opt.engine.replica_comm_stats.elements_sent)
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        if not param_overlap:
            with opt.engine.full_parameters():
                max_diff.append(_max_diff(model, reference))
    with opt.engine.full_parameters():  # reading parameters outside a forward: the documented contract
        max_diff.append(_max_diff(model, reference))
        moved = max(
            (a - b).abs().max().item()
            for a, b in zip(model.parameters(), _initial(net, torch_dtype, width), strict=True)
        )
    return {
        "max_diff": max_diff,
        "moved": moved,
        "buckets": len(opt.engine.plan.buckets),
        "adopted": opt.engine.reducer.adopted,
        "elements": elements,
        "gathers": gathers,
        "min_elements": opt.engine.min_elements_per_step(),
        "units": [b.unit for b in opt.engine.plan.buckets],
        "padded": sum(b.padded_numel for b in opt.engine.plan.buckets),
        "bucket_padded": [b.padded_numel for b in opt.engine.plan.buckets],
        "replica_elements": replica_elements,
        "min_replica_elements": opt.engine.min_replica_elements_per_step(),
        "layout": opt.engine.groups.layout,
        "peak_accumulating_bytes": opt.engine.memory().peak_accumulating_bytes,
    }


def _record_unit_gathers(opt: ShardedAdamW) -> list[int]:
    """Stage 3: the unit of every bucket all-gathered from now on, in order (a list the caller reads and
    clears)."""
    engine, units = opt.engine, []
    unit_of = {id(engine.flat.bucket(b)): b.unit for b in engine.plan.buckets}  # the gathers' outputs
    all_gather = engine.comm.all_gather

    def recorded(output: torch.Tensor, input_: torch.Tensor, **kwargs: Any) -> Any:
        units.append(unit_of.get(id(output), -1))  # -1: not a bucket of the plan
        return all_gather(output, input_, **kwargs)

    engine.comm.all_gather = recorded  # type: ignore[method-assign]
    return units


def _stage3_settings(reshard: bool, prefetch: int) -> dict[str, Any]:
    return {"min_unit_numel": 0, "reshard_after_forward": reshard, "prefetch_units": prefetch}


def _max_diff(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    return max(
        (a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters(), strict=True)
    )


class _Deferred:
    """A collective that starts only when waited for: the latest moment it could legally run."""

    def __init__(self, start: Any) -> None:
        self._start, self._done = start, False

    def wait(self) -> bool:
        if not self._done:
            self._start().wait()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


def _slow_down(backend: Any) -> None:
    for name in ("reduce_scatter", "all_reduce", "all_gather"):
        original = getattr(backend, name)

        def late(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            time.sleep(0.02)
            return _original(*args, **kwargs)

        setattr(backend, name, late)


def _defer_gathers(comm: Any) -> None:
    original = comm.all_gather
    comm.all_gather = lambda out, inp, **kw: _Deferred(lambda: original(out, inp, **kw))


def _xy_extra(step: int, micro: int, rank: int, size: int, dtype: torch.dtype):  # noqa: ANN202
    x, y = batch(step, micro, rank, size, dtype)
    return x, uses_extra(step, rank), y


def _initial(net: str, dtype: torch.dtype, width: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [p.detach() for p in NETS[net](width).to(dtype).parameters()]


def count_collectives(
    rank: int, world_size: int, stage: int, accum: int, reduce_dtype: str | None = None
) -> dict[str, Any]:
    """Record every torch.distributed call of one optimizer step, per micro-batch."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = TinyNet()
    calls: list[tuple[str, int]] = []
    wire_bytes: list[tuple[str, int]] = []  # the same calls, counted in bytes
    launched_before_last_grad: list[int] = []
    # registered before the optimizer's hooks: sees how many collectives had started when the first
    # layer (the last to get its gradient) got its gradient, i.e. while backward was still running
    model.inp.weight.register_post_accumulate_grad_hook(
        lambda p: launched_before_last_grad.append(len(calls))
    )
    config = ZeroConfig(
        stage=stage, bucket_cap_mb=0.0004, first_bucket_cap_mb=0.0002, reduce_dtype=reduce_dtype
    )
    opt = ShardedAdamW(param_groups(model), lr=1e-2, config=config, param_order=model.parameters())
    names = [
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "all_gather_single",
        "all_gather_into_tensor",
        "all_reduce",
        "broadcast",
        "reduce",
        "gather",
        "all_gather",
        "reduce_scatter",
        "all_to_all_single",
        "send",
        "recv",
    ]
    originals = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def recorder(name: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            # the element count of the full (unsharded) tensor: input of a reduce-scatter, output of a gather
            tensor = args[1] if name.startswith("reduce_scatter") else args[0]
            calls.append((name, tensor.numel()))
            wire_bytes.append((name, tensor.numel() * tensor.element_size()))
            return fn(*args, **kwargs)

        return wrapped

    for n, fn in originals.items():
        setattr(dist, n, recorder(n, fn))
    per_micro = []
    try:
        for micro in range(accum):
            x, y = batch(0, micro, rank, 4, torch.float32)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if micro < accum - 1:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
            per_micro.append(len(calls))
        opt.step()
        opt.zero_grad()
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    padded = sum(b.padded_numel for b in opt.engine.plan.buckets)
    return {
        "calls": calls,
        "per_micro": per_micro,
        "trainable": trainable,
        "padded": padded,
        "buckets": len(opt.engine.plan.buckets),
        "reported": opt.engine.comm_stats.elements_sent,
        "wire_bytes": wire_bytes,
        "reported_bytes": opt.engine.comm_stats.bytes_sent,
        "launched_before_last_grad": launched_before_last_grad[-1],
    }


def mismatched_models(rank: int, world_size: int) -> str:
    """Rank 1 builds a wider model: every rank must raise PlanMismatchError, none may hang."""
    from lightning_zero import PlanMismatchError

    model = TinyNet(width=13 + (rank == 1))
    try:
        ShardedAdamW(model.parameters(), param_names={p: n for n, p in model.named_parameters()})
    except PlanMismatchError as err:
        return str(err)
    return "no error"


def bf16_accumulation(
    rank: int, world_size: int, reduce_dtype: str | None, micro: int = 16
) -> dict[str, float]:
    """A bf16 layer, ``micro`` micro-batches per rank accumulated under ``no_sync``: the gradient
    shard against the exact mean (fp32 sum of every rank's bf16 micro-batch gradients), and, for
    scale, what accumulating in a bf16 ``param.grad`` (as autograd does) gets."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).to(torch.bfloat16)
    ref_model = copy.deepcopy(model)
    config = ZeroConfig(reduce_dtype=reduce_dtype, bucket_cap_mb=0.004, first_bucket_cap_mb=0.002)
    opt = ShardedAdamW(model.parameters(), lr=0.0, config=config, param_order=model.parameters())
    exact = [torch.zeros(p.shape) for p in ref_model.parameters()]
    in_bf16 = [torch.zeros(p.shape, dtype=torch.bfloat16) for p in ref_model.parameters()]
    for m in range(micro):
        for r in range(world_size):
            g = torch.Generator().manual_seed(100 * m + r)
            x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
            w = torch.randn(8, 64, generator=g).to(torch.bfloat16)
            grads = torch.autograd.grad((ref_model(x) * w).sum(), list(ref_model.parameters()))
            for e, b, grad in zip(exact, in_bf16, grads, strict=True):
                e.add_(grad.float() / world_size)
                if r == rank:
                    b.add_(grad / world_size)  # one rank's bf16 running sum (as param.grad would hold)
            if r == rank:
                loss = (model(x) * w).sum()
                if m < micro - 1:
                    with opt.no_sync():
                        loss.backward()
                else:
                    loss.backward()
    opt.engine.finish_grad_sync()
    flat_exact = [e.reshape(-1) for e in exact]
    scale = max(e.abs().max().item() for e in exact)
    ours = 0.0
    for b, bucket in enumerate(opt.engine.plan.buckets):
        for seg in opt.engine.plan.segments(bucket, rank):
            piece = opt.engine.reducer.grad_shards[b][seg.shard_offset : seg.shard_offset + seg.numel]
            expected = flat_exact[_ref_index(opt, model, seg.param_index)][seg.param_start : seg.param_end]
            ours = max(ours, (piece - expected).abs().max().item())
    # the bf16 running sum of this rank only: compare with this rank's exact share
    own = [torch.zeros(p.shape) for p in ref_model.parameters()]
    for m in range(micro):
        g = torch.Generator().manual_seed(100 * m + rank)
        x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
        w = torch.randn(8, 64, generator=g).to(torch.bfloat16)
        grads = torch.autograd.grad((ref_model(x) * w).sum(), list(ref_model.parameters()))
        for o, grad in zip(own, grads, strict=True):
            o.add_(grad.float() / world_size)
    bf16_err = max((b.float() - o).abs().max().item() for b, o in zip(in_bf16, own, strict=True))
    return {"ours": ours / scale, "bf16_accumulation": bf16_err / scale}


def _ref_index(opt: ShardedAdamW, model: torch.nn.Module, plan_index: int) -> int:
    target = opt.engine.params_in_order[plan_index]
    return next(i for i, p in enumerate(model.parameters()) if p is target)


def user_grad_is_not_scratch(rank: int, world_size: int) -> dict[str, Any]:
    """A ``.grad`` the user assigned before backward (and still holds) is summed into, as torch does,
    but never adopted as a communication buffer: a gradient autograd creates into an empty ``.grad``
    is. Returns the user's tensor after backward, the local gradient and the adoption counts."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 6, bias=False).double()  # 24 elements: one unpadded bucket on 2 or 3 ranks
    opt = ShardedAdamW(model.parameters(), lr=0.1, config=ZeroConfig())
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).sum().backward()  # fresh .grad: adopted
    opt.step()
    adopted_fresh = opt.engine.reducer.adopted
    opt.zero_grad()
    held = torch.full_like(model.weight, 0.5)
    model.weight.grad = held
    model(x).pow(2).sum().backward()
    local = 2 * (model(x).detach().T @ x)  # the local gradient of sum(y^2) at the same weights
    return {
        "held": held.clone(),
        "expected": (0.5 + local).clone(),
        "adopted_fresh": adopted_fresh,
        "adopted_after": opt.engine.reducer.adopted,
    }


def stage3_sync(rank: int, world_size: int) -> dict[str, Any]:
    """What the Trainer strategy does at stage 3 before sharding: rank 0's values everywhere (each rank
    starts from another seed), then the sharded optimizer; and a different model on one rank refused."""
    from lightning_zero.integrations.frontend import ZeroFrontEnd

    torch.manual_seed(rank)
    model = BlockNet().double()
    ZeroFrontEnd.sync_module_states(model, check_same=True)
    opt = ShardedAdamW(model.parameters(), config=ZeroConfig(stage=3, min_unit_numel=0), module=model)
    params = _initial("blocks", torch.float64, 13)  # seed 0: rank 0's
    with opt.full_parameters():
        synced = max((a - b).abs().max().item() for a, b in zip(model.parameters(), params, strict=True))
    try:
        ZeroFrontEnd.sync_module_states(BlockNet(13 + rank), check_same=True)
        error = ""
    except ValueError as err:
        error = str(err)
    return {"synced": synced, "error": error}


def stage3_state_dict(rank: int, world_size: int) -> dict[str, Any]:
    """A stage-3 model's ``state_dict()``/``load_state_dict()`` against the same model unsharded:
    trained 3 steps (each rank its own batch), then read, read by a submodule, loaded with new values
    and read back, run through a root-holding submodule on its own, and finally unsharded."""
    from tests.distributed.models import Block

    torch.manual_seed(0)
    model = BlockNet().double()
    config = ZeroConfig(stage=3, unit_modules=(Block,), bucket_cap_mb=1.0)  # root: inp and out
    opt = ShardedAdamW(model.parameters(), lr=1e-2, config=config, module=model)
    for step in range(3):
        x, y = batch(step, 0, rank, 4, torch.float64)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    flat = opt.engine.flat
    peak = [0]
    materialize = flat.materialize

    units = opt.engine.units
    assert units is not None

    def counting(bucket: Any) -> None:  # units (partly) gathered at once
        materialize(bucket)
        gathered = sum(any(flat.is_gathered(b) for b in unit.buckets) for unit in units.units)
        peak[0] = max(peak[0], gathered)

    flat.materialize = counting  # type: ignore[method-assign]
    with opt.full_parameters():
        full = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    peak[0] = 0
    state = model.state_dict()
    state_peak, left_gathered = peak[0], sum(flat._gathered)
    state_vs_full = max((state[k] - full[k]).abs().max().item() for k in full)
    block = model.blocks[1].state_dict()
    block_vs_full = max((v - full[f"blocks.1.{k}"]).abs().max().item() for k, v in block.items())
    new = {k: v + 0.5 for k, v in state.items()}
    model.load_state_dict(new)
    after_load = model.state_dict()
    plain = BlockNet().double()
    plain.load_state_dict(new)
    x, _ = batch(9, 0, 0, 4, torch.float64)  # the same input on every rank
    with torch.no_grad():
        out, out_plain = model(x), plain(x)
        inp, inp_plain = model.inp(x), plain.inp(x)  # a root-holding submodule on its own
    try:
        model.load_state_dict(new, assign=True)
        assign_error = ""
    except RuntimeError as err:
        assign_error = str(err)
    from lightning_zero import unshard
    from lightning_zero.engine.parameters import sharded_engine

    sharded_before = sharded_engine(model) is opt.engine
    unshard(model)
    return {
        "state_vs_full": state_vs_full,
        "state_keys": sorted(state) == sorted(full),
        "state_peak": state_peak,
        "left_gathered": left_gathered,
        "block_vs_full": block_vs_full,
        "load_vs_new": max((after_load[k] - new[k]).abs().max().item() for k in new),
        "out_vs_plain": (out - out_plain).abs().max().item(),
        "inp_vs_plain": (inp - inp_plain).abs().max().item(),
        "assign_error": assign_error,
        "sharded_before": sharded_before,
        "plain_after_unshard": sharded_engine(model) is None
        and max(
            (p - q).abs().max().item() for p, q in zip(model.parameters(), plain.parameters(), strict=True)
        ),
        "moved": max((full[k] - v).abs().max().item() for k, v in BlockNet().double().state_dict().items()),
    }


def deferred_flags(rank: int, world_size: int, meta_ranks: list[int]) -> str | None:
    """``ZeroFrontEnd.deferred_init`` of a Linear built on the meta device by ``meta_ranks`` and eagerly
    by the others: the error text, ``"deferred"`` or ``"eager"``."""
    from lightning_zero.engine.deferred_init import DeferredInitError
    from lightning_zero.integrations.frontend import ZeroFrontEnd, ZeroOptions

    with torch.device("meta" if rank in meta_ranks else "cpu"):
        model = torch.nn.Linear(4, 4)
    try:
        front = ZeroFrontEnd(ZeroOptions(config=ZeroConfig(stage=3)))
        found = front.deferred_init(model, torch.device("cpu"))
    except DeferredInitError as err:
        return str(err)
    return "eager" if found is None else "deferred"
