"""Trainer checkpoints with strategy "zero": directories of shards that resume on any world size."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_zero.checkpoint import META, shard_name
from tests.distributed.lit_fit import fit
from tests.distributed.test_async_checkpoint import assert_same_checkpoint
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


def test_model_checkpoint_async_equals_sync(tmp_path: Path) -> None:
    """ModelCheckpoint every 2 steps, top-2, save_last: the asynchronous writer commits the same
    checkpoints as the blocking one (shards, model extras and meta.pt), keeps only the newest two,
    and "last" resumes. (tests/distributed/test_async_checkpoint.py shows that training goes on
    while an asynchronous save is written.)"""
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    *_, uninterrupted = launch(
        [
            case(2, steps=7, checkpoint_dir=str(sync_dir)),
            case(2, steps=7, checkpoint_dir=str(async_dir), async_checkpoint=True),
            case(2, steps=9),  # the reference for the resume below (one launch fewer)
        ],
        tmp_path,
    )
    names = sorted(p.name for p in async_dir.iterdir())  # no temporary directory left
    assert names == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"], names
    for name in names:
        assert_same_checkpoint(async_dir / name, sync_dir / name, (str(async_dir), str(sync_dir)))
    resumed = launch([case(2, steps=9, resume=str(async_dir / "last.ckpt"))], tmp_path)[0]
    assert max_diff(resumed, uninterrupted) == 0.0


def test_save_last_link(tmp_path: Path) -> None:
    launch([case(2, steps=5, checkpoint_dir=str(tmp_path / "ck"), save_last="link")], tmp_path)
    last = tmp_path / "ck" / "last.ckpt"
    assert last.is_symlink() and (last / META).is_file()


def test_rank_killed_mid_save_ends_every_rank_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    import sys
    import time

    from lightning_zero.cli import main as cli
    from tests.distributed.test_lightning_parity import ROOT

    ck = tmp_path / "ck"
    cases = [case(2, steps=7, checkpoint_dir=str(ck), die_at_save=3)]  # saves: step2, last, step4 (dies)
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.distributed.lit_fit",
            "--out",
            str(tmp_path / "r.pt"),
            "--cases",
            json.dumps(cases),
        ],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode != 0 and elapsed < 60, (proc.returncode, elapsed)
    complete = sorted(p.name for p in ck.iterdir() if p.name.endswith(".ckpt"))
    assert complete == ["epoch=0-step=2.ckpt", "last.ckpt"], complete  # the step-4 save never committed
    for name in complete:
        assert cli(["verify", str(ck / name)]) == 0
    resumed, uninterrupted = launch(
        [case(2, steps=4, resume=str(ck / "last.ckpt")), case(2, steps=4)], tmp_path
    )
    assert max_diff(resumed, uninterrupted) == 0.0


def test_validate_loads_a_sharded_checkpoint_without_an_optimizer(tmp_path: Path) -> None:
    """trainer.validate(ckpt_path=dir) under "zero": no optimizer, whole parameters read from the shards."""
    import subprocess
    import sys

    from tests.distributed.test_lightning_parity import ROOT

    ckpt = tmp_path / "v.ckpt"
    trained = launch([case(3, steps=3, save=str(ckpt))], tmp_path)[0]
    out = tmp_path / "validated.pt"
    code = (
        "import torch, lightning as L, lightning_zero\n"
        "from torch.utils.data import DataLoader\n"
        "from tests.distributed.lit_fit import TinyLit, dataset\n"
        "model = TinyLit()\n"
        "trainer = L.Trainer(strategy=lightning_zero.ZeroStrategy(), devices=1, accelerator='cpu',\n"
        "                    precision='64-true', logger=False, enable_progress_bar=False)\n"
        f"trainer.validate(model, DataLoader(dataset(24), batch_size=12), ckpt_path={str(ckpt)!r})\n"
        f"torch.save({{n: p.detach() for n, p in model.named_parameters()}}, {str(out)!r})\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert max_diff(torch.load(out, weights_only=True), trained) == 0.0
