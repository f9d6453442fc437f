"""The simulated world (``lightning_zero.comm.simulated``, issue 31's first step): rank ``r`` of ``N``
in one process. Each collective's result is what ``N`` ranks sending what this rank sends would
deliver; the real engine runs on it at ``N = 64`` (flat) and ``8 x 8`` (hybrid): the elements counted
per step are the formula's for that ``N``, and this rank's own shard of the parameters after a step
is a single-process AdamW's on the same gradient (every simulated rank's gradient is this one's)."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero import ShardedAdamW, ZeroConfig
from lightning_zero.checkpoint.commit import SIZE_CHECKS, size_checked
from lightning_zero.checkpoint.format import (
    CheckpointError,
    read_meta,
    save_sharded,
    shard_name,
    verify_files,
)
from lightning_zero.checkpoint.reshard import files_per_bucket, load_sharded, preflight
from lightning_zero.checkpoint.simulated import PeerFiles
from lightning_zero.comm import Comm, CommGroups
from lightning_zero.comm.recorder import Entry, compare_ranks
from lightning_zero.comm.simulated import Simulated
from lightning_zero.engine.engine import ShardEngine
from lightning_zero.layout.partition import shard_range
from lightning_zero.optim.adam import AdamRule

N = 64


def _comm(rank: int, world_size: int = N) -> Comm:
    return Comm(None, Simulated(rank, world_size, torch.device("cpu")))


def test_collectives_deliver_what_n_equal_ranks_would() -> None:
    comm = _comm(5, 8)
    x = torch.arange(16.0)
    out = torch.empty(2)
    comm.wait(comm.reduce_scatter(out, x))
    assert out.tolist() == [80.0, 88.0]  # chunk 5 of 8, summed over 8 equal contributions
    t = torch.tensor([1.5, -2.0])
    comm.wait(comm.all_reduce(t))
    assert t.tolist() == [12.0, -16.0]
    comm.wait(comm.all_reduce(t, op="max"))
    assert t.tolist() == [12.0, -16.0]
    full = torch.zeros(16)
    comm.wait(comm.all_gather(full, full[10:12].fill_(3.0)))  # in place: the input is chunk 5's view
    assert full.tolist() == [3.0] * 16
    sent, got = torch.arange(8, dtype=torch.int8), torch.empty(8, dtype=torch.int8)
    comm.wait(comm.all_to_all(got, sent))
    assert got.tolist() == [5] * 8  # what each sender sends rank 5, as this rank sends it
    assert comm.all_gather_object({"rank": 5}) == [{"rank": 5}] * 8
    # counted as rank 5 of 8: a ring's (N-1)/N of each collective
    assert comm.stats.elements_sent == 16 * 7 // 8 + 2 * (2 * 7 // 8) * 2 + 16 * 7 // 8 + 8 * 7 // 8


def test_bad_rank_and_group_size_are_refused() -> None:
    with pytest.raises(ValueError, match=r"a simulated rank must be in 0\.\.63 \(world_size\), got 64"):
        Simulated(64, N, torch.device("cpu"))
    with pytest.raises(ValueError, match="shard_group_size=6 must divide the 64 data-parallel ranks"):
        CommGroups.simulated(0, N, 6)
    with pytest.raises(RuntimeError, match="a simulated world has no process groups"):
        _comm(0).backend.new_group("gloo", None)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def _groups(model: torch.nn.Module) -> list[dict]:
    hyper = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=False)
    return [
        dict(params=list(model.parameters()), foreach=None, fused=None, decoupled_weight_decay=True, **hyper)
    ]


@pytest.mark.parametrize(("rank", "group"), [(0, None), (37, None), (63, None), (0, 8), (43, 8)])
@pytest.mark.parametrize("stage", [1, 2])
def test_the_engine_runs_as_rank_r_of_n(rank: int, group: int | None, stage: int) -> None:
    model = _model()
    reference = copy.deepcopy(model)
    groups = CommGroups.simulated(rank, N, group)
    config = ZeroConfig(stage=stage, bucket_cap_mb=0.004, first_bucket_cap_mb=0.002)
    engine = ShardEngine(_groups(model), config, groups, AdamRule(), model.parameters())
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    engine.reset_comm_stats()
    model(x).pow(2).mean().backward()
    engine.step()
    reference(x).pow(2).mean().backward()
    torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1).step()

    g = groups.shard.world_size
    assert groups.layout == ("1x64" if group is None else "8x8")
    assert (groups.shard.rank, groups.replicas.rank, groups.world.rank) == (rank % g, rank // g, rank)
    sent = engine.comm_stats.elements_sent
    formula = engine.min_elements_per_step()  # 2 Psi (G-1)/G over the padded buckets
    assert sent == (formula if stage == 2 else formula + formula // 2)  # stage 1: all-reduce + gather
    assert engine.replica_comm_stats.elements_sent == engine.min_replica_elements_per_step()
    assert engine.plan.world_size == g and len({b.padded_numel % g for b in engine.plan.buckets}) == 1
    # this rank's own shard is exact (what the gathers bring for the other ranks' chunks is not)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    want = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    checked = 0
    for bucket in engine.plan.buckets:
        start, end = shard_range(bucket.padded_numel, g, rank % g)
        for slot in bucket.slots:
            lo, hi = max(start, slot.bucket_offset), min(end, slot.bucket_offset + slot.numel)
            if lo < hi:
                offset = sum(p.numel() for p in list(model.parameters())[: slot.param_index])
                index = slice(offset + lo - slot.bucket_offset, offset + hi - slot.bucket_offset)
                torch.testing.assert_close(flat[index], want[index], rtol=1e-6, atol=1e-7)
                checked += hi - lo
    assert checked > 0


def _steps(groups: CommGroups, stage: int, path: Path, steps: int = 2) -> ShardedAdamW:
    """Two training steps (forward, backward, step) and a checkpoint save, as rank ``r`` of ``N``."""
    model = _model()
    units = {"min_unit_numel": 1} if stage == 3 else {}
    config = ZeroConfig(stage=stage, bucket_cap_mb=0.004, first_bucket_cap_mb=0.002, **units)
    opt = ShardedAdamW(model.parameters(), lr=1e-2, config=config, groups=groups, module=model)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        model(x).pow(2).mean().backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    save_sharded(opt.engine, path, {"global_step": steps}, {}, stage)
    return opt


@pytest.mark.parametrize("group", [None, 8], ids=["flat", "hybrid"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ranks_0_1_half_and_last_of_1024_issue_the_same_collectives(
    stage: int, group: int | None, tmp_path: Path
) -> None:
    """Issue 31, item 4: the collective-order recorder's two rules (per group, and interleaved across
    groups) hold for simulated ranks 0, 1, N/2 and N-1 of N = 1,024, flat and 128 x 8, through
    training steps (gradient clipping included) and a checkpoint save."""
    world = 1024
    logs: dict[int, list[Entry]] = {}
    for rank in (0, 1, world // 2, world - 1):
        log: list[Entry] = []
        opt = _steps(CommGroups.simulated(rank, world, group, log=log), stage, tmp_path / f"rank{rank}")
        assert opt.engine.groups.layout == ("1x1024" if group is None else "128x8")
        logs[rank] = log
    assert compare_ranks("simulated", logs, sampled=True) == []
    ops = {(e.role, e.op) for e in logs[0]}
    assert ("world", "gather_object_to_0") in ops and ("world", "broadcast_object_from_0") in ops
    assert ("shard" if group else "world", "reduce_scatter" if stage > 1 else "all_reduce_sum") in ops
    if group is not None:
        assert any(role == "replicas" for role, _ in ops)
    if stage == 3:
        assert sum(e.op == "all_gather" for e in logs[0]) > 2 * len(opt.engine.plan.buckets)


def test_the_order_check_sees_a_rank_that_issues_otherwise(tmp_path: Path) -> None:
    """The check can fail: rank 1023 with another bucket size issues other collectives."""
    logs = {}
    for rank, cap in ((0, 0.004), (1023, 1.0)):
        log: list[Entry] = []
        model = _model()
        config = ZeroConfig(stage=2, bucket_cap_mb=cap, first_bucket_cap_mb=0.002)
        groups = CommGroups.simulated(rank, 1024, log=log)
        opt = ShardedAdamW(model.parameters(), config=config, groups=groups)
        model(torch.randn(2, 32)).sum().backward()
        opt.step()
        logs[rank] = log
    problems = compare_ranks("simulated", logs, sampled=True)
    assert problems and "rank 0 issued reduce_scatter" in problems[0], problems


def _trained(groups: CommGroups) -> ShardedAdamW:
    model = _model()
    opt = ShardedAdamW(model.parameters(), config=ZeroConfig(bucket_cap_mb=0.004), groups=groups)
    model(torch.randn(4, 32)).pow(2).mean().backward()
    opt.step()
    return opt


def _save_as_rank_0(path: Path, step: int, world: int = 1024, peer: Any = None) -> None:
    peer = peer or PeerFiles(path, world)
    save_sharded(_trained(CommGroups.simulated(0, world, peer=peer)).engine, path, {"step": step}, {}, 2)


def test_rank_0_of_1024_commits_every_file_with_a_bounded_number_of_stats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 31, item 3: rank 0's visibility check lists the directory once and checks the sizes of a
    bounded number of files (the first of each of the 128 hosts here), not one stat per rank."""
    stats: list[str] = []
    stat = Path.stat

    def counted(self: Path, *args: Any, **kwargs: Any) -> Any:
        if self.name.startswith("shard-"):
            stats.append(self.name)
        return stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", counted)
    _save_as_rank_0(tmp_path / "ckpt", 1)
    during_commit = [s for s in stats if s != "shard-00000-of-01024.pt"]  # its own, read after writing
    # peers 1..1023 are on hosts node0..node127 (rank 0 on this machine's): the first file of each
    assert sorted(during_commit) == [shard_name(max(1, 8 * h), 1024) for h in range(128)]
    meta = read_meta(tmp_path / "ckpt")
    assert len([name for name in meta["files"] if name.startswith("shard-")]) == 1024
    assert verify_files(tmp_path / "ckpt", meta) == []
    assert len(size_checked([("h", [("f", 1, "d")])] * 1024)) == 1  # one host: its first file only
    assert len(size_checked([(f"h{r}", [("f", 1, "d")]) for r in range(2048)])) == SIZE_CHECKS


