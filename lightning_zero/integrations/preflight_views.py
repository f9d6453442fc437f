"""What ``lightning-zero preflight``'s ranks report (:class:`RankView`), rank 0's checks of it, and
its table (:mod:`lightning_zero.integrations.preflight`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RankView:
    """What one rank was told and sees."""

    rank: int
    host: str
    world_size: int
    local_rank: int
    node_rank: int
    main_address: str
    main_port: int
    devices: int
    num_nodes: int
    shard_group_size: str
    torch: str
    lightning_zero: str


def check_views(views: list[RankView]) -> list[str]:
    """Rank 0's checks of what every rank reported (see the module docstring)."""
    problems = []
    first = views[0]
    keys = ("world_size", "devices", "num_nodes", "main_address", "main_port", "shard_group_size")
    for key in (*keys, "torch", "lightning_zero"):
        values = {getattr(v, key) for v in views}
        if len(values) > 1:
            seen = _listed(
                [f"rank {v.rank}: {getattr(v, key)}" for v in views if getattr(v, key) != getattr(first, key)]
            )
            problems.append(f"{key} differs between ranks: rank 0 has {getattr(first, key)!r}; {seen}")
    expected = first.devices * first.num_nodes
    if len(views) != expected:
        problems.append(
            f"{len(views)} ranks joined, devices={first.devices} x num_nodes={first.num_nodes} = "
            f"{expected} expected"
        )
    counts = Counter(v.rank for v in views)
    if sorted(counts) != list(range(len(views))):
        twice = sorted(r for r, n in counts.items() if n > 1)
        absent = sorted(set(range(len(views))) - set(counts))
        problems.append(
            f"global ranks are not 0..{len(views) - 1} once each: more than once "
            f"{_listed(list(map(str, twice))) or 'none'}; never {_listed(list(map(str, absent))) or 'none'}"
        )
    hosts: dict[str, list[int]] = {}
    for v in views:
        hosts.setdefault(v.host, []).append(v.rank)
    uneven = {h: r for h, r in hosts.items() if len(r) != first.devices}
    if len(hosts) > 1 and uneven:  # one host may stand for several "nodes" (tests, a workstation)
        problems.append(
            "hosts do not each run devices="
            f"{first.devices} ranks: " + _listed([f"{h}: ranks {r}" for h, r in uneven.items()], "; ")
        )
    local = {(v.host, v.node_rank, v.local_rank) for v in views}
    if len(local) != len(views):
        problems.append("two ranks share a host, node rank and local rank: they would use the same device")
    return problems


def _listed(items: list[str], sep: str = ", ", most: int = 8) -> str:
    """``items`` joined, the first ``most`` of them and how many more (a problem names the ranks that
    differ, not thousands of them)."""
    more = f"{sep}and {len(items) - most} more" if len(items) > most else ""
    return sep.join(items[:most]) + more


ROWS_IN_FULL = 64
"""Up to this many ranks, the table has a row per rank; beyond, a row per host, the first and last
:data:`HOSTS_SHOWN` hosts (a table of thousands of rows is not read)."""
HOSTS_SHOWN = 4


def rank_table(views: list[RankView]) -> list[str]:
    """The table of ranks: one row per rank up to :data:`ROWS_IN_FULL` ranks; beyond, one per host
    (its ranks, node ranks and local ranks, as ranges), the first and last :data:`HOSTS_SHOWN`."""
    ordered = sorted(views, key=lambda v: v.rank)
    if len(ordered) <= ROWS_IN_FULL:
        lines = [f"{'rank':>5} {'host':<24}{'node':>5}{'local':>6}{'world':>6}"]
        lines += [
            f"{v.rank:>5} {v.host:<24}{v.node_rank:>5}{v.local_rank:>6}{v.world_size:>6}" for v in ordered
        ]
        return lines
    hosts: dict[str, list[RankView]] = {}
    for v in ordered:
        hosts.setdefault(v.host, []).append(v)
    lines = [f"{'host':<24}{'ranks':>14}{'node':>12}{'local':>10}"]
    rows = list(hosts.items())
    shown = rows if len(rows) <= 2 * HOSTS_SHOWN else rows[:HOSTS_SHOWN] + rows[-HOSTS_SHOWN:]
    for i, (host, members) in enumerate(shown):
        if len(shown) < len(rows) and i == HOSTS_SHOWN:
            lines.append(f"... {len(rows) - 2 * HOSTS_SHOWN} more hosts")
        cells = [_span([getattr(v, key) for v in members]) for key in ("rank", "node_rank", "local_rank")]
        lines.append(f"{host:<24}{cells[0]:>14}{cells[1]:>12}{cells[2]:>10}")
    return lines


def _span(values: list[int]) -> str:
    """``"a-b"`` for consecutive integers, ``"a"`` for one, else the distinct values (up to 4)."""
    distinct = sorted(set(values))
    if len(distinct) == 1:
        return str(distinct[0])
    if distinct == list(range(distinct[0], distinct[-1] + 1)):
        return f"{distinct[0]}-{distinct[-1]}"
    return ",".join(map(str, distinct[:4])) + (",..." if len(distinct) > 4 else "")


def report(
    views: list[RankView],
    layout: str,
    rows: list[tuple[str, str, int, float, float, float, float]],
    problems: list[str],
    directory: str | None,
    device: torch.device,
    elapsed: float,
) -> None:
    """Rank 0's table."""
    hosts = sorted({v.host for v in views})
    print(
        f"lightning-zero preflight: {len(views)} ranks on {len(hosts)} host(s), device {device.type}, "
        f"main {views[0].main_address}:{views[0].main_port}, torch {views[0].torch}, "
        f"lightning-zero {views[0].lightning_zero}"
    )
    for line in rank_table(views):
        print(line)
    if directory is not None:
        print(
            f"checkpoint directory {directory}: "
            + (
                "FAIL (below)"
                if any(directory in p for p in problems)
                else "every rank sees every rank's files"
            )
        )
    if layout:
        print(f"layout {layout}")
    if rows:
        print(
            f"{'collective':<16}{'group':<15}{'ranks':>6}{'MiB':>9}{'ms':>10}"
            f"{'algbw GB/s':>12}{'busbw GB/s':>12}"
        )
        for kind, label, n, mib, ms, alg, bus in rows:
            print(f"{kind:<16}{label:<15}{n:>6}{mib:>9.1f}{ms:>10.2f}{alg:>12.3f}{bus:>12.3f}")
    for problem in problems:
        print(f"FAIL {problem}")
    print(
        ("OK: no problem found" if not problems else f"{len(problems)} problem(s)") + f" ({elapsed:.1f} s)",
        flush=True,
    )
