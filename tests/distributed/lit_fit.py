"""A LightningModule and a fit driver shared by the Lightning tests.

Run as a script it performs several fits (or validations) in one launch (Lightning's launcher re-runs
this file for the other ranks, which then run the same fits in the same order) and rank 0 saves every
fit's final parameters to ``--out``::

    python -m tests.distributed.lit_fit --out result.pt --cases '[{"strategy": "zero2", "devices": 2}]'
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests.distributed.models import TinyNet, param_groups


class TinyLit(L.LightningModule):
    """TinyNet with AdamW in two groups, a step-wise LR schedule and a parameter unused on steps
    ``2 mod unused_every`` (never unused when 0). ``nan_at``: ``[step, micro-batch]`` pairs where rank
    1's loss is NaN; ``skip_step``: that step's gradients are computed, then dropped on every rank
    before an optimizer step that changes nothing (Lightning refuses a ``None`` loss when distributed)."""

    def __init__(
        self,
        unused_every: int = 3,
        batch_size: int = 4,
        inf_at_step: int | None = None,
        identical_batches: bool = False,
        nan_at: list[list[int]] | None = None,
        skip_step: int | None = None,
    ) -> None:
        super().__init__()
        self.nan_at = nan_at or []
        self.skip_step = skip_step
        self.batch_size = batch_size
        self.identical_batches = identical_batches
        self.inf_at_step = inf_at_step
        torch.manual_seed(0)
        self.net = TinyNet()
        self.unused_every = unused_every

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(
            self.net(x, use_extra=not self.unused_every or self.global_step % self.unused_every != 2), y
        )
        if self.global_step == self.inf_at_step and self.trainer.global_rank == 1:
            loss = loss * float("inf")  # an overflow on one rank only
        micro = batch_idx % self.trainer.accumulate_grad_batches
        if [self.global_step, micro] in self.nan_at and self.trainer.global_rank == 1:
            loss = loss * float("nan")
        self.log("loss", loss)
        return loss

    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None
    ) -> None:
        if self.global_step != self.skip_step:
            optimizer.step(closure=optimizer_closure)
            return

        def discard() -> Any:  # the step runs (Lightning counts it, schedulers step) with no gradient
            loss = optimizer_closure()
            optimizer.zero_grad()
            return loss

        optimizer.step(closure=discard)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def train_dataloader(self) -> DataLoader:
        # explicit, unshuffled sampler: rank r's i-th batch is the slice r::N of the single
        # process's i-th batch
        data = repeated_dataset() if self.identical_batches else dataset()
        sampler = DistributedSampler(
            data, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
        )
        return DataLoader(data, batch_size=self.batch_size, sampler=sampler)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(param_groups(self.net), lr=3e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def dataset(n: int = 512) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 7, generator=g), torch.randn(n, 5, generator=g))


def repeated_dataset(rows: int = 12, repeats: int = 64) -> TensorDataset:
    """``rows`` samples repeated: with ``rows / world_size`` samples per rank, every global batch is the
    same, so a resume test does not depend on where Lightning restarts the data."""
    x, y = dataset(rows).tensors
    return TensorDataset(x.repeat(repeats, 1), y.repeat(repeats, 1))


def make_strategy(
    name: str,
    stage: int | None = None,
    log_comm_stats: bool = False,
    sharded_checkpoint: bool = True,
    async_checkpoint: bool = False,
    skip_nonfinite_steps: int = 0,
    shard_group_size: int | None = None,
    user_mesh: bool = False,
) -> Any:
    if name == "zero_small_buckets":  # several buckets on a tiny model
        import lightning_zero  # here, not at the top: a test loads checkpoints with lightning_zero blocked

        mesh = _user_mesh() if user_mesh else None

        return lightning_zero.ZeroStrategy(
            stage=stage or 2,
            bucket_cap_mb=0.0004,
            first_bucket_cap_mb=0.0002,
            find_unused_parameters=True,
            log_comm_stats=log_comm_stats,
            sharded_checkpoint=sharded_checkpoint,
            async_checkpoint=async_checkpoint,
            skip_nonfinite_steps=skip_nonfinite_steps,
            shard_group_size=shard_group_size,
            device_mesh=mesh,
        )
    return name


def _user_mesh() -> Any:
    """A (2, N/2) mesh built the way a user does under torchrun: the process group initialised first
    (Lightning then finds it initialised and uses it), then ``init_device_mesh``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        os.environ.setdefault("RANK", os.environ["LOCAL_RANK"])  # one node: what torchrun would set
        dist.init_process_group("gloo")
    return init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))


