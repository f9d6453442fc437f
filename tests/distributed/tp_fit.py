"""Trainer fits of a tensor-parallel LightningModule on 4 CPU ranks (tensor 2 x data 2), launched by
``tests/distributed/test_tensor_parallel_trainer.py``: ``ZeroStrategy(tensor_parallel_size=2)`` at each
stage, and Lightning's ``ModelParallelStrategy`` (FSDP2 over the data-parallel mesh) as the peer. The
LightningModule's ``configure_model`` is the one a ``ModelParallelStrategy`` user writes; rank 0 saves
every fit's full parameters."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from tests.distributed.workers_tp import SEQ, VOCAB, SequenceBlock, full_parameters, tensor_parallel_plan

SAMPLES, BATCH, STEPS, ACCUM, CLIP, LR = 32, 2, 3, 2, 0.5, 0.05
ROOT = Path(".")  # where checkpoints go: beside --out (set in main)


def dataset() -> TensorDataset:
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=torch.Generator().manual_seed(7))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:], torch.arange(SAMPLES))


class TensorParallelModule(pl.LightningModule):
    def __init__(self, fsdp: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = SequenceBlock()
        self.fsdp = fsdp
        self.seen: list[torch.Tensor] = []

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(self.net, self.device_mesh["tensor_parallel"], tensor_parallel_plan())
        if self.fsdp:  # ModelParallelStrategy leaves the data-parallel sharding to the user
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: tuple[torch.Tensor, ...], index: int) -> torch.Tensor:
        tokens, targets, samples = batch
        self.seen.append(samples.clone())  # which samples this rank trained on, in order
        return F.cross_entropy(self.net(tokens).reshape(-1, VOCAB), targets.reshape(-1))

    def validation_step(self, batch: tuple[torch.Tensor, ...], index: int) -> torch.Tensor:
        tokens, targets, _ = batch
        return F.cross_entropy(self.net(tokens).reshape(-1, VOCAB), targets.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)


def _trainer(strategy: Any, max_steps: int, **kwargs: Any) -> pl.Trainer:
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 4,
        "max_steps": max_steps,
        "accumulate_grad_batches": ACCUM,
        "gradient_clip_val": CLIP,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return pl.Trainer(strategy=strategy, **{**settings, **kwargs})


def resumed(case: dict[str, Any], root: Path) -> dict[str, Any]:
    """Lightning's checkpointing with tensor parallelism: a stage-2 fit saves a sharded checkpoint at
    step 2 (ModelCheckpoint), a stage-3 fit resumes it to step 3, and a validation of a fresh module
    with ``ckpt_path`` loads the step-2 weights (each rank its slices of the whole tensors)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    loader = DataLoader(dataset(), batch_size=BATCH, shuffle=False)
    saver = ModelCheckpoint(dirpath=root, every_n_train_steps=2)
    first = TensorParallelModule()
    strategy = lightning_zero.ZeroStrategy(stage=2, tensor_parallel_size=2)
    trainer = _trainer(strategy, 2, callbacks=[saver], enable_checkpointing=True)
    trainer.fit(first, loader)
    saved = full_parameters(first.net)
    path = saver.last_model_path or saver.best_model_path
    second = TensorParallelModule()
    strategy = lightning_zero.ZeroStrategy(stage=case["stage"], tensor_parallel_size=2)
    _trainer(strategy, STEPS).fit(second, loader, ckpt_path=path)
    with lightning_zero.gathered(second.net) if case["stage"] == 3 else contextlib.nullcontext():
        params = full_parameters(second.net)
    fresh = TensorParallelModule()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    checker = _trainer(lightning_zero.ZeroStrategy(stage=2, tensor_parallel_size=2), 1, limit_val_batches=1)
    checker.validate(fresh, DataLoader(dataset(), batch_size=BATCH), ckpt_path=path)
    loaded = full_parameters(fresh.net)
    diff = max(float((loaded[n] - saved[n]).abs().max()) for n in saved)
    return {"params": params, "seen": torch.cat(first.seen + second.seen), "loaded_diff": diff, "path": path}


