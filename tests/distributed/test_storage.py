"""A checkpoint directory on storage that is not shared by all nodes is an error at save time, and so
is a shard file rank 0 sees at another size than its rank wrote.

Rank 1 gets its own view of the checkpoint directory (a private tmpfs in its own mount namespace, as a
node-local disk would be): its shard lands where rank 0 cannot see it. The save must fail on every
rank before the commit, naming the rank, its host and the requirement; the previous checkpoint stays
the committed one, and no rank leaves temporary files behind.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from lightning_zero.checkpoint import read_meta, verify_files
from tests.distributed.harness import run_ranks
from tests.distributed.workers_ckpt import meta_read_once, node_local_save, stale_size_save


@pytest.mark.parametrize("redirect", [False, True], ids=["mount_namespace", "redirected_writes"])
def test_a_save_rank_0_cannot_see_fails_everywhere_and_keeps_the_previous(
    tmp_path: Path, redirect: bool
) -> None:
    root = tmp_path / "checkpoints"
    root.mkdir()
    results = run_ranks(node_local_save, 2, str(root), redirect, timeout_s=120)
    host = socket.gethostname()
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank}: the save succeeded without rank 1's shard"
        error = result["error"]
        assert (
            f"rank 1 (host {host}) wrote shard-00001-of-00002.pt, rank 0 (host {host}) sees it missing"
            in error
        )
        assert "must be on storage shared by all nodes" in error
        temporaries = [name for name in result["left"] if name.startswith(".ckpt.tmp-")]
        assert not temporaries, f"rank {rank}'s view keeps temporaries: {temporaries}"
    assert results[0]["left"] == ["ckpt"], results[0]["left"]
    assert results[0]["step"] == 2, "the previous checkpoint must stay the committed one"
    meta = read_meta(root / "ckpt")
    assert meta["lightning"]["global_step"] == 2 and verify_files(root / "ckpt", meta) == []
    assert results[1]["how"] == ("redirected writes" if redirect else "mount namespace"), (
        "this machine cannot make a private mount namespace: the test ran with redirected writes only"
    )


def test_a_shard_rank_0_sees_at_the_wrong_size_fails_and_keeps_the_previous(tmp_path: Path) -> None:
    """Rank 1's shard file is in the directory, but rank 0 sees half the bytes rank 1 wrote: the commit
    must not happen (present is not enough), and the error names the file and both sizes."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    results = run_ranks(stale_size_save, 2, str(root), timeout_s=120)
    host = socket.gethostname()
    [(name, size)] = results[1]["written"]
    assert name == "shard-00001-of-00002.pt"
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank}: the save committed a shard rank 0 saw truncated"
        error = result["error"]
        assert f"rank 1 (host {host}) wrote {name}, rank 0 (host {host}) sees it {size // 2} bytes" in error
        assert f"{size // 2} bytes instead of {size}" in error, error
        assert result["left"] == ["ckpt"], f"rank {rank} sees temporaries left behind: {result['left']}"
    assert results[0]["step"] == 2, "the previous checkpoint must stay the committed one"
    meta = read_meta(root / "ckpt")
    assert meta["lightning"]["global_step"] == 2 and verify_files(root / "ckpt", meta) == []


def test_meta_pt_is_read_by_rank_0_alone_and_its_error_reaches_every_rank(tmp_path: Path) -> None:
    """``meta.pt`` lists every shard file (it grows with the world size): rank 0 reads it and broadcasts
    it (issue 31); a checkpoint without one fails on every rank with rank 0's error. Whether a path is
    a sharded checkpoint is decided alike on every rank: a rank that does not see ``meta.pt`` where
    the others do is named to all of them (alone, it would take the single-file branch and hang)."""
    results = run_ranks(meta_read_once, 3, str(tmp_path), timeout_s=120)
    assert [r["reads"] for r in results] == [2, 0, 0]
    assert all(r["step"] == 2 for r in results)
    for result in results:
        assert f"{tmp_path / 'absent' / 'meta.pt'} does not exist" in result["error"]
        assert result["sharded"] == [True, False]
        assert (
            result["mismatch"] is not None
            and "rank 2 does not see meta.pt where the other ranks do" in (result["mismatch"])
        ), result["mismatch"]
