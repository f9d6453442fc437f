"""Global-batch sampling: the order of training samples as a pure function of (seed, epoch, index).

Order. A map-style dataset of `dataset_len` samples is permuted once per epoch,
`numpy.random.default_rng([seed, epoch]).permutation(dataset_len)`, and cut into global batches of
`G = world_size x accumulate x micro_batch_size` samples; the last `dataset_len % G` samples of each
epoch's permutation are dropped (every epoch has `steps_per_epoch = dataset_len // G` full global
batches, so no optimizer step ever sees a partial one). Global batch `k`, counted over all epochs, is
`permutation(epoch = k // steps_per_epoch)[i * G : (i + 1) * G]` with `i = k % steps_per_epoch`.

Split. Global batch `k` is cut into `world_size x accumulate` consecutive micro-batches of
`micro_batch_size`; rank `r` trains micro-batch `m * world_size + r` as its `m`-th micro-batch of
step `k` (micro-step major: micro-step `m` of all ranks together covers one contiguous chunk). Each
optimizer step therefore sees the same set of samples for every `(world_size, accumulate,
micro_batch_size)` with the same `G`; only which rank computes which sample changes. With equal-size
micro-batches and mean losses, the averaged gradient is the mean over the global batch either way.

Position. Training position = the number of global batches the optimizer has consumed (for a
Lightning run, `trainer.global_step`). `GlobalBatchSampler` reads it through a callable at the start
of every iteration and yields this rank's samples from the next unconsumed global batch to the end
of that batch's epoch. So what the loader's workers or Lightning's fetcher prefetched and never
trained does not move the position, and a resume on any world size with the same `G` continues with
the same global batches. `DataPosition` is the record a checkpoint keeps of it; `check_resume`
refuses a resume that cannot continue the same order (another `G`, dataset size or seed).

Limits: each iteration materialises its epoch's permutation (8 bytes per sample, per rank).

This module depends on torch and numpy only (no process group, no Lightning); `recipes.data.resume`
connects it to a Lightning data module.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sized
from dataclasses import asdict, dataclass
from typing import Any, cast

import numpy as np
from torch.utils.data import Dataset, DistributedSampler

GLOBAL_BATCH_FORMULA = "devices x num_nodes x accumulate_grad_batches x batch_size"
YIELDED_KEPT = 256
"""Index batches a sampler remembers between handing them out and their training (a bound on memory)."""


class DataResumeError(ValueError):
    """A checkpoint's data position cannot be continued exactly by this run's configuration."""


@dataclass(frozen=True, kw_only=True)
class BatchLayout:
    """How one global batch is split over ranks and micro-batches."""

    world_size: int
    """Data-parallel ranks (devices x num_nodes / parallelism.tensor: the ranks of one tensor-parallel
    group train the same samples)."""
    accumulate: int
    """Micro-batches per rank and optimizer step (Lightning's accumulate_grad_batches)."""
    micro_batch_size: int
    """Samples per micro-batch on one rank (the recipe's data.batch_size)."""

    def __post_init__(self) -> None:
        if min(self.world_size, self.accumulate, self.micro_batch_size) < 1:
            raise ValueError(f"every field of {self} must be >= 1")

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all ranks (G)."""
        return self.world_size * self.accumulate * self.micro_batch_size

    def describe(self) -> str:
        """`G samples (W x A x B)`, for error messages."""
        return (
            f"{self.global_batch_size} samples ({self.world_size} ranks x {self.accumulate} micro-batches "
            f"x {self.micro_batch_size})"
        )


def steps_per_epoch(dataset_len: int, global_batch_size: int) -> int:
    """Full global batches in one epoch (the remainder `dataset_len % G` is dropped)."""
    return dataset_len // global_batch_size


def epoch_order(dataset_len: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of `range(dataset_len)` that epoch `epoch` trains in."""
    return np.random.default_rng([seed, epoch]).permutation(dataset_len)  # (dataset_len,)


def global_batch(dataset_len: int, global_batch_size: int, seed: int, step: int) -> np.ndarray:
    """Sample indices of global batch `step` (counted over all epochs), in micro-batch order."""
    per_epoch = steps_per_epoch(dataset_len, global_batch_size)
    if per_epoch == 0:
        raise ValueError(f"{dataset_len} samples hold no global batch of {global_batch_size}")
    epoch, index = divmod(step, per_epoch)
    order = epoch_order(dataset_len, seed, epoch)
    return order[index * global_batch_size : (index + 1) * global_batch_size]  # (G,)


def micro_batch_offset(layout: BatchLayout, rank: int, micro: int) -> int:
    """Offset in a global batch of the first sample of rank `rank`'s micro-batch `micro`."""
    return (micro * layout.world_size + rank) * layout.micro_batch_size


@dataclass(frozen=True, kw_only=True)
class DataPosition:
    """Where training stands in the sample order; the record a checkpoint keeps."""

    consumed_samples: int
    """Samples the optimizer has consumed (consumed global batches x global_batch_size)."""
    global_batch_size: int
    world_size: int
    accumulate: int
    micro_batch_size: int
    dataset_len: int
    seed: int

    @property
    def consumed_steps(self) -> int:
        return self.consumed_samples // self.global_batch_size

    @property
    def epoch(self) -> int:
        """Epoch of the next global batch."""
        return self.consumed_steps // steps_per_epoch(self.dataset_len, self.global_batch_size)

    @property
    def batch_in_epoch(self) -> int:
        """Index of the next global batch within its epoch."""
        return self.consumed_steps % steps_per_epoch(self.dataset_len, self.global_batch_size)

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> DataPosition:
        return cls(**{k: int(v) for k, v in state.items() if k not in ("epoch", "batch_in_epoch")})


def check_resume(saved: DataPosition, layout: BatchLayout, dataset_len: int, seed: int) -> None:
    """Refuse a resume that would not continue the saved sample order exactly.

    A different split of the same global batch (world size, accumulation, micro-batch size) is fine.

    Raises:
        DataResumeError: the global batch, the dataset size or the seed differ from the checkpoint's.
    """
    if layout.global_batch_size != saved.global_batch_size:
        was = BatchLayout(
            world_size=saved.world_size, accumulate=saved.accumulate, micro_batch_size=saved.micro_batch_size
        )
        raise DataResumeError(
            f"the checkpoint was trained with a global batch of {was.describe()}, this run has "
            f"{layout.describe()}. An exact data resume needs the same global batch "
            f"({GLOBAL_BATCH_FORMULA} = {saved.global_batch_size}): change trainer.accumulate_grad_batches "
            "or data.batch_size to keep the product, or start a new run (ckpt_path=null)."
        )
    if dataset_len != saved.dataset_len or seed != saved.seed:
        raise DataResumeError(
            f"the checkpoint's sample order is over {saved.dataset_len} training samples with seed "
            f"{saved.seed}, this run has {dataset_len} samples with seed {seed}: the same data and "
            "data.seed are needed to continue the order; or start a new run (ckpt_path=null)."
        )


class GlobalBatchSampler(DistributedSampler):
    """This rank's samples of every global batch, from the next unconsumed one to the end of its epoch.

    Use it as the `sampler` of a `DataLoader(batch_size=layout.micro_batch_size, drop_last=True)`: each
    run of `micro_batch_size` consecutive indices is one micro-batch (`__len__` is a multiple of it).
    It subclasses `DistributedSampler` so that Lightning, which replaces any other sampler with its own
    `DistributedSampler` under `use_distributed_sampler=True`, leaves it in place; `set_epoch` is
    ignored because the epoch follows from the consumed step count.

    `consumed_steps()` is read at the start of every iteration. `yielded` holds the newest
    `YIELDED_KEPT` index batches of the current iteration that were handed out and not yet taken with
    `take_trained`, for callers that record which samples were trained (loader prefetching must stay
    below that depth: workers x prefetch_factor + Lightning's one batch).
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        layout: BatchLayout,
        rank: int,
        seed: int,
        consumed_steps: Callable[[], int],
    ) -> None:
        if not 0 <= rank < layout.world_size:
            raise ValueError(f"rank {rank} is outside world size {layout.world_size}")
        super().__init__(dataset, num_replicas=layout.world_size, rank=rank, shuffle=False, drop_last=True)
        self.layout = layout
        self.dataset_len = len(cast(Sized, dataset))  # a map-style dataset with __len__
        self.seed = seed
        self.consumed_steps = consumed_steps
        self.steps_per_epoch = steps_per_epoch(self.dataset_len, layout.global_batch_size)
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the dataset has {self.dataset_len} samples, fewer than one global batch of "
                f"{layout.describe()}"
            )
        self.num_samples = self.steps_per_epoch * layout.accumulate * layout.micro_batch_size
        self.total_size = self.num_samples * layout.world_size
        self.yielded: deque[list[int]] = deque(maxlen=YIELDED_KEPT)

    def __len__(self) -> int:
        return self.num_samples  # per epoch; an iteration resumed mid-epoch yields only the rest

    def set_epoch(self, epoch: int) -> None:
        pass  # the epoch is consumed_steps() // steps_per_epoch, not Lightning's epoch counter

    def __iter__(self) -> Iterator[int]:
        return self.iter_from(self.consumed_steps())

    def iter_from(self, step: int) -> Iterator[int]:
        """This rank's indices of global batches `step`, `step + 1`, ... to the end of their epoch."""
        self.yielded.clear()
        layout, size = self.layout, self.layout.micro_batch_size
        epoch, first = divmod(step, self.steps_per_epoch)
        order = epoch_order(self.dataset_len, self.seed, epoch)  # (dataset_len,)
        for index in range(first, self.steps_per_epoch):
            base = index * layout.global_batch_size
            for micro in range(layout.accumulate):
                start = base + micro_batch_offset(layout, self.rank, micro)
                batch = order[start : start + size].tolist()
                self.yielded.append(batch)
                yield from batch

    def take_trained(self) -> list[int]:
        """The oldest index batch handed out and not yet taken: the one being trained now."""
        return self.yielded.popleft()

    def position(self, consumed_steps: int) -> DataPosition:
        """The record of having consumed `consumed_steps` global batches."""
        layout = self.layout
        return DataPosition(
            consumed_samples=consumed_steps * layout.global_batch_size,
            global_batch_size=layout.global_batch_size,
            world_size=layout.world_size,
            accumulate=layout.accumulate,
            micro_batch_size=layout.micro_batch_size,
            dataset_len=self.dataset_len,
            seed=self.seed,
        )
