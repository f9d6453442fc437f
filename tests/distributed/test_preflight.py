"""``lightning-zero preflight`` on 4 processes: a consistent launch (Lightning's launcher, and
torchrun's environment as 2 "nodes" of 2) passes and prints the table; each inconsistency, injected
alone into one rank (its checkpoint directory, its layout, its main port) or into all (a shard group
size that does not divide the world), makes every rank exit 1 with a line naming it. The launches run
at once (each has its own port and directory): 27 processes, mostly waiting on each other."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.launch import free_port, launch_env, run_launches

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "lightning_zero.cli", "preflight", "--accelerator", "cpu", "--sizes-mb", "0.25"]


Launch = tuple[list[list[str]], list[dict[str, str]]]  # a command and an environment per process


def _torchrun_like(
    args: list[str],
    per_rank_args: dict[int, list[str]] | None = None,
    per_rank_env: dict[int, dict[str, str]] | None = None,
) -> Launch:
    """4 processes with the environment torchrun gives 2 nodes of 2 (ranks 0-1, 2-3), each rank's
    arguments and environment changed by ``per_rank_*``."""
    port, commands, envs = free_port(), [], []
    for rank in range(4):
        env = launch_env(
            TORCHELASTIC_RUN_ID="preflight-test",
            RANK=str(rank),
            WORLD_SIZE="4",
            LOCAL_RANK=str(rank % 2),
            LOCAL_WORLD_SIZE="2",
            GROUP_RANK=str(rank // 2),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        env.update((per_rank_env or {}).get(rank, {}))
        envs.append(env)
        commands.append([*CLI, *args, *(per_rank_args or {}).get(rank, [])])
    return commands, envs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[int, str]]]:
    """Every launch at once; (exit status, output) of each process of each. The one through Lightning's
    launcher is one process (it starts ranks 1-3 itself)."""
    tmp = tmp_path_factory.mktemp("preflight")
    shared, private = tmp / "shared", tmp / "node_local"
    launches: dict[str, Launch] = {
        "launcher": (
            [[*CLI, "--devices", "4", "--shard-group-size", "2", "--checkpoint-dir", str(shared / "a")]],
            [launch_env()],
        ),
        "torchrun": _torchrun_like(["--shard-group-size", "auto", "--checkpoint-dir", str(shared / "b")]),
        "node_local_dir": _torchrun_like(
            ["--shard-group-size", "auto"],
            {r: ["--checkpoint-dir", str(private if r == 3 else shared / "c")] for r in range(4)},
        ),
        "dir_under_a_file": _torchrun_like(  # rank 1 cannot create its directory
            ["--shard-group-size", "auto"],
            {
                r: ["--checkpoint-dir", str(_a_file(tmp) / "sub" if r == 1 else shared / "d")]
                for r in range(4)
            },
        ),
        "layout_differs": _torchrun_like(
            [], {r: ["--shard-group-size", "4" if r == 2 else "2"] for r in range(4)}
        ),
        "group_does_not_divide": _torchrun_like(["--shard-group-size", "3"]),
        "port_differs": _torchrun_like(
            ["--timeout", "15"], per_rank_env={1: {"MASTER_PORT": str(free_port())}}
        ),
    }
    outcomes = run_launches(list(launches.values()), cwd=ROOT, timeout=240)
    return {
        name: [(code, out + err) for code, out, err in zip(*outcome, strict=True)]
        for name, outcome in zip(launches, outcomes, strict=True)
    }


def test_a_consistent_launch_passes_and_prints_one_table(runs: dict) -> None:
    for name in ("launcher", "torchrun"):
        outcomes = runs[name]
        assert all(code == 0 for code, _ in outcomes), (name, [out[-3000:] for _, out in outcomes])
        table = outcomes[0][1]
        assert "lightning-zero preflight: 4 ranks" in table and "OK: no problem found" in table
        assert "every rank sees every rank's files" in table
        assert "layout 2x2" in table and "shard groups [[0, 1], [2, 3]]" in table
        for row in ("all-reduce      world", "reduce-scatter  shard group", "all-gather      shard group"):
            assert row in table, (name, table)
        assert "all-reduce      across groups" in table


def _failed_everywhere(runs: dict, name: str, expected: str) -> None:
    outcomes = runs[name]
    assert all(code == 1 for code, _ in outcomes), (name, [(c, out[-2000:]) for c, out in outcomes])
    assert any(expected in out for _, out in outcomes), (name, expected, [out[-2000:] for _, out in outcomes])


def test_a_checkpoint_directory_one_rank_cannot_share_is_named(runs: dict) -> None:
    # rank 0 lists the shared directory and misses rank 3's probe; rank 3 looks for the probe of the
    # rank one node on (rank 1) in its node-local one
    _failed_everywhere(runs, "node_local_dir", "cannot see the probe files of ranks [3]")
    _failed_everywhere(runs, "node_local_dir", "rank 3 (host")
    _failed_everywhere(runs, "node_local_dir", "cannot see the probe files of ranks [1]")


def _a_file(tmp: Path) -> Path:
    (tmp / "a_file").write_text("not a directory")
    return tmp / "a_file"


def test_a_checkpoint_directory_one_rank_cannot_create_ends_every_rank_with_its_name(runs: dict) -> None:
    """Rank 1's path lies under a regular file: its mkdir, look-up and clean-up all fail (ENOTDIR),
    and every rank still ends, naming it (none waits in a collective the other skipped)."""
    _failed_everywhere(runs, "dir_under_a_file", "rank 1 (host")
    _failed_everywhere(runs, "dir_under_a_file", "cannot write into")


def test_a_layout_that_differs_on_one_rank_is_named(runs: dict) -> None:
    _failed_everywhere(runs, "layout_differs", "shard_group_size differs between ranks")
    _failed_everywhere(runs, "layout_differs", "rank 2: 4")


def test_a_shard_group_size_that_does_not_divide_the_world_names_the_valid_ones(runs: dict) -> None:
    _failed_everywhere(
        runs, "group_does_not_divide", "shard_group_size=3 must divide the 4 data-parallel ranks"
    )
    _failed_everywhere(runs, "group_does_not_divide", "[1, 2, 4]")


def test_a_rank_told_another_main_port_ends_every_rank_within_the_timeout(runs: dict) -> None:
    _failed_everywhere(runs, "port_differs", "could not join the job")
    _failed_everywhere(runs, "port_differs", "within 15 s")
