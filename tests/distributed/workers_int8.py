"""``reduce_dtype="int8"`` on every rank: the averaged gradient shard against the fp32 wire's, within
the quantization bound of every sender's block; bytes against the fp32 wire."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
import torch.distributed as dist

from lightning_zero import ShardedAdamW, ZeroConfig
from lightning_zero.engine.quantize import BLOCK, LEVELS, blocks_of
from tests.distributed.models import BlockNet, RootedBlockNet, batch, param_groups


def _optimizer(
    model: torch.nn.Module,
    stage: int,
    wire: str | None,
    cap: float,
    mesh: Any = None,
    lr: float = 1e-2,
    **settings: Any,
) -> ShardedAdamW:
    config = ZeroConfig(
        stage=stage,
        reduce_dtype=wire,
        bucket_cap_mb=cap,
        first_bucket_cap_mb=cap / 2,
        **({"min_unit_numel": 0} if stage == 3 else {}),
        **settings,
    )
    return ShardedAdamW(
        param_groups(model),
        lr=lr,
        config=config,
        device_mesh=mesh,
        param_order=model.parameters(),
        param_names={p: n for n, p in model.named_parameters()},
        module=model if stage == 3 else None,
    )


def halfsteps(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Per element of ``x``: half the quantization step of its block as ``pack(x, rows)`` lays the
    blocks out (``rows`` chunks of ``ceil(numel/rows)`` elements, each padded to whole blocks)."""
    chunk = -(-x.numel() // rows)
    grid = torch.zeros(rows, blocks_of(chunk) * BLOCK)
    padded = torch.zeros(rows * chunk)
    padded[: x.numel()] = x.reshape(-1)
    grid[:, :chunk] = padded.view(rows, chunk)
    amax = grid.view(-1, BLOCK).abs().amax(dim=1)
    steps = (amax / (2 * LEVELS)).repeat_interleave(BLOCK).view(rows, -1)[:, :chunk]
    return steps.reshape(-1)[: x.numel()]


def _bucket_grads(model: torch.nn.Module, bucket: Any, grads: list[torch.Tensor]) -> torch.Tensor:
    """``grads`` (one per trainable parameter, plan order) laid out as ``bucket``'s flat buffer."""
    local = torch.zeros(bucket.padded_numel)
    for slot in bucket.slots:
        local[slot.bucket_offset : slot.bucket_offset + slot.numel] = grads[slot.param_index].reshape(-1)
    return local


def _senders(model: torch.nn.Module, bucket: Any, world_size: int, group: int, index: int) -> tuple:
    """What every rank sends of ``bucket`` (its local gradient over the world size, each rank's from
    ``model``'s gradients on that rank) and the slice a shard index ``index`` of a group of ``group``
    owns: ``(everyone, mine)``."""
    local = _bucket_grads(model, bucket, _local_grads(model))
    everyone = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(everyone, local / world_size)
    part = bucket.padded_numel // group
    return everyone, slice(index * part, (index + 1) * part)


def _local_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    """This model's gradients, plan order (a block's gate unused in this forward: no gradient, a zero
    one for the engines)."""
    return [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters() if p.requires_grad]


def int8_gradients(rank: int, world_size: int, stage: int, width: int, cap: float) -> dict[str, Any]:
    torch.manual_seed(0)
    model = BlockNet(width)
    exact_model, local_model = copy.deepcopy(model), copy.deepcopy(model)
    int8 = _optimizer(model, stage, "int8", cap)
    exact = _optimizer(exact_model, stage, None, cap)
    x, y = batch(0, 0, rank, 8, torch.float32)
    for m, opt in ((model, int8), (exact_model, exact)):
        opt.engine.reset_comm_stats()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.engine.finish_grad_sync()
    torch.nn.functional.mse_loss(local_model(x), y).backward()  # this rank's own gradient, plain
    plan, n = int8.engine.plan, world_size
    over, checked = [], 0
    for b, bucket in enumerate(plan.buckets):
        everyone, mine = _senders(local_model, bucket, n, n, rank)  # what each sender quantizes
        part = mine.stop - mine.start
        bound = sum(halfsteps(sent, n)[mine] for sent in everyone)
        got, want = int8.engine.reducer.grad_shards[b], exact.engine.reducer.grad_shards[b]
        error = (got - want).abs()
        slack = 1e-6 * want.abs() + 1e-7 * bound.max()  # fp32 rounding of the sums and products
        over.append(float((error - bound - slack).max()))
        checked += part
    return {
        "over": max(over),
        "checked": checked,
        "moved": float(exact.engine.reducer.grad_shards[0].abs().max()),
        "bytes_int8": int8.engine.comm_stats.bytes_sent,
        "bytes_fp32": exact.engine.comm_stats.bytes_sent,
        "expected_fp32_gradients": sum((n - 1) * (b.padded_numel // n) * 4 for b in plan.buckets)
        * (2 if stage == 1 else 1),  # reduce-scatter, or stage 1's all-reduce
        "expected_int8": sum((n - 1) * (blocks_of(b.padded_numel // n) * (BLOCK + 4)) for b in plan.buckets),
    }


VARIANTS = {
    "fp32": (2, None, {}),
    "int8": (2, "int8", {}),
    "int8+feedback": (2, "int8", {"error_feedback": True}),
    "stage3 fp32": (3, None, {}),
    "stage3 int8 gathers": (3, None, {"gather_dtype": "int8"}),
}


def int8_training(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    """A few steps of each variant from the same start: the losses stay close to the fp32 wire's (a
    smoke check that each trains; the convergence measurement is benchmarks/int8_convergence.py)."""
    losses: dict[str, list[float]] = {}
    for name, (stage, wire, settings) in VARIANTS.items():
        torch.manual_seed(0)
        model = BlockNet(32)
        opt = _optimizer(model, stage, wire, 25.0, **settings)
        losses[name] = []
        for _ in range(steps):
            x, y = batch(0, 0, rank, 8, torch.float32)  # one batch again: the loss must fall
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(float(loss))
    return losses


def int8_hybrid_gradients(
    rank: int,
    world_size: int,
    stage: int,
    width: int,
    cap: float,
    micro: int = 1,
    sharded: bool | None = None,
) -> dict[str, Any]:
    """Node-aware sharding (groups of 2): the shard within the bound of the hierarchical scheme (fp32
    inside the group; across the ``R`` groups each replica's chunk quantized, then the summed chunk
    quantized again) of the fp32 wire's; the replicas' shards bit-identical; bytes = the formula.
    ``micro > 1``: that many micro-batches, all but the last inside ``no_sync`` (with
    ``sharded_accumulation``, each reduced inside the group as it comes and folded into the shard,
    whose sum alone crosses the groups): the bound is the same, of the summed local gradients."""
    from lightning_zero.comm import hybrid_mesh

    torch.manual_seed(0)
    model = BlockNet(width)
    exact_model, local_model = copy.deepcopy(model), copy.deepcopy(model)
    mesh = hybrid_mesh(2, "cpu")
    int8 = _optimizer(model, stage, "int8", cap, mesh, sharded_accumulation=sharded)
    exact = _optimizer(exact_model, stage, None, cap, mesh, sharded_accumulation=sharded)
    batches = [batch(0, k, rank, 8, torch.float32) for k in range(micro)]
    for m, opt in ((model, int8), (exact_model, exact)):
        opt.engine.reset_comm_stats()
        for k, (x, y) in enumerate(batches):
            with opt.engine.no_sync() if k < micro - 1 else contextlib.nullcontext():
                torch.nn.functional.mse_loss(m(x), y).backward()
        opt.engine.finish_grad_sync()
    for x, y in batches:
        torch.nn.functional.mse_loss(local_model(x), y).backward()  # summed, as the engines sum them
    plan, n, g = int8.engine.plan, world_size, 2
    r, index = n // g, rank % g  # groups of consecutive ranks; this rank's shard index in its group
    over, identical, checked = [], True, 0
    for b, bucket in enumerate(plan.buckets):
        everyone, mine = _senders(local_model, bucket, n, g, index)
        part = mine.stop - mine.start
        partials = [sum(everyone[j * g + k][mine] for k in range(g)) for j in range(r)]  # each replica's
        first = sum(halfsteps(p, r) for p in partials)  # the all-to-all of the replicas' chunks
        total = sum(partials)
        bound = first + halfsteps(total.abs() + first, r)  # the re-quantized sums (their amax grown)
        got, want = int8.engine.reducer.grad_shards[b], exact.engine.reducer.grad_shards[b]
        slack = 1e-6 * want.abs() + 1e-7 * bound.max()
        over.append(float(((got - want).abs() - bound - slack).max()))
        replicas = [torch.empty_like(got) for _ in range(n)]
        dist.all_gather(replicas, got)
        identical &= all(torch.equal(replicas[j * g + index], got) for j in range(r))
        checked += part
    chunks = [-(-(b.padded_numel // g) // r) for b in plan.buckets]
    return {
        "over": max(over),
        "identical": identical,
        "checked": checked,
        "in_group_int8": int8.engine.comm_stats.bytes_sent,
        "in_group_fp32": exact.engine.comm_stats.bytes_sent,
        "across_int8": int8.engine.replica_comm_stats.bytes_sent,
        "across_fp32": exact.engine.replica_comm_stats.bytes_sent,
        "expected_across_fp32": sum(2 * ((b.padded_numel // g) * (r - 1) // r) * 4 for b in plan.buckets),
        "expected_across_int8": sum(2 * (r - 1) * blocks_of(c) * (BLOCK + 4) for c in chunks),
    }


def int8_error_feedback(rank: int, world_size: int, stage: int, steps: int) -> dict[str, Any]:
    """The same gradients ``steps`` times (lr 0: the parameters never move): with error feedback the
    sum of the shards received is within one step's bound of ``steps`` times the exact mean (each
    sender's error telescopes to its last residual); without it the error grows with the steps."""
    torch.manual_seed(0)
    model = BlockNet(24)
    results: dict[str, Any] = {}
    sums: dict[str, list[torch.Tensor]] = {}
    for name, wire, feedback in (
        ("exact", None, False),
        ("plain", "int8", False),
        ("feedback", "int8", True),
    ):
        m = copy.deepcopy(model)
        opt = _optimizer(m, stage, wire, 0.002, lr=0.0, error_feedback=feedback)
        x, y = batch(0, 0, rank, 8, torch.float32)
        for _ in range(steps):
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.engine.finish_grad_sync()
            shards = [s.clone() for s in opt.engine.reducer.grad_shards]
            sums[name] = (
                shards if name not in sums else [a + s for a, s in zip(sums[name], shards, strict=True)]
            )
            opt.step()
            opt.zero_grad()
        plan = opt.engine.plan
    local_model = copy.deepcopy(model)
    torch.nn.functional.mse_loss(local_model(x), y).backward()
    n = world_size
    worst: dict[str, float] = {"plain": 0.0, "feedback": 0.0}
    over = []
    for b, bucket in enumerate(plan.buckets):
        everyone, mine = _senders(local_model, bucket, n, n, rank)
        # the last residual of a sender: half a step of a block of (its gradient + the residual before),
        # whose amax is at most amax(gradient) * 254/253
        bound = sum(halfsteps(sent, n)[mine] for sent in everyone) * (254 / 253)
        want = sums["exact"][b]
        for name in worst:
            error = (sums[name][b] - want).abs()
            worst[name] = max(worst[name], float((error / bound.clamp_min(1e-30)).max()))
        slack = 1e-6 * want.abs() + 1e-7 * steps * bound.max()
        over.append(float(((sums["feedback"][b] - want).abs() - bound - slack).max()))
    results.update(worst, over=max(over))
    return results


def _capture(seen: dict[str, torch.Tensor], prefix: str) -> Any:
    """A forward pre-hook keeping a copy of the module's own trainable parameters in a forward with
    gradients (it runs after the unit's pre-hook gathered them)."""

    def hook(module: torch.nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            for k, v in module.named_parameters(recurse=False):
                if v.requires_grad:
                    seen[prefix + k] = v.detach().clone()

    return hook


def int8_gathers(rank: int, world_size: int) -> dict[str, Any]:
    """Stage 3 with ``gather_dtype="int8"``, lr 0 (every shard stays fixed, so the exactness of the
    masters is checked bit for bit), 3 steps:

    * what a unit's forward sees is every rank's shard dequantized: the same on every rank, within half
      a step of the exact value, and not the exact value;
    * the gradients are those of the weights each forward saw (a plain model holding them, averaged),
      at step 1 with the root held exactly into the step (as an evaluation leaves it: the units keep
      their int8 rows, and a backward prefetch gathers each unit as its own forward ran) and at step 2
      with ``state_dict()`` between forward and backward (it re-gathers the held root exactly; the
      backward gathers the int8 rows its forward saw again);
    * the masters never take the quantization: the shards and that ``state_dict()`` are bit-identical
      to the start;
    * bytes of the parameter gathers in step 0: ``(N-1) * blocks * (256 + 4)`` per gather against
      ``(N-1) * 4 * shard`` (shards aligned to whole blocks: the ratio is exactly 260/1024).
    """
    n = world_size
    torch.manual_seed(0)
    model = RootedBlockNet(40)
    start = copy.deepcopy(model.state_dict())
    runs: dict[str, Any] = {}
    for name, gather in (("int8", "int8"), ("exact", None)):
        m = copy.deepcopy(model)
        opt = _optimizer(m, 3, None, 0.004, lr=0.0, gather_dtype=gather, align_numel=BLOCK)
        seen: dict[str, torch.Tensor] = {}
        hooks = [
            mod.register_forward_pre_hook(_capture(seen, f"{prefix}." if prefix else ""))
            for prefix, mod in m.named_modules()
            if any(v.requires_grad for v in mod.parameters(recurse=False))
        ]
        opt.engine.reset_comm_stats()
        run: dict[str, Any] = {"seen": [], "grads": []}
        for step in range(3):
            x, y = batch(step, 0, rank, 8, torch.float32)
            if step == 1:
                run["bytes"] = opt.engine.comm_stats.bytes_sent  # step 0, whole
                with torch.no_grad():
                    opt.engine.gather_root()
            loss = torch.nn.functional.mse_loss(m(x), y)
            if step == 2:
                run["state"] = {k: v.clone() for k, v in m.state_dict().items()}  # the root held
            loss.backward()
            opt.engine.finish_grad_sync()
            if step > 0:
                run["seen"].append(dict(seen))
                run["grads"].append([s.clone() for s in opt.engine.reducer.grad_shards])
            opt.step()
            opt.zero_grad()
        for h in hooks:
            h.remove()
        run["shards"] = [s.clone() for s in opt.engine.flat.shards]
        runs[name] = run
        plan = opt.engine.plan
    q, e = runs["int8"], runs["exact"]
    grad_error = 0.0
    for k, (weights, grads) in enumerate(zip(q["seen"], q["grads"], strict=True)):
        plain = copy.deepcopy(model)  # the reference: a plain model holding what that forward saw
        with torch.no_grad():
            for key, p in plain.named_parameters():
                if key in weights:
                    p.copy_(weights[key])
        x, y = batch(k + 1, 0, rank, 8, torch.float32)
        torch.nn.functional.mse_loss(plain(x), y).backward()
        for b, bucket in enumerate(plan.buckets):
            mean = _bucket_grads(plain, bucket, _local_grads(plain))
            dist.all_reduce(mean)
            part = bucket.padded_numel // n
            want = mean[rank * part : (rank + 1) * part] / n
            grad_error = max(grad_error, float(((grads[b] - want).abs() / (want.abs().max() + 1e-12)).max()))
    last = q["seen"][-1]
    assert set(last) == {k for k, v in model.named_parameters() if v.requires_grad}, sorted(last)
    exact_seen = {k: v for k, v in start.items() if k in last}
    off = {k: float((last[k] - v).abs().max()) for k, v in exact_seen.items()}
    same_everywhere = True
    for k in sorted(last):
        everyone = [torch.empty_like(last[k]) for _ in range(n)]
        dist.all_gather(everyone, last[k])
        same_everywhere &= all(torch.equal(v, last[k]) for v in everyone)
    pairs = zip(q["grads"][-1], e["grads"][-1], strict=True)
    grads_differ = max(float((a - b).abs().max()) for a, b in pairs)
    return {
        "max_off": max(off.values()),
        "max_weight": max(float(v.abs().max()) for v in exact_seen.values()),
        "same_everywhere": same_everywhere,
        "grad_error": grad_error,
        "grads_differ": grads_differ,
        "state_exact": all(torch.equal(q["state"][k], start[k]) for k in start),
        "shards_kept": all(torch.equal(a, b) for a, b in zip(q["shards"], e["shards"], strict=True)),
        "bytes_int8": q["bytes"],
        "bytes_exact": e["bytes"],
        "grad_bytes": sum((n - 1) * (b.padded_numel // n) * 4 for b in plan.buckets),
    }


def int8_feedback_after_skip(rank: int, world_size: int, how: str) -> bool:
    """A skipped step drops the error-feedback residuals: the next send equals a fresh optimizer's
    first one (lr 0: the parameters never move), bit for bit. ``how``: ``"guard"`` (a NaN gradient on
    rank 0 under ``skip_nonfinite_steps``) or ``"scaler"`` (``unscale_`` finds an inf, as a loss
    scaler's skipped step does)."""
    torch.manual_seed(0)
    model = BlockNet(24)
    fresh_model = copy.deepcopy(model)
    settings = {"lr": 0.0, "error_feedback": True, "skip_nonfinite_steps": 3}
    opt = _optimizer(model, 2, "int8", 0.002, **settings)
    fresh = _optimizer(fresh_model, 2, "int8", 0.002, **settings)
    x, y = batch(0, 0, rank, 8, torch.float32)
    for step in range(2):  # a send that leaves residuals, then a skipped step
        loss = torch.nn.functional.mse_loss(model(x), y)
        if how == "scaler" and step == 1:
            loss.backward()
            assert opt.engine.unscale_(1e-45)  # gradients x 1e45: inf in fp32, on every rank
            opt.zero_grad()  # what the scaler does with that step
            continue
        (loss * float("nan") if step == 1 and rank == 0 else loss).backward()
        opt.step()
        opt.zero_grad()
    assert opt.skipped_steps == (1 if how == "guard" else 0)
    for m, o in ((model, opt), (fresh_model, fresh)):
        torch.nn.functional.mse_loss(m(x), y).backward()
        o.engine.finish_grad_sync()
    return all(
        torch.equal(a, b)
        for a, b in zip(opt.engine.reducer.grad_shards, fresh.engine.reducer.grad_shards, strict=True)
    )
