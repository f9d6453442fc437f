"""``ZeroStrategy(shard_group_size=2)`` on 4 ranks under the Trainer: the fit equals one process's
AdamW on the global batch (float64, 1e-10), and ``log_comm_stats`` logs the traffic inside a group
and across groups apart, each at 1.00x its formula (``2Ψ(G−1)/G`` inside, ``2(Ψ/G)(R−1)/R`` across).
One launch of ``tests/distributed/lit_fit.py`` on 4 processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.test_lightning_parity import assert_same_adamw_state, launch, max_diff, reference


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("hybrid_trainer")
    case = {"devices": 4, "stage": 2, "steps": 4, "accum": 2, "clip": 0.05, "unused_every": 0}
    # the user's mesh first: its process group is initialised before Lightning's setup, as under torchrun
    cases = [dict(case, user_mesh=True), dict(case, shard_group_size=2, csv_dir=str(tmp))]
    saving = dict(case, shard_group_size=2, async_checkpoint=True, checkpoint_dir=str(tmp / "ckpt"))
    one_file = dict(case, shard_group_size=2, sharded_checkpoint=False, save=str(tmp / "one_file.ckpt"))
    by_mesh, params, saved, single = launch([*cases, saving, one_file], tmp)
    runs = {"shard_group_size": params, "user_mesh": by_mesh, "async_checkpoint": saved, "one_file": single}
    return tmp, runs, case


@pytest.mark.parametrize("how", ["shard_group_size", "user_mesh", "async_checkpoint", "one_file"])
def test_the_fit_equals_single_process_adamw(launched: tuple[Path, dict, dict], how: str) -> None:
    """Set by ``shard_group_size=2``, or by a (2, 2) ``DeviceMesh`` the user built after initialising
    the process group (``ZeroStrategy(device_mesh=mesh)``): 2 replica groups of 2 ranks either way."""
    _, runs, case = launched
    params = runs[how]
    assert params["layout"].tolist() == [2, 2]
    expected = reference(case)
    assert max_diff({k: params[k] for k in expected}, expected) <= 1e-10


def test_comm_stats_report_inside_and_across_groups_apart(launched: tuple[Path, dict, dict]) -> None:
    rows = (launched[0] / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    logged = [r.split(",") for r in rows[1:] if r.split(",")[header.index("zero/elements_sent_vs_min")]]
    assert len(logged) == 4

    def column(name: str) -> list[float]:
        return [float(r[header.index(name)]) for r in logged]

    assert column("zero/elements_sent_vs_min") == [1.0] * 4  # inside the group of 2
    assert column("zero/inter_group_elements_vs_min") == [1.0] * 4
    inside, across = column("zero/elements_sent"), column("zero/inter_group_elements_sent")
    # G = R = 2: Ψ inside (reduce-scatter and all-gather, Ψ/2 each), Ψ/2 across (per bucket, rounded down)
    assert all(0 < 2 * a <= i < 2 * a + 64 for a, i in zip(across, inside, strict=True)), (inside, across)
    assert column("zero/inter_group_bytes_sent") == [8.0 * a for a in across]  # float64 on the wire


def test_async_checkpoints_under_hybrid_sharding_hold_one_shard_group(
    launched: tuple[Path, dict, dict],
) -> None:
    """Background saves every 2 steps: the first replica group's 2 shard files, committed and intact,
    holding the fit's final parameters in the last one."""
    from lightning_zero.checkpoint import read_meta, verify_files
    from lightning_zero.checkpoint.consolidate import load_module_checkpoint

    last = launched[0] / "ckpt" / "last.ckpt"
    meta = read_meta(last)
    assert meta["world_size"] == 2 and sorted(meta["files"]) == [
        "model_extra.pt",
        "shard-00000-of-00002.pt",
        "shard-00001-of-00002.pt",
    ]
    assert verify_files(last, meta) == []
    saved = load_module_checkpoint(last)["state_dict"]
    final = launched[1]["async_checkpoint"]
    params = {k: v for k, v in final.items() if k != "layout"}
    assert params and all(torch.equal(saved[k], v) for k, v in params.items()), sorted(saved)


def test_a_single_file_checkpoint_holds_adamw_state_gathered_in_the_first_group(
    launched: tuple[Path, dict, dict], tmp_path: Path
) -> None:
    """``sharded_checkpoint=False`` at 2x2: the first replica group gathers its shards to rank 0 (the
    others send nothing); the file holds the state single-process AdamW would."""
    tmp, _, case = launched
    reference(dict(case, save=str(tmp_path / "ref.ckpt")))
    assert_same_adamw_state(tmp / "one_file.ckpt", tmp_path / "ref.ckpt")