def fit(
    strategy: str = "zero_small_buckets",
    devices: int = 2,
    precision: str = "64-true",
    accum: int = 1,
    clip: float | None = None,
    clip_algorithm: str = "norm",
    steps: int = 10,
    batch_size: int = 4,
    stage: int | None = None,
    unused_every: int = 3,
    save: str | None = None,
    csv_dir: str | None = None,
    inf_at_step: int | None = None,
    identical_batches: bool = False,
    resume: str | None = None,
    resume_rank1: str | None = None,
    sharded_checkpoint: bool = True,
    async_checkpoint: bool = False,
    checkpoint_dir: str | None = None,
    save_last: bool | str = True,
    die_at_save: int | None = None,
    log_every: int = 1,
    gpu_like_teardown: bool = False,
    skip_nonfinite_steps: int = 0,
    nan_at: list[list[int]] | None = None,
    skip_step: int | None = None,
    shard_group_size: int | None = None,
    user_mesh: bool = False,
) -> tuple[int, dict[str, torch.Tensor]]:
    """Fit TinyLit; ``batch_size`` is per rank; ``save``: checkpoint path written at the end; ``csv_dir``:
    log to CSV there, with the strategy's communication figures; ``precision="16-mixed-cpu"``: fp16 autocast
    with a GradScaler on CPU (Lightning itself maps "16-mixed" to bf16 there); ``inf_at_step``: rank 1's loss
    is inf at that step; ``identical_batches``: see :func:`repeated_dataset`; ``resume``:
    ``ckpt_path`` (rank 1's is ``resume_rank1`` where given: a rank handed another path);
    ``checkpoint_dir``: a ModelCheckpoint there every 2 steps (top 2 by step, ``save_last``);
    ``skip_nonfinite_steps``, ``shard_group_size``: the strategy's; ``user_mesh``: a 2-D device mesh the
    "user" builds, passed as the strategy's ``device_mesh``; ``nan_at``, ``skip_step``: see
    :class:`TinyLit`.
    Returns (global rank, final parameters and, with a scaler, ``"loss_scale"``; with
    ``skip_nonfinite_steps``, ``"skipped_steps"``)."""
    if die_at_save is not None:
        _kill_rank1_while_writing(die_at_save)
    flushes = _count_flushes()
    plugins = []
    if precision == "16-mixed-cpu":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=scaler))
        precision = None  # type: ignore[assignment]
    trainer = L.Trainer(
        strategy=make_strategy(
            strategy,
            stage,
            csv_dir is not None,
            sharded_checkpoint,
            async_checkpoint,
            skip_nonfinite_steps,
            shard_group_size,
            user_mesh,
        ),
        devices=devices,
        accelerator="cpu",
        precision=precision,
        max_steps=steps,
        accumulate_grad_batches=accum,
        gradient_clip_val=clip,
        gradient_clip_algorithm=clip_algorithm,
        logger=CSVLogger(csv_dir, name="", version="") if csv_dir else False,
        log_every_n_steps=log_every,
        enable_checkpointing=checkpoint_dir is not None,
        callbacks=[
            ModelCheckpoint(
                checkpoint_dir,
                every_n_train_steps=2,
                save_top_k=2,
                monitor="step",
                mode="max",
                save_last=save_last,
            )
        ]
        if checkpoint_dir
        else [MoveLikeGPUTeardown()]
        if gpu_like_teardown
        else None,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        plugins=plugins,
    )
    model = TinyLit(unused_every, batch_size, inf_at_step, identical_batches, nan_at, skip_step)
    if resume_rank1 is not None and int(os.environ.get("LOCAL_RANK", "0")) == 1:  # one node
        resume = resume_rank1
    trainer.fit(model, ckpt_path=resume)
    if save:
        trainer.save_checkpoint(save)
    result = {n: p.detach().clone() for n, p in model.named_parameters()}
    if plugins:
        result["loss_scale"] = torch.tensor(plugins[0].scaler.get_scale())
    if csv_dir:  # the communication figures were logged: how often they synchronised
        result["flushes"] = torch.tensor(flushes[0])
    if skip_nonfinite_steps:
        result["skipped_steps"] = torch.tensor(trainer.strategy.sharded_optimizer.skipped_steps)
    if shard_group_size or user_mesh:  # the layout the engine ran: replica groups, ranks per group
        groups = trainer.strategy.sharded_optimizer.engine.groups
        result["layout"] = torch.tensor([groups.replicas.world_size, groups.shard.world_size])
    return trainer.global_rank, result


