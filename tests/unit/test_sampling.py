"""The global-batch sample order of `recipes.data.sampling`, without a process group or Lightning."""

from __future__ import annotations

import numpy as np
import pytest

from recipes.data.sampling import (
    GLOBAL_BATCH_FORMULA,
    BatchLayout,
    DataPosition,
    DataResumeError,
    GlobalBatchSampler,
    check_resume,
    epoch_order,
    global_batch,
)

N = 100
SEED = 3
SPLITS_OF_12 = [(1, 1, 12), (2, 1, 6), (3, 2, 2), (1, 4, 3), (4, 3, 1), (2, 3, 2), (6, 1, 2)]


def sampler(layout: BatchLayout, rank: int, dataset_len: int = N, seed: int = SEED) -> GlobalBatchSampler:
    return GlobalBatchSampler(range(dataset_len), layout, rank, seed, consumed_steps=lambda: 0)


def steps_seen(layout: BatchLayout, first: int, last: int) -> dict[int, list[list[int]]]:
    """{step: [micro-batch, ...] over all ranks} for global batches first..last (iterating epoch by epoch)."""
    per_step: dict[int, list[list[int]]] = {}
    for rank in range(layout.world_size):
        step = first
        while step <= last:
            flat = list(sampler(layout, rank).iter_from(step))
            b, a = layout.micro_batch_size, layout.accumulate
            micro = [flat[i : i + b] for i in range(0, len(flat), b)]
            for i, batch in enumerate(micro):
                per_step.setdefault(step + i // a, []).append(batch)
            step += len(micro) // a
    return {k: v for k, v in per_step.items() if k <= last}


def test_each_global_batch_is_the_same_set_whatever_the_split() -> None:
    expected = {k: sorted(global_batch(N, 12, SEED, k).tolist()) for k in range(20)}  # 8 per epoch
    for w, a, b in SPLITS_OF_12:
        layout = BatchLayout(world_size=w, accumulate=a, micro_batch_size=b)
        seen = steps_seen(layout, 0, 19)
        for step in range(20):
            batches = seen[step]
            assert len(batches) == w * a and all(len(batch) == b for batch in batches), (w, a, b, step)
            assert sorted(i for batch in batches for i in batch) == expected[step], (w, a, b, step)


def test_one_rank_accumulating_equals_two_ranks_micro_batch_for_micro_batch() -> None:
    two_ranks = BatchLayout(world_size=2, accumulate=1, micro_batch_size=6)
    one_rank = BatchLayout(world_size=1, accumulate=2, micro_batch_size=6)
    for rank in (0, 1):  # rank r's batch of a step is micro-batch r of the single rank
        assert (
            list(sampler(two_ranks, rank).iter_from(5))[:6]
            == list(sampler(one_rank, 0).iter_from(5))[6 * rank : 6 * rank + 6]
        )


def test_every_sample_at_most_once_per_epoch_and_the_order_changes_per_epoch() -> None:
    layout = BatchLayout(world_size=3, accumulate=2, micro_batch_size=2)  # G = 12, 8 steps, 4 dropped
    for epoch in range(3):
        indices = [i for rank in range(3) for i in sampler(layout, rank).iter_from(8 * epoch)]
        assert len(indices) == len(set(indices)) == 96
        assert sorted(indices) == sorted(epoch_order(N, SEED, epoch)[:96].tolist())
    assert not np.array_equal(epoch_order(N, SEED, 0), epoch_order(N, SEED, 1))
    assert not np.array_equal(epoch_order(N, SEED, 0), epoch_order(N, SEED + 1, 0))
    assert np.array_equal(global_batch(N, 12, SEED, 9), epoch_order(N, SEED, 1)[12:24])


def test_an_iteration_starts_at_the_consumed_step_and_ends_with_its_epoch() -> None:
    layout = BatchLayout(world_size=2, accumulate=2, micro_batch_size=3)  # G = 12
    consumed = {"steps": 11}
    s = GlobalBatchSampler(range(N), layout, 1, SEED, consumed_steps=lambda: consumed["steps"])
    assert len(s) == 8 * 2 * 3  # a whole epoch for Lightning's counters
    s.set_epoch(7)  # Lightning's epoch counter is ignored
    first = list(s)
    assert len(first) == (16 - 11) * 2 * 3
    assert first[:3] == global_batch(N, 12, SEED, 11)[3:6].tolist()  # micro 0 of rank 1: offset 1 * 3
    assert first[3:6] == global_batch(N, 12, SEED, 11)[9:12].tolist()  # micro 1: offset (1 * 2 + 1) * 3
    consumed["steps"] = 16
    assert list(s)[:3] == global_batch(N, 12, SEED, 16)[3:6].tolist()


def test_take_trained_returns_the_handed_out_batches_in_order() -> None:
    layout = BatchLayout(world_size=1, accumulate=1, micro_batch_size=4)
    s = sampler(layout, 0)
    it = iter(s)
    first, second = [next(it) for _ in range(4)], [next(it) for _ in range(4)]
    assert s.take_trained() == first and s.take_trained() == second


def test_position_round_trips_and_names_its_epoch() -> None:
    layout = BatchLayout(world_size=2, accumulate=3, micro_batch_size=2)
    position = sampler(layout, 0).position(consumed_steps=19)
    state = position.to_dict()
    assert state["consumed_samples"] == 19 * 12 and state["epoch"] == 2 and state["batch_in_epoch"] == 3
    assert DataPosition.from_dict(state) == position


def test_resume_check_accepts_another_split_and_refuses_another_global_batch() -> None:
    saved = sampler(BatchLayout(world_size=2, accumulate=1, micro_batch_size=6), 0).position(5)
    check_resume(saved, BatchLayout(world_size=1, accumulate=3, micro_batch_size=4), N, SEED)
    with pytest.raises(DataResumeError) as refused:
        check_resume(saved, BatchLayout(world_size=1, accumulate=1, micro_batch_size=6), N, SEED)
    message = str(refused.value)
    assert "of 12 samples (2 ranks x 1 micro-batches x 6)" in message and "has 6 samples (1 ranks" in message
    assert GLOBAL_BATCH_FORMULA in message
    with pytest.raises(DataResumeError, match="seed"):
        check_resume(saved, BatchLayout(world_size=2, accumulate=1, micro_batch_size=6), N, SEED + 1)
    with pytest.raises(DataResumeError, match="101 samples"):
        check_resume(saved, BatchLayout(world_size=2, accumulate=1, micro_batch_size=6), N + 1, SEED)


def test_too_small_a_dataset_is_refused() -> None:
    with pytest.raises(ValueError, match="fewer than one global batch"):
        sampler(BatchLayout(world_size=2, accumulate=1, micro_batch_size=6), 0, dataset_len=11)


@pytest.mark.parametrize(("dataset_len", "steps"), [(12, 1), (23, 1), (24, 2)])
def test_a_dataset_of_whole_global_batches_drops_nothing(dataset_len: int, steps: int) -> None:
    """G = 12: 12 samples are one step per epoch, all of them trained; 23 are one step (11 dropped)."""
    layout = BatchLayout(world_size=2, accumulate=1, micro_batch_size=6)
    samplers = [sampler(layout, rank, dataset_len=dataset_len) for rank in (0, 1)]
    assert all(s.steps_per_epoch == steps and len(s) == steps * 6 for s in samplers)
    for epoch in (0, 1):  # step `steps` is the first of epoch 1: another order of the same samples
        trained = sorted(i for s in samplers for i in s.iter_from(epoch * steps))
        expected = sorted(epoch_order(dataset_len, SEED, epoch)[: steps * 12].tolist())
        assert trained == expected and len(set(trained)) == steps * 12
