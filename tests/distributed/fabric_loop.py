"""A Lightning Fabric training loop (and a Trainer twin of it) run by the Fabric tests.

Run as a script it runs several cases in one launch (Fabric's launcher re-runs this file for the
other ranks, which then run the same cases in the same order); rank 0 saves every case's result
(final parameters, and what the case asked to record) to ``--out``::

    python -m tests.distributed.fabric_loop --out result.pt --devices 2 --cases '[{"strategy": "zero"}]'

Data: the global micro-batch ``(step, micro)`` is :data:`GLOBAL_BATCH` rows drawn from a seed of
``(step, micro)``; rank ``r`` of ``N`` trains rows ``[r·G/N, (r+1)·G/N)``. The loss is the mean over
the rank's rows, so every world size that divides ``G`` computes the same gradient.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import lightning as L
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision
from torch import nn

import lightning_zero
from lightning_zero.layout.placeholders import is_freed
from tests.distributed.models import TinyNet, hooks_left, param_groups
from tests.distributed.workers import _defer_gathers

GLOBAL_BATCH = 12


class Holder(nn.Module):
    """TinyNet under the attribute ``net``: the parameter names of the Trainer twin below."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = TinyNet()
        # on the input: after the output layer it would make the output bias's true gradient zero,
        # and Adam turns rounding noise on such a parameter into +-lr steps
        self.bn = nn.BatchNorm1d(7) if batchnorm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x if self.bn is None else self.bn(x))


def global_batch(step: int, micro: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000 * step + micro)
    return torch.randn(GLOBAL_BATCH, 7, generator=g).to(dtype), torch.randn(GLOBAL_BATCH, 5, generator=g).to(
        dtype
    )


def rank_rows(
    step: int, micro: int, rank: int, world_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, micro, dtype)
    size = GLOBAL_BATCH // world_size
    return x[rank * size : (rank + 1) * size], y[rank * size : (rank + 1) * size]


def warmup_cosine(step: int, warmup: int = 3, total: int = 12) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))


def make_fabric(case: dict[str, Any], devices: int) -> Fabric:
    name = case.get("strategy", "zero")
    strategy: Any = name
    if name.startswith("zero") and not case.get("by_name"):  # small buckets: several per model
        names = ("overlap_param_gather", "sharded_checkpoint", "skip_nonfinite_steps", "shard_group_size")
        options = {k: case[k] for k in names if k in case}
        if name == "zero3":  # every layer a unit
            options["min_unit_numel"] = 0
        strategy = lightning_zero.ZeroFabricStrategy(
            stage={"zero1": 1, "zero3": 3}.get(name, 2),
            bucket_cap_mb=0.0005,
            first_bucket_cap_mb=0.0002,
            **options,
        )
    plugins = []
    precision = case.get("precision", "64-true")
    # Fabric casts model outputs to the default dtype: float32 would round "64-true" outputs, and the
    # rounding of their gradients then depends on the rows per rank
    torch.set_default_dtype(torch.float64 if precision == "64-true" else torch.float32)
    if precision == "16-mixed-cpu":  # fp16 autocast and a GradScaler on CPU (Fabric maps 16-mixed to bf16)
        plugins.append(
            MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
        )
        precision = None
    fabric = Fabric(
        accelerator="cpu", devices=devices, strategy=strategy, precision=precision, plugins=plugins
    )
    fabric.launch()
    return fabric