class MoveLikeGPUTeardown(L.Callback):
    """What Lightning's teardown does to a module on a GPU (``module.cpu()``): every parameter gets new
    storage. Installed before the strategy's teardown, which calls ``cpu()``."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        def cpu() -> L.LightningModule:
            for p in pl_module.parameters():
                p.data = p.data.clone()
            return pl_module

        pl_module.cpu = cpu  # type: ignore[method-assign]


def _count_flushes() -> list[int]:
    """How often the engine's device timings are read (a device synchronisation on CUDA)."""
    from lightning_zero.engine import ShardEngine

    count = [0]
    original = ShardEngine.flush_timings

    def flush(self: Any) -> None:
        count[0] += 1
        original(self)

    ShardEngine.flush_timings = flush  # type: ignore[method-assign]
    return count


def validate(validate_ckpt: str) -> tuple[int, dict[str, torch.Tensor]]:
    """``trainer.validate(ckpt_path=validate_ckpt)`` of a fresh TinyLit under "zero" on one device (no
    optimizer: whole parameters read from the shards). Returns (global rank, the loaded parameters)."""
    import lightning_zero

    model = TinyLit()
    trainer = L.Trainer(
        strategy=lightning_zero.ZeroStrategy(),
        devices=1,
        accelerator="cpu",
        precision="64-true",
        logger=False,
        enable_progress_bar=False,
    )
    trainer.validate(model, DataLoader(dataset(24), batch_size=12), ckpt_path=validate_ckpt)
    return trainer.global_rank, {n: p.detach().clone() for n, p in model.named_parameters()}


def _kill_rank1_while_writing(save_number: int) -> None:
    """Fault injection: rank 1 dies half-way through writing its shard file in save ``save_number``."""
    import lightning_zero.checkpoint.format as checkpoint_module

    original = checkpoint_module._write
    calls = {"n": 0}

    def write(obj: Any, path: Any) -> Any:
        if path.name.startswith("shard-00001"):
            calls["n"] += 1
            if calls["n"] == save_number:
                path.write_bytes(b"partial")
                os._exit(17)
        return original(obj, path)

    checkpoint_module._write = write


def main() -> None:
    import lightning_zero  # noqa: F401  # registers "zero", "zero1", "zero2" for cases naming them

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--cases",
        required=True,
        help='JSON list of keyword-argument dicts for fit(), or for validate() (those with "validate_ckpt"); '
        'a case with "expect_error": true records its error message instead of failing',
    )
    args = parser.parse_args()
    results: list[Any] = []
    rank = 0
    for case in json.loads(args.cases):
        expect_error = case.pop("expect_error", False)
        try:
            rank, params = validate(**case) if "validate_ckpt" in case else fit(**case)
        except Exception as err:  # noqa: BLE001 - an expected error is this case's result, on every rank
            if not expect_error:
                raise
            message = f"{type(err).__name__}: {err}"
            distributed = torch.distributed.is_initialized()
            rank = torch.distributed.get_rank() if distributed else 0
            every_rank = [None] * (torch.distributed.get_world_size() if distributed else 1)
            if distributed:  # every rank must have raised, or this blocks and the launch times out
                torch.distributed.all_gather_object(every_rank, message)
            else:
                every_rank = [message]
            results.append({"error": message, "every_rank": every_rank})
            continue
        results.append(params)
    if rank == 0:
        torch.save(results, args.out)
    if torch.distributed.is_initialized():
        # an interpreter exit with a live gloo group can abort in its threads' destructors
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
