"""The checkpoint commit: the target path is replaced, never removed first; a symlink's target survives."""

from __future__ import annotations

from pathlib import Path

from lightning_zero.checkpoint.commit import commit_directory


def test_commit_replaces_a_directory_and_leaves_nothing_behind(tmp_path: Path) -> None:
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "shard-1").write_text("new")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "shard-0").write_text("old")
    commit_directory(tmp_path / "new", tmp_path / "ckpt")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["shard-1"]


def test_commit_over_a_symlink_keeps_what_it_pointed_to(tmp_path: Path) -> None:
    (tmp_path / "step4").mkdir()
    (tmp_path / "step4" / "meta.pt").write_text("kept")
    (tmp_path / "last").symlink_to(tmp_path / "step4")
    (tmp_path / "new").mkdir()
    commit_directory(tmp_path / "new", tmp_path / "last")
    assert not (tmp_path / "last").is_symlink() and (tmp_path / "last").is_dir()
    assert (tmp_path / "step4" / "meta.pt").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "step4"]


def test_commit_to_a_new_path(tmp_path: Path) -> None:
    (tmp_path / "new").mkdir()
    commit_directory(tmp_path / "new", tmp_path / "sub_ckpt")
    assert [p.name for p in tmp_path.iterdir()] == ["sub_ckpt"]