def train(case: dict[str, Any], devices: int) -> dict[str, Any]:
    """The Fabric loop. Case keys: strategy, by_name, overlap_param_gather, steps, accum, clip (max
    norm), clip_value, schedule, eps, precision, inf_at_step, teacher, batchnorm, unfreeze_at, optimizer
    ("SGD"), two_optimizers, separate_setup (refusals), save_at + save (a path), resume (a path),
    resume_trainer (a Trainer checkpoint: model and optimizer, step from its global_step),
    skip_nonfinite_steps, nan_at ([step, micro] pairs where rank 1's loss is NaN), skip_step (no
    backward and no optimizer step then; the scheduler still steps), consolidate (a path: rank 0
    consolidates ``save`` there after the loop), load_raw (a consolidated file: model and optimizer
    state extracted from it, loaded with ``fabric.load_raw``), every_rank (with expect_error: every
    rank's error message, gathered on rank 0)."""
    fabric = make_fabric(case, devices)
    dtype = torch.float64 if case.get("precision", "64-true") == "64-true" else torch.float32
    model = Holder(batchnorm=case.get("batchnorm", False))
    optimizer = torch.optim.AdamW(param_groups(model), lr=0.02, eps=case.get("eps", 1e-8))
    if case.get("optimizer") == "SGD":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if case.get("two_optimizers"):
        fabric.setup(model, optimizer, torch.optim.AdamW(model.parameters()))
    if case.get("separate_setup"):
        model = fabric.setup_module(model)
        fabric.setup_optimizers(optimizer)
    if case.get("teacher"):  # a second model set up without an optimizer: a replica, as under ddp
        teacher = fabric.setup(Holder())
    model, optimizer = fabric.setup(model, optimizer)
    sharded = getattr(fabric.strategy, "sharded_optimizer", None)
    if case.get("overlap_param_gather"):
        _defer_gathers(
            sharded.engine.comm
        )  # gathers run only when waited for: an early read sees stale values
    scheduler = None
    if case.get("schedule", True):
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    if scheduler is not None:
        state["scheduler"] = scheduler
    if case.get("resume"):
        fabric.load(case["resume"], state)
    if case.get("resume_trainer"):  # a Trainer checkpoint: its own loop state comes back as the remainder
        remainder = fabric.load(case["resume_trainer"], {"model": model, "optimizer": optimizer})
        state["step"] = remainder["global_step"]
    if case.get("load_raw"):
        full = torch.load(case["load_raw"], weights_only=True)
        raw = f"{case['load_raw']}.rank{fabric.global_rank}"  # per rank: none reads a half-written file
        torch.save(full["model"], raw + ".model")
        torch.save(full["optimizer"], raw + ".optimizer")
        fabric.load_raw(raw + ".model", model)
        fabric.load_raw(raw + ".optimizer", optimizer)
        state["step"] = full["step"]
        if scheduler is not None:
            scheduler.load_state_dict(full["scheduler"])
    accum, recorded = case.get("accum", 1), {"norms": [], "lrs": [], "elements": [], "skipped": []}
    for step in range(state["step"], case.get("steps", 6)):
        if step == case.get("skip_step"):  # what a step skipped for a non-finite gradient must equal
            recorded["lrs"].append([g["lr"] for g in optimizer.param_groups])
            if scheduler is not None:
                scheduler.step()
            continue
        if step == case.get("unfreeze_at"):  # fine-tuning: a frozen layer joins in a new param group
            model.module.net.frozen.requires_grad_(True)
            optimizer.add_param_group(
                {"params": list(model.module.net.frozen.parameters()), "weight_decay": 0.0}
            )
        if sharded is not None:
            sharded.engine.reset_comm_stats()
        for micro in range(accum):
            x, y = rank_rows(step, micro, fabric.global_rank, fabric.world_size, dtype)
            with fabric.no_backward_sync(model, enabled=micro < accum - 1):
                loss = nn.functional.mse_loss(model(x), y) / accum
                if case.get("teacher"):
                    with torch.no_grad():
                        guide = teacher(x).sum()
                    loss = loss + 0.0 * guide
                if step == case.get("inf_at_step") and fabric.global_rank == 1:
                    loss = loss * float("inf")  # an overflow on one rank only
                if [step, micro] in case.get("nan_at", []) and fabric.global_rank == 1:
                    loss = loss * float("nan")
                fabric.backward(loss)
        if case.get("clip"):
            recorded["norms"].append(float(fabric.clip_gradients(model, optimizer, max_norm=case["clip"])))
        if case.get("clip_value"):
            fabric.clip_gradients(model, optimizer, clip_val=case["clip_value"])
        optimizer.step()
        optimizer.zero_grad()
        recorded["lrs"].append([g["lr"] for g in optimizer.param_groups])
        if case.get("skip_nonfinite_steps"):
            recorded["skipped"].append(optimizer.skipped_steps)  # through Fabric's optimizer wrapper
        if sharded is not None:
            recorded["elements"].append(sharded.engine.comm_stats.elements_sent)
            recorded.setdefault("inter_group", []).append(sharded.engine.replica_comm_stats.elements_sent)
            recorded["inter_group_min"] = sharded.engine.min_replica_elements_per_step()
            recorded["layout"] = sharded.engine.groups.layout
            numel = sum(b.padded_numel for b in sharded.engine.plan.buckets)
            recorded["minimum"] = 2 * numel * (fabric.world_size - 1) // fabric.world_size
        if scheduler is not None:
            scheduler.step()
        state["step"] = step + 1
        if case.get("save_at") == step + 1:
            fabric.save(case["save"], state)
    if case.get("consolidate") and fabric.global_rank == 0:
        from lightning_zero.checkpoint.consolidate import consolidate

        consolidate(case["save"], case["consolidate"])
    fabric.barrier()
    # state_dict() waits for gathers left in flight by overlap_param_gather (named_parameters would not)
    result: dict[str, Any] = {n: t.detach().clone() for n, t in model.module.state_dict().items()}
    mine = torch.cat([t.double().reshape(-1) for t in result.values()])  # each rank against rank 0's
    result["recorded"] = recorded
    result["every_rank_max_diff"] = (fabric.all_gather(mine) - mine).abs().amax(dim=-1).reshape(-1).tolist()
    if sharded is not None and sharded.engine.units is not None:  # stage 3: placeholders between steps
        result["placeholders"] = all(is_freed(p) for p in model.module.net.parameters() if p.requires_grad)
        lightning_zero.unshard(model.module)  # a plain module: none of the strategy's hooks left
        result["hooks_after_unshard"] = hooks_left(model.module)
    if case.get("batchnorm"):  # every rank's buffers: DDP makes them rank 0's before each synced forward
        for name, buffer in model.module.named_buffers():
            result[f"buffer:{name}"] = fabric.all_gather(buffer).detach().clone()
    if case.get("precision") == "16-mixed-cpu":
        result["loss_scale"] = fabric._precision.scaler.get_scale()  # type: ignore[attr-defined]
    return result