def _failing_peer(path: Path, rank: int, fault: str) -> Any:
    files = PeerFiles(path, 1024)

    def peer(obj: Any, k: int) -> Any:
        out = files(obj, k)
        if k == rank:
            [tmp] = path.parent.glob(f".{path.name}.tmp-*")
            shard = tmp / shard_name(k, 1024)
            if fault == "missing":
                shard.unlink()
            else:
                shard.unlink()  # a link of rank 0's file: truncate a copy, not rank 0's own bytes
                shard.write_bytes((tmp / shard_name(0, 1024)).read_bytes()[:100])
        return out

    return peer


@pytest.mark.parametrize(("rank", "fault"), [(700, "missing"), (8, "truncated")])
def test_a_file_rank_0_cannot_see_fails_the_commit_and_keeps_the_previous(
    tmp_path: Path, rank: int, fault: str
) -> None:
    path = tmp_path / "ckpt"
    _save_as_rank_0(path, 1)
    size = read_meta(path)["files"][shard_name(rank, 1024)]["size"]
    with pytest.raises(CheckpointError) as failed:
        _save_as_rank_0(path, 2, peer=_failing_peer(path, rank, fault))
    seen = "missing" if fault == "missing" else f"100 bytes instead of {size}"
    assert f"rank {rank} (host node{rank // 8}) wrote {shard_name(rank, 1024)}, rank 0" in str(failed.value)
    assert f"sees it {seen}" in str(failed.value)
    assert read_meta(path)["lightning"] == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_truncated_file_outside_the_sample_is_caught_when_loaded(tmp_path: Path) -> None:
    """The limit of the bounded check: rank 9's file (not the first of its host) is not stat-ed at the
    commit; the load's check (size and sha256 of every file a rank reads) names it."""
    path = tmp_path / "ckpt"
    _save_as_rank_0(path, 2, peer=_failing_peer(path, 9, "truncated"))
    meta = read_meta(path)
    assert verify_files(path, meta) == [
        f"{path / shard_name(9, 1024)}: 100 bytes, expected {meta['files'][shard_name(9, 1024)]['size']} "
        "(truncated or replaced)"
    ]


