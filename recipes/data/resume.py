"""Exact data-position resume for a Lightning data module (the glue around `recipes.data.sampling`).

`TrainDataResume` is held by a `LightningDataModule`, which delegates three things to it:

  * `loader(trainer, dataset, ...)` in `train_dataloader()`: a `DataLoader` over a
    `GlobalBatchSampler` whose position is `trainer.global_step`, the number of optimizer steps, each
    of which consumed exactly one global batch. Lightning restores `global_step` from the checkpoint
    before it asks for the loader, and the sampler reads it again at the start of every iteration,
    so a resume continues with the next global batch the optimizer has not seen, whatever the loop's
    own batch counters, the loader's workers or Lightning's fetcher had prefetched.
  * `state_dict(trainer)` in the module's `state_dict()`: the position record (`DataPosition`:
    consumed samples, global batch and its split, dataset size, seed), saved by Lightning in every
    checkpoint under the data module's class name.
  * `load_state_dict(state)` in the module's `load_state_dict()`: keeps the record; the next
    `loader()` call checks it against this run (`recipes.data.sampling.check_resume`): another global
    batch `devices x num_nodes x accumulate_grad_batches x batch_size`, dataset size or seed is refused
    with a `DataResumeError` before the first batch; another world size with the same global batch
    continues exactly. Ranks count as the strategy deals data (`data_parallel`): the ranks of one
    tensor-parallel group are one data-parallel rank.

Limits: automatic optimization with one optimizer (`global_step` must count global batches);
`accumulate_grad_batches` fixed for the whole run (no `GradientAccumulationScheduler`); a checkpoint
written between the micro-batches of one optimizer step resumes at the start of that global batch,
but Lightning then steps after the remaining micro-batches only, so it is refused (the recipe saves
at step boundaries). `TrainedSamples` is a callback that records which samples each data-parallel
rank trained.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from recipes.data.sampling import BatchLayout, DataPosition, DataResumeError, GlobalBatchSampler, check_resume


def data_parallel(trainer: pl.Trainer) -> tuple[int, int]:
    """(data-parallel ranks, this rank's index among them), as the strategy deals data
    (`distributed_sampler_kwargs`): under tensor parallelism the `T` ranks of a tensor-parallel group
    are one data-parallel rank and train the same samples; one rank without a parallel strategy."""
    kwargs = trainer.distributed_sampler_kwargs
    if kwargs is None:
        return 1, 0
    return int(kwargs["num_replicas"]), int(kwargs["rank"])


def pipeline_stages(trainer: pl.Trainer) -> int:
    """The pipeline stages the strategy runs the model as (its `pipeline_parallel` mesh dimension, which
    it sets on the LightningModule); 1 without a pipeline."""
    module = trainer.lightning_module
    mesh = None if module is None else module.device_mesh
    if mesh is None or "pipeline_parallel" not in (mesh.mesh_dim_names or ()):
        return 1
    return int(mesh["pipeline_parallel"].size())


def model_parallel_rank(module: pl.LightningModule, dimension: str) -> int:
    """This rank's index along `dimension` of the module's device mesh (`"tensor_parallel"`,
    `"pipeline_parallel"`: set by a strategy with tensor or pipeline parallelism); 0 without one."""
    mesh = module.device_mesh
    if mesh is None or dimension not in (mesh.mesh_dim_names or ()):
        return 0
    return mesh[dimension].get_local_rank()


def batch_layout(trainer: pl.Trainer | None, micro_batch_size: int) -> BatchLayout:
    """The global batch of `trainer`: data-parallel ranks x accumulate_grad_batches x `micro_batch_size`
    (one rank, no accumulation without a trainer)."""
    return BatchLayout(
        world_size=data_parallel(trainer)[0] if trainer is not None else 1,
        accumulate=trainer.accumulate_grad_batches if trainer is not None else 1,
        micro_batch_size=micro_batch_size,
    )


def _start_next_epoch_afresh(trainer: pl.Trainer) -> None:
    """Zero the restored per-epoch batch count when the restored epoch had already finished.

    With `max_steps` set, Lightning 2.6.6 always resumes as "restarting" and then keeps the finished
    epoch's batch count: the next epoch ends after one micro-batch and steps on it (a partial global
    batch when accumulating). A fresh count gives the next epoch all its batches, as uninterrupted.
    """
    epochs = trainer.fit_loop.epoch_progress.current  # a _ProcessedTracker (typed as its base class)
    batches = trainer.fit_loop.epoch_loop.batch_progress
    if epochs.processed == epochs.started and batches.current.ready > 0:  # type: ignore[attr-defined]
        batches.reset_on_run()


def _check_step_boundary(trainer: pl.Trainer) -> None:
    """Refuse a restored loop that stands between the micro-batches of one optimizer step."""
    ready = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    if ready % trainer.accumulate_grad_batches != 0:
        raise DataResumeError(
            f"the checkpoint was written after micro-batch {ready} of its epoch, inside an optimizer step "
            f"of accumulate_grad_batches={trainer.accumulate_grad_batches}: its accumulated gradient is "
            "not in the checkpoint and the step cannot be repeated exactly; resume from a checkpoint "
            "written at a step boundary (ModelCheckpoint(every_n_train_steps=...), the SLURM requeue save)"
        )


class _PositionedLoader(DataLoader[Any]):
    """A `DataLoader` that Lightning recognises as resumable (it has `state_dict`/`load_state_dict`).

    Its position is its sampler's, read from the trainer's step count, so it has no state of its own;
    being "stateful" only stops Lightning from warning, at every mid-epoch resume, that the loader is
    not resumable and the results may be unreliable.
    """

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class TrainDataResume:
    """Builds the training loader of a data module and saves, restores and checks its position."""

    def __init__(self) -> None:
        self.sampler: GlobalBatchSampler | None = None
        self._saved: DataPosition | None = None

    def loader(
        self,
        trainer: pl.Trainer | None,
        dataset: Dataset[Any],
        *,
        micro_batch_size: int,
        seed: int,
        num_workers: int = 0,
    ) -> DataLoader[Any]:
        """The training `DataLoader` of this rank; call it from `train_dataloader()` on every rank.

        Without a trainer (a data module used on its own) it is the single-rank order from step 0.

        Raises:
            DataResumeError: the restored position cannot be continued with this configuration.
        """
        layout = batch_layout(trainer, micro_batch_size)
        dataset_len = len(dataset)  # type: ignore[arg-type]
        if trainer is None:
            self.sampler = GlobalBatchSampler(dataset, layout, 0, seed, consumed_steps=lambda: 0)
            return self._data_loader(dataset, micro_batch_size, num_workers)
        if self._saved is not None:
            check_resume(self._saved, layout, dataset_len, seed)
            if self._saved.consumed_steps != trainer.global_step:
                raise DataResumeError(
                    f"the checkpoint's data position ({self._saved.consumed_steps} global batches) differs "
                    f"from its optimizer step count ({trainer.global_step})"
                )
            self._saved = None  # checked once: a reloaded loader later in the run is no resume
        _start_next_epoch_afresh(trainer)  # also for a checkpoint without a position record
        _check_step_boundary(trainer)

        def consumed_steps() -> int:
            if trainer.accumulate_grad_batches != layout.accumulate:
                raise DataResumeError(
                    f"accumulate_grad_batches changed from {layout.accumulate} to "
                    f"{trainer.accumulate_grad_batches} during training; the sample order needs a fixed "
                    "global batch"
                )
            return trainer.global_step

        rank = data_parallel(trainer)[1]
        self.sampler = GlobalBatchSampler(dataset, layout, rank, seed, consumed_steps)
        return self._data_loader(dataset, micro_batch_size, num_workers)

    def _data_loader(self, dataset: Dataset[Any], micro_batch_size: int, num_workers: int) -> DataLoader[Any]:
        return _PositionedLoader(
            dataset,
            batch_size=micro_batch_size,
            sampler=self.sampler,
            drop_last=True,  # the sampler's length is a multiple of micro_batch_size: nothing is dropped
            num_workers=num_workers,
            persistent_workers=num_workers > 0,
        )

    def state_dict(self, trainer: pl.Trainer) -> dict[str, Any]:
        """The position after `trainer.global_step` optimizer steps ({} before a training loader exists)."""
        if self.sampler is None:
            return {}
        return {"position": self.sampler.position(trainer.global_step).to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep a checkpoint's position for the check in the next `loader()` call."""
        self._saved = DataPosition.from_dict(state["position"]) if "position" in state else None