def fabric_loop(case: dict[str, Any]) -> dict[str, Any]:
    """The same training as a Fabric loop: the model parallelized over the strategy's mesh after
    launch, accumulation under ``no_backward_sync``, ``fabric.clip_gradients``."""
    from lightning.fabric import Fabric
    from torch.distributed.tensor.parallel import parallelize_module

    strategy = lightning_zero.ZeroFabricStrategy(stage=case["stage"], tensor_parallel_size=2)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=4)
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True) if case.get("deferred") else contextlib.nullcontext():
        block = SequenceBlock()
    net = parallelize_module(block, strategy.device_mesh["tensor_parallel"], tensor_parallel_plan())
    assert all(p.is_meta for p in net.parameters()) == bool(case.get("deferred"))
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
    model, opt = fabric.setup(net, opt)
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=BATCH, shuffle=False))
    seen, batches = [], iter(loader)
    for _ in range(STEPS):
        for micro in range(ACCUM):
            tokens, targets, samples = next(batches)
            seen.append(samples.clone())
            with fabric.no_backward_sync(model, enabled=micro < ACCUM - 1):
                loss = F.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))
                fabric.backward(loss / ACCUM)
        fabric.clip_gradients(model, opt, max_norm=CLIP)
        opt.step()
        opt.zero_grad()
    with lightning_zero.gathered(net) if case["stage"] == 3 else contextlib.nullcontext():
        params = full_parameters(net)
    # fabric.save writes every tensor rank's slices; fabric.load of a zeroed model restores them
    path = ROOT / f"fabric{case['stage']}"
    fabric.save(path, {"model": model, "optimizer": opt})
    with torch.no_grad(), lightning_zero.gathered(net) if case["stage"] == 3 else contextlib.nullcontext():
        for p in net.parameters():
            p.zero_()
    fabric.load(path, {"model": model, "optimizer": opt})
    with lightning_zero.gathered(net) if case["stage"] == 3 else contextlib.nullcontext():
        loaded = full_parameters(net)
    diff = max(float((loaded[n] - params[n]).abs().max()) for n in params)
    return {"params": params, "seen": torch.cat(seen), "loaded_diff": diff}


def fit(case: dict[str, Any]) -> dict[str, Any]:
    from lightning.pytorch.strategies import ModelParallelStrategy

    if case["strategy"] == "resume":
        return resumed(case, ROOT)
    if case["strategy"] == "fabric":
        return fabric_loop(case)
    peer = case["strategy"] == "model_parallel"
    if peer:
        strategy: Any = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
    else:
        hybrid = {"shard_group_size": case["shard_group_size"]} if "shard_group_size" in case else {}
        strategy = lightning_zero.ZeroStrategy(stage=case["stage"], tensor_parallel_size=2, **hybrid)
    trainer = _trainer(strategy, STEPS)
    torch.manual_seed(0)  # where a deferred build's initialization starts (init_module's entry)
    with trainer.init_module(empty_init=True) if case.get("deferred") else contextlib.nullcontext():
        module = TensorParallelModule(fsdp=peer)
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH, shuffle=False))
    stage3 = not peer and case["stage"] == 3
    with lightning_zero.gathered(module.net) if stage3 else contextlib.nullcontext():
        params = full_parameters(module.net)
    layout = "" if peer else strategy.sharded_optimizer.engine.groups.layout  # replicas x shard ranks
    return {"params": params, "seen": torch.cat(module.seen), "layout": layout}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True)
    args = parser.parse_args()
    global ROOT
    ROOT = Path(args.out).parent / "checkpoints"
    torch.set_default_dtype(torch.float64)
    results = {case["name"]: fit(case) for case in json.loads(args.cases)}
    seen = {name: r.pop("seen") for name, r in results.items() if "seen" in r}
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    if dist.get_rank() == 0:
        torch.save({"results": results, "seen": everyone}, args.out)


if __name__ == "__main__":
    main()