class TrainerTwin(L.LightningModule):
    """The Fabric loop as a LightningModule (no schedule): step ``s`` of this fit trains the data of
    loop step ``s + offset``."""

    def __init__(self, offset: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = TinyNet()
        self.offset = offset

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        accum = self.trainer.accumulate_grad_batches
        x, y = rank_rows(
            self.global_step + self.offset,
            batch_idx % accum,
            self.global_rank,
            self.trainer.world_size,
            self.dtype,
        )
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(param_groups(self.net), lr=0.02)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(list(range(1000)), batch_size=1)


def trainer_fit(case: dict[str, Any], devices: int) -> dict[str, Any]:
    """``steps`` Trainer steps (``offset`` into the loop's data), resuming from ``resume``, saving
    the end state to ``save``."""
    torch.set_default_dtype(torch.float64)  # the Fabric loop's parameters are created in float64
    trainer = L.Trainer(
        strategy=lightning_zero.ZeroStrategy(stage=2, bucket_cap_mb=0.0005),
        devices=devices,
        accelerator="cpu",
        precision="64-true",
        max_steps=case["steps"],
        accumulate_grad_batches=case.get("accum", 1),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    model = TrainerTwin(case.get("offset", 0))
    trainer.fit(model, ckpt_path=case.get("resume"))
    if case.get("save"):
        trainer.save_checkpoint(case["save"])
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--cases", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results, rank = [], 0
    for case in json.loads(args.cases):
        try:
            run = trainer_fit if case.get("trainer") else train
            results.append(run(case, args.devices))
        except Exception as err:  # noqa: BLE001 - expected refusals are results too
            if not case.get("expect_error"):
                raise
            results.append({"error": f"{type(err).__name__}: {err}"})
            if case.get("every_rank") and torch.distributed.is_initialized():  # each rank's error, on rank 0
                every_rank = [None] * torch.distributed.get_world_size()
                torch.distributed.all_gather_object(every_rank, results[-1]["error"])
                results[-1]["every_rank"] = every_rank
        rank = int(torch.distributed.get_rank()) if torch.distributed.is_initialized() else 0
    if rank == 0:
        torch.save(results, args.out)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