class TrainedSamples(Callback):
    """Appends the sample indices of every trained micro-batch to `<dirpath>/rank<R>.txt`, `R` the
    data-parallel rank (the sampler's).

    One line per micro-batch: `step index index ...`, `step` being the 0-based optimizer step the
    micro-batch is part of. Files are appended to, so a resumed run continues them. Under tensor
    parallelism the `T` ranks of a group train the same samples: only the group's first rank (tensor
    rank 0) writes its data-parallel rank's file, so there is one file per data-parallel rank, each
    line once; the same under pipeline parallelism (pipeline rank 0 writes). Needs a training loader
    built by `TrainDataResume`.
    """

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)
        self._step = 0

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int
    ) -> None:
        self._step = trainer.global_step

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: object,
        batch: object,
        batch_idx: int,
    ) -> None:
        sampler = getattr(trainer.train_dataloader, "sampler", None)
        if not isinstance(sampler, GlobalBatchSampler):
            raise TypeError(
                "TrainedSamples needs a training DataLoader whose sampler is a GlobalBatchSampler"
            )
        indices = sampler.take_trained()  # on every rank: each sampler hands out its own queue
        if any(model_parallel_rank(pl_module, d) for d in ("tensor_parallel", "pipeline_parallel")):
            return  # the first rank of the model-parallel group writes the samples the group trained
        self.dirpath.mkdir(parents=True, exist_ok=True)
        with (self.dirpath / f"rank{sampler.rank}.txt").open("a") as handle:
            handle.write(f"{self._step} {' '.join(map(str, indices))}\n")
