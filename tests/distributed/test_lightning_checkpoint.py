"""Trainer checkpoints with strategy "zero": directories of shards that resume on any world size.

The fits run in four shared launches (a module fixture): 2 ranks, then 3, then 2 again, then 1, after
one fit whose rank 1 is killed mid-save. A case can resume a checkpoint that an earlier case of the same
or an earlier launch, or the killed fit, wrote. Each test reads its own cases' results by name.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero.checkpoint import META, shard_name
from lightning_zero.comm import recorder
from tests.distributed.lit_fit import fit
from tests.distributed.test_async_checkpoint import assert_same_checkpoint
from tests.distributed.test_lightning_parity import ROOT, launch, max_diff
from tests.launch import launch_env, run_script

GLOBAL = 12  # rows of the repeated dataset: the global batch at every step
ERROR = {"expect_error": True}  # the case records the error every rank raised (tests/distributed/lit_fit.py)


def case(devices: int, **kw: object) -> dict:
    return {
        "devices": devices,
        "batch_size": GLOBAL // devices,
        "identical_batches": True,
        "accum": 2,
        "clip": 0.05,
        **kw,
    }


def reference(steps: int, **kw: Any) -> dict[str, torch.Tensor]:
    return fit(
        strategy="auto",
        devices=1,
        batch_size=GLOBAL,
        identical_batches=True,
        accum=2,
        clip=0.05,
        steps=steps,
        **kw,
    )[1]


def launches(root: Path) -> list[list[tuple[str, dict[str, Any]]]]:
    """The named cases of each launch, in launch order (a resume's checkpoint is written earlier)."""
    p = {name: str(root / name) for name in ("half", "a", "b", "ddp", "stale", "sync", "async", "link", "v")}
    two = [
        ("uninterrupted10", case(2, steps=10)),
        ("half", case(2, steps=5, save=p["half"] + ".ckpt")),
        ("resumed10", case(2, steps=10, resume=p["half"] + ".ckpt")),
        ("stage2_first", case(2, steps=5, stage=2, save=p["a"] + ".ckpt")),
        ("ddp_save", case(2, strategy="ddp", steps=5, save=p["ddp"] + ".ckpt", unused_every=0)),
        ("sync", case(2, steps=7, checkpoint_dir=p["sync"])),
        ("async", case(2, steps=7, checkpoint_dir=p["async"], async_checkpoint=True)),
        ("uninterrupted9", case(2, steps=9)),
        ("async_resumed9", case(2, steps=9, resume=p["async"] + "/last.ckpt")),
        ("link", case(2, steps=5, checkpoint_dir=p["link"], save_last="link")),
    ]
    three = [
        ("stage1_second", case(3, steps=10, stage=1, resume=p["a"] + ".ckpt", save=p["b"] + ".ckpt")),
        ("ddp_resumed", case(3, steps=10, resume=p["ddp"] + ".ckpt", unused_every=0)),
        ("stale_three", case(3, steps=2, save=p["stale"] + "/same.ckpt")),
        ("validated_source", case(3, steps=3, save=p["v"] + ".ckpt")),
    ]
    two_again = [
        ("stale_two", case(2, steps=3, save=p["stale"] + "/same.ckpt")),
        ("killed_resumed", case(2, steps=4, resume=str(root / "killed" / "last.ckpt"))),
        ("killed_uninterrupted", case(2, steps=4)),
        # rank 0 handed a sharded checkpoint, rank 1 a directory without meta.pt
        ("split_resume", case(2, steps=4, resume=p["half"] + ".ckpt", resume_rank1=p["stale"], **ERROR)),
    ]
    one = [
        ("validated", {"validate_ckpt": p["v"] + ".ckpt"}),  # first: a fresh process, as a user's
        ("stage2_final", case(1, steps=15, stage=2, resume=p["b"] + ".ckpt")),
    ]
    return [two, three, two_again, one]


def kill_rank_mid_save(ck: Path, out: Path) -> tuple[int, float]:
    """A 2-rank fit saving to ``ck`` every 2 steps whose rank 1 dies in its third save (step 4):
    (exit status, seconds until every rank has ended)."""
    cases = [case(2, steps=7, checkpoint_dir=str(ck), die_at_save=3)]  # saves: step2, last, step4 (dies)
    start = time.monotonic()
    proc = run_script(
        [sys.executable, "-m", "tests.distributed.lit_fit", "--out", str(out), "--cases", json.dumps(cases)],
        2,
        cwd=ROOT,
        env=launch_env(**{recorder.ENV_FAULTS: "1"}),  # rank 1 dies on purpose
        timeout=180,
    )
    return proc.returncode, time.monotonic() - start


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The killed fit first (its resume runs in a later launch), then the launches."""
    root = tmp_path_factory.mktemp("lightning_checkpoint")
    (root / "stale").mkdir()
    results: dict[str, Any] = {"killed": kill_rank_mid_save(root / "killed", root / "killed.pt")}
    for named in launches(root):
        out = launch([c for _, c in named], root)
        results.update(zip([name for name, _ in named], out, strict=True))
    return root, results


def test_same_world_size_resume_is_bit_identical(fits: tuple[Path, dict]) -> None:
    root, results = fits
    assert sorted(p.name for p in (root / "half.ckpt").iterdir()) == sorted(
        [META, "model_extra.pt", shard_name(0, 2), shard_name(1, 2)]
    )
    assert max_diff(results["resumed10"], results["uninterrupted10"]) == 0.0


def test_resume_on_other_world_sizes_and_stages_matches_one_process(fits: tuple[Path, dict]) -> None:
    """2 ranks (stage 2) -> 3 ranks (stage 1) -> 1 rank (stage 2): 15 steps equal one process's 15."""
    assert max_diff(fits[1]["stage2_final"], reference(15)) <= 1e-10


def test_ddp_file_resumes_under_zero(fits: tuple[Path, dict]) -> None:
    root, results = fits
    assert (root / "ddp.ckpt").is_file()
    assert max_diff(results["ddp_resumed"], reference(10, unused_every=0)) <= 1e-10


def test_saving_over_a_checkpoint_from_more_ranks_leaves_no_stale_shard(fits: tuple[Path, dict]) -> None:
    stale = fits[0] / "stale"
    assert sorted(p.name for p in (stale / "same.ckpt").iterdir()) == sorted(
        [META, "model_extra.pt", shard_name(0, 2), shard_name(1, 2)]
    )
    assert not [p for p in stale.iterdir() if p.name.startswith(".same.ckpt")], "temporary dirs left behind"


def test_model_checkpoint_async_equals_sync(fits: tuple[Path, dict]) -> None:
    """ModelCheckpoint every 2 steps, top-2, save_last: the asynchronous writer commits the same
    checkpoints as the blocking one (shards, model extras and meta.pt), keeps only the newest two,
    and "last" resumes. (tests/distributed/test_async_checkpoint.py shows that training goes on
    while an asynchronous save is written.)"""
    root, results = fits
    sync_dir, async_dir = root / "sync", root / "async"
    names = sorted(p.name for p in async_dir.iterdir())  # no temporary directory left
    assert names == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"], names
    for name in names:
        assert_same_checkpoint(async_dir / name, sync_dir / name, (str(async_dir), str(sync_dir)))
    assert max_diff(results["async_resumed9"], results["uninterrupted9"]) == 0.0


def test_save_last_link(fits: tuple[Path, dict]) -> None:
    last = fits[0] / "link" / "last.ckpt"
    assert last.is_symlink() and (last / META).is_file()


def test_rank_killed_mid_save_ends_every_rank_and_keeps_the_previous_checkpoint(
    fits: tuple[Path, dict],
) -> None:
    from lightning_zero.cli import main as cli

    root, results = fits
    ck = root / "killed"
    returncode, elapsed = results["killed"]
    assert returncode != 0 and elapsed < 60, (returncode, elapsed)
    complete = sorted(p.name for p in ck.iterdir() if p.name.endswith(".ckpt"))
    assert complete == ["epoch=0-step=2.ckpt", "last.ckpt"], complete  # the step-4 save never committed
    for name in complete:
        assert cli(["verify", str(ck / name)]) == 0
    # resumed from last.ckpt in the fixture's third launch
    assert max_diff(results["killed_resumed"], results["killed_uninterrupted"]) == 0.0


def test_validate_loads_a_sharded_checkpoint_without_an_optimizer(fits: tuple[Path, dict]) -> None:
    """trainer.validate(ckpt_path=dir) under "zero": no optimizer, whole parameters read from the shards
    (the fixture's last launch: a fresh TinyLit, one device, validated first)."""
    assert max_diff(fits[1]["validated"], fits[1]["validated_source"]) == 0.0


def test_a_rank_given_another_ckpt_path_ends_every_rank_naming_it(fits: tuple[Path, dict]) -> None:
    """``trainer.fit(ckpt_path=...)`` where rank 1's path holds no ``meta.pt`` and rank 0's is a sharded
    checkpoint: the ranks decide together whether it is one, and every rank raises ``CheckpointError``
    naming rank 1, instead of rank 1 taking Lightning's single-file branch while rank 0 reads shards."""
    result = fits[1]["split_resume"]
    assert len(result["every_rank"]) == 2, result
    for message in result["every_rank"]:
        assert message.startswith("CheckpointError: "), message
        assert f"rank 1 does not see {META} where the other ranks do" in message, message
