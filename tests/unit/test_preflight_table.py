"""``lightning-zero preflight``'s table and rank 0's checks at thousands of ranks (issue 31): a row per
rank up to 64 ranks, beyond that a row per host, the first and last four; the checks of what every
rank reported still name the one rank that differs."""

from __future__ import annotations

from dataclasses import replace

from lightning_zero.integrations.preflight_views import RankView, check_views, rank_table


def _views(world: int, per_host: int = 8) -> list[RankView]:
    return [
        RankView(
            rank=r,
            host=f"gpu{r // per_host:04d}",
            world_size=world,
            local_rank=r % per_host,
            node_rank=r // per_host,
            main_address="gpu0000",
            main_port=29500,
            devices=per_host,
            num_nodes=world // per_host,
            shard_group_size="auto",
            torch="2.13.0",
            lightning_zero="0.1.0",
        )
        for r in range(world)
    ]


def test_up_to_64_ranks_every_rank_has_a_row() -> None:
    lines = rank_table(_views(64))
    assert len(lines) == 65 and lines[-1].split() == ["63", "gpu0007", "7", "7", "64"]


def test_8192_ranks_print_a_row_per_host_for_the_first_and_last_four() -> None:
    views = _views(8192)
    lines = rank_table(views)
    assert len(lines) == 10, lines
    assert lines[1].split() == ["gpu0000", "0-7", "0", "0-7"]
    assert lines[5] == "... 1016 more hosts"
    assert lines[-1].split() == ["gpu1023", "8184-8191", "1023", "0-7"]
    assert check_views(views) == []


def test_at_8192_ranks_the_one_rank_that_differs_is_named() -> None:
    views = _views(8192)
    views[5000] = replace(views[5000], main_port=29501)
    views[7001] = replace(views[7001], shard_group_size="8")
    problems = check_views(views)
    assert any("main_port differs between ranks: rank 0 has 29500; rank 5000: 29501" in p for p in problems)
    assert any("shard_group_size differs between ranks" in p and "rank 7001: 8" in p for p in problems)


def test_a_problem_names_eight_ranks_and_counts_the_others() -> None:
    views = _views(8192)
    views[100:4196] = [replace(v, torch="2.12.0") for v in views[100:4196]]
    views[9] = replace(views[9], rank=10)
    problems = check_views(views)
    assert any(
        p.startswith("torch differs between ranks: rank 0 has '2.13.0'; rank 100: 2.12.0, ")
        and p.endswith("rank 107: 2.12.0, and 4088 more")
        for p in problems
    ), problems
    assert "global ranks are not 0..8191 once each: more than once 10; never 9" in problems
    assert max(len(p) for p in problems) < 400