@pytest.mark.parametrize("new_world", [768, 2048])
def test_a_resume_on_another_world_reads_a_bounded_number_of_files_per_bucket(
    tmp_path: Path, new_world: int
) -> None:
    """N -> 3N/4 and N -> 2N: each rank reads its part of a bucket from at most ceil(N/M) + 1 of the
    saved shard files (its part is one contiguous range of the saved bucket: 3 for 3N/4, 2 for 2N;
    docs/clusters.md says why 2 for 3N/4 holds only where both plans pad a bucket alike); the load
    runs."""
    path = tmp_path / "ckpt"
    _save_as_rank_0(path, 1)
    meta = read_meta(path)
    for rank in (0, 1, new_world // 2, new_world - 1):
        engine = _trained(CommGroups.simulated(rank, new_world)).engine
        needed = files_per_bucket(engine, meta)
        assert max(len(ranks) for ranks in needed) <= math.ceil(1024 / new_world) + 1, (rank, needed)
        preflight(engine, path, meta)
        load_sharded(engine, path, meta)


@pytest.mark.parametrize(
    ("rank", "failing", "outcome"),
    [
        (0, "broadcast_object", "rank 0 committed the new one, but its verdict did not reach every rank"),
        (5, "broadcast_object", "rank 0 may have committed the new one before the verdict failed"),
        (0, "gather_object", "the previous one (if any) is kept"),
        (5, "gather_object", "the previous one (if any) is kept"),
    ],
)
def test_a_failed_commit_says_what_it_left_at_the_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int, failing: str, outcome: str
) -> None:
    """The commit's collectives fail (a peer died): before rank 0's rename the previous checkpoint is
    kept; after it, rank 0 says the new one is in place, and a rank whose word had reached rank 0
    says it may be."""
    path = tmp_path / "ckpt"
    _save_as_rank_0(path, 1, world=64)
    original = getattr(Simulated, failing)

    def fails(self: Simulated, obj: Any, src_or_dst: int) -> Any:
        if isinstance(obj, list) or failing == "gather_object":  # the verdict; not the directory token
            raise RuntimeError("Connection closed by peer")
        return original(self, obj, src_or_dst)

    monkeypatch.setattr(Simulated, failing, fails)
    with pytest.raises(CheckpointError) as failed:
        opt = _trained(CommGroups.simulated(rank, 64, peer=PeerFiles(path, 64)))
        save_sharded(opt.engine, path, {"step": 2}, {}, 2)
    assert f"saving checkpoint {path} failed; {outcome}" in str(failed.value)
    assert read_meta(path)["lightning"] == {"step": 2 if "committed the new one," in outcome else 1}
    # a rank whose verdict never came leaves the shared temporary directory: rank 0 may be renaming it
    kept = [p.name for p in tmp_path.glob(".ckpt.tmp-*")]
    assert bool(kept) == (rank != 0 and failing == "broadcast_object"), kept


