"""Trainer checkpoints with strategy "zero": directories of shards that resume on any world size."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_zero.checkpoint import META, shard_name
from tests.distributed.lit_fit import fit
from tests.distributed.test_lightning_parity import launch, max_diff

GLOBAL = 12  # rows of the repeated dataset: the global batch at every step


def case(devices: int, **kw: object) -> dict:
    return {
        "devices": devices,
        "batch_size": GLOBAL // devices,
        "identical_batches": True,
        "accum": 2,
        "clip": 0.05,
        **kw,
    }


def reference(steps: int) -> dict[str, torch.Tensor]:
    return fit(
        strategy="auto", devices=1, batch_size=GLOBAL, identical_batches=True, accum=2, clip=0.05, steps=steps
    )[1]


def test_same_world_size_resume_is_bit_identical(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "half.ckpt")
    uninterrupted, _ = launch([case(2, steps=10), case(2, steps=5, save=ckpt)], tmp_path)
    assert sorted(p.name for p in Path(ckpt).iterdir()) == sorted(
        [META, "model_extra.pt", shard_name(0, 2), shard_name(1, 2)]
    )
    resumed = launch([case(2, steps=10, resume=ckpt)], tmp_path)[0]
    assert max_diff(resumed, uninterrupted) == 0.0


def test_resume_on_other_world_sizes_and_stages_matches_one_process(tmp_path: Path) -> None:
    """2 ranks (stage 2) -> 3 ranks (stage 1) -> 1 rank (stage 2): 15 steps equal one process's 15."""
    first, second = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    launch([case(2, steps=5, stage=2, save=first)], tmp_path)
    launch([case(3, steps=10, stage=1, resume=first, save=second)], tmp_path)
    final = launch([case(1, steps=15, stage=2, resume=second)], tmp_path)[0]
    assert max_diff(final, reference(15)) <= 1e-10


def test_ddp_file_resumes_under_zero(tmp_path: Path) -> None:
    ddp_file = str(tmp_path / "ddp.ckpt")
    launch([case(2, strategy="ddp", steps=5, save=ddp_file, unused_every=0)], tmp_path)
    assert Path(ddp_file).is_file()
    final = launch([case(3, steps=10, resume=ddp_file, unused_every=0)], tmp_path)[0]
    expected = fit(
        strategy="auto",
        devices=1,
        batch_size=GLOBAL,
        identical_batches=True,
        accum=2,
        clip=0.05,
        steps=10,
        unused_every=0,
    )[1]
    assert max_diff(final, expected) <= 1e-10


def test_saving_over_a_checkpoint_from_more_ranks_leaves_no_stale_shard(tmp_path: Path) -> None:
    ckpt = tmp_path / "same.ckpt"
    launch([case(3, steps=2, save=str(ckpt))], tmp_path)
    launch([case(2, steps=3, save=str(ckpt))], tmp_path)
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(
        [META, "model_extra.pt", shard_name(0, 2), shard_name(1, 2)]
    )
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".same.ckpt")], (
        "temporary dirs left behind"
    )
