"""Exact data-position resume on one process: every way a checkpoint is written continues the order.

Each fit trains on samples that carry their index (`tests.distributed.resume_fit`), so the test
compares what the optimizer actually saw: the rows `(global_step, sample indices)` of the first run
up to the checkpoint plus those of the resumed run must equal the uninterrupted run's, and the final
float64 parameters must be bit-identical. Multi-rank resumes are in
`tests/distributed/test_data_resume.py`.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import DataLoader

import recipes.training.callbacks
from recipes.data.sampling import BatchLayout, DataResumeError, GlobalBatchSampler
from tests.distributed.resume_fit import IndexedSamples, expected_rows, fit
from tests.recipes.params import assert_same_parameters

ACCUM, BATCH = 2, 4  # G = 8: 15 steps per epoch of 123 samples
STEPS = 20  # crosses the end of epoch 0


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, Any]:
    full = fit(accum=ACCUM, batch_size=BATCH, steps=STEPS)
    assert full["trained"] == expected_rows(STEPS, 1, ACCUM, BATCH)  # the documented order and split
    return full


def assert_continues(first: dict[str, Any], resumed: dict[str, Any], full: dict[str, Any]) -> None:
    start = resumed["trained"][0][0]
    rows = [row for row in first["trained"] if row[0] < start] + resumed["trained"]
    assert [row[0] for row in rows] == [row[0] for row in full["trained"]], "steps trained twice or skipped"
    assert rows == full["trained"], "samples differ from the uninterrupted order"
    assert_same_parameters(resumed["params"], full["params"])


@pytest.fixture(autouse=True)
def no_scontrol(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recipes.training.callbacks.subprocess, "run", lambda *args, **kwargs: None)


@pytest.mark.parametrize(
    "how",
    [
        "save_checkpoint mid-epoch",
        "save_checkpoint at the end of an epoch",
        "ModelCheckpoint every_n_train_steps at the end of an epoch",
        "ModelCheckpoint at the end of an epoch",
        "SLURM requeue signalled inside an accumulation",
    ],
)
def test_resume_continues_the_sample_order(how: str, tmp_path: Path, uninterrupted: dict[str, Any]) -> None:
    common = {"accum": ACCUM, "batch_size": BATCH}
    if how.startswith("save_checkpoint"):
        stop = 7 if "mid" in how else 15
        first = fit(**common, steps=stop, save=str(tmp_path / "a.ckpt"))
        ckpt = tmp_path / "a.ckpt"
    elif how.startswith("ModelCheckpoint"):
        every = {"every_n_steps": 15} if "every_n" in how else {"every_n_epochs": 1}
        first = fit(**common, steps=17, checkpoint_dir=str(tmp_path), **every)
        ckpt = tmp_path / "step=15.ckpt"
    else:  # the signal arrives after the first micro-batch of step 4; the save waits for the step's end
        first = fit(**common, steps=STEPS, requeue_at=4, checkpoint_dir=str(tmp_path))
        ckpt = tmp_path / "last.ckpt"
        assert first["global_step"] == 5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = fit(**common, steps=STEPS, resume=str(ckpt))
    assert_continues(first, resumed, uninterrupted)
    assert not [w for w in caught if "not resumable" in str(w.message)]  # Lightning's mid-epoch warning


def test_loader_workers_prefetching_do_not_move_the_position(tmp_path: Path) -> None:
    common = {"accum": ACCUM, "batch_size": BATCH, "steps": 12, "num_workers": 2}
    first = fit(**common, every_n_steps=5, checkpoint_dir=str(tmp_path))
    resumed = fit(**common, resume=str(tmp_path / "step=5.ckpt"))
    assert_continues(first, resumed, fit(**{**common, "num_workers": 0}))


def test_checkpoint_inside_an_accumulation_is_refused(tmp_path: Path) -> None:
    fit(accum=ACCUM, batch_size=BATCH, steps=4, save_at_batch=(4, str(tmp_path / "mid.ckpt")))
    with pytest.raises(DataResumeError, match="inside an optimizer step"):
        fit(accum=ACCUM, batch_size=BATCH, steps=8, resume=str(tmp_path / "mid.ckpt"))


def test_another_global_batch_is_refused_before_training(tmp_path: Path) -> None:
    fit(accum=ACCUM, batch_size=BATCH, steps=3, save=str(tmp_path / "g8.ckpt"))
    fit(accum=1, batch_size=2 * BATCH, steps=4, resume=str(tmp_path / "g8.ckpt"))  # same G: accepted
    with pytest.raises(
        DataResumeError, match=r"global batch of 8 samples \(1 ranks x 2 micro-batches x 4\)"
    ) as refused:
        fit(accum=1, batch_size=BATCH, steps=6, resume=str(tmp_path / "g8.ckpt"))
    assert "devices x num_nodes x accumulate_grad_batches x batch_size" in str(refused.value)


def test_lightning_keeps_the_sampler_under_its_distributed_sampler_default() -> None:
    """With `use_distributed_sampler=True` (the default) Lightning swaps any other sampler of a
    distributed run for its own `DistributedSampler`; a `GlobalBatchSampler` is one, so it stays."""
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)  # not launched
    assert (
        trainer._accelerator_connector.use_distributed_sampler
        and trainer._accelerator_connector.is_distributed
    )
    layout = BatchLayout(world_size=2, accumulate=1, micro_batch_size=4)
    sampler = GlobalBatchSampler(IndexedSamples(), layout, rank=1, seed=0, consumed_steps=lambda: 0)
    ours = DataLoader(IndexedSamples(), batch_size=4, sampler=sampler, drop_last=True)
    prepare = trainer._data_connector._prepare_dataloader
    assert prepare(ours, shuffle=True, mode=RunningStage.TRAINING) is ours
    plain = DataLoader(IndexedSamples(), batch_size=4, shuffle=True)
    assert prepare(plain, shuffle=True, mode=RunningStage.TRAINING) is not plain  # what it would do