def test_a_commit_that_fails_after_its_rename_says_the_new_one_is_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Syncing the parent directory fails after rank 0 swapped the new checkpoint in: the error says
    the new one is in place (it is), not that the previous one is kept."""
    import lightning_zero.checkpoint.commit as commit

    path = tmp_path / "ckpt"
    _save_as_rank_0(path, 1, world=64)

    sync = commit.os.fsync

    def no_sync(fd: int) -> None:  # fails for the checkpoint's parent directory alone
        if commit.os.readlink(f"/proc/self/fd/{fd}") == str(tmp_path):
            raise OSError(5, "Input/output error")
        sync(fd)

    monkeypatch.setattr(commit.os, "fsync", no_sync)
    with pytest.raises(CheckpointError) as failed:
        _save_as_rank_0(path, 2, world=64)
    assert "failed; rank 0 put the new one in place, then failed" in str(failed.value)
    assert "rank 0: the new checkpoint is in place, but OSError" in str(failed.value)
    assert read_meta(path)["lightning"] == {"step": 2}


def test_a_failed_second_rename_puts_the_previous_checkpoint_back(tmp_path: Path) -> None:
    """Without renameat2 the old directory is moved aside first; if the new one then cannot be renamed
    into place, the old one goes back, so the target is never left missing."""
    import lightning_zero.checkpoint.commit as commit

    target, tmp = tmp_path / "ckpt", tmp_path / ".ckpt.tmp"
    target.mkdir()
    (target / "old").write_text("previous")
    original = commit._exchange
    commit._exchange = lambda a, b: False  # type: ignore[assignment]
    try:
        with pytest.raises(OSError):
            commit.commit_directory(tmp, target)  # tmp does not exist: the second rename fails
    finally:
        commit._exchange = original  # type: ignore[assignment]
    assert (target / "old").read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_rank_that_cannot_look_for_meta_pt_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OSError other than "not found" (a permission or I/O error) on one rank must not raise
    before the collective the others enter: the rank joins it, and every rank raises, naming it."""
    import lightning_zero.checkpoint.collective_read as collective_read

    def cannot(path: Any) -> bool:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(collective_read, "is_sharded_checkpoint", cannot)
    groups = CommGroups.simulated(3, 8)
    with pytest.raises(
        CheckpointError, match=r"rank 3 \(PermissionError: \[Errno 13\] Permission denied\) does"
    ):
        collective_read.sharded_everywhere(tmp_path, groups.world)
