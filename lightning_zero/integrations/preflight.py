"""``lightning-zero preflight``: in under a minute, what makes a multi-node job hang or fail late.

Launched exactly as training is (``srun``, ``torchrun``, or by itself with ``--devices N`` through
Lightning's launcher), every rank joins the process group the way training will (Lightning's cluster
environment, its launcher, the process-group timeout given), then:

  1. **the ranks agree on the job**: every rank reports what it sees (host, global and local rank, node
     rank, world size, main address and port, devices and nodes it was given, torch and lightning-zero
     versions); rank 0 checks one world of ``devices x num_nodes`` ranks, each rank once, the same
     main address everywhere, as many hosts as nodes with ``devices`` ranks on each, one version;
  2. **the checkpoint directory is one directory** (``--checkpoint-dir``): every rank writes a probe file
     into it and looks for every other rank's; a rank that cannot see them is on storage not shared
     by all nodes (a node-local disk), where a sharded checkpoint would be missing shards;
  3. **the layout** (``--shard-group-size``, as the strategy takes it: ``auto`` = the ranks of one
     node): it must divide the world, be the same on every rank, and (``auto``) keep each shard group
     on one host;
  4. **the bus bandwidth** of an all-reduce over all ranks, and of the reduce-scatter and all-gather
     inside a shard group and the all-reduce across groups, at a few sizes (nccl-tests' convention:
     all-reduce ``2(n-1)/n``, reduce-scatter and all-gather ``(n-1)/n`` times the algorithm bandwidth).

Rank 0 prints one table; every rank exits 0 if nothing is wrong, else 1 after a line per problem,
naming it. A rank that cannot join (another world size, main address or port than its peers) ends
within ``--timeout`` with a message naming what it was told, instead of waiting for ranks that never
come.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import time
import uuid
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lightning_zero._version import VERSION
from lightning_zero.comm import Comm, CommGroups, end_process_group
from lightning_zero.comm.groups import build_mesh
from lightning_zero.integrations.preflight_args import launch_shape
from lightning_zero.integrations.preflight_views import RankView, check_views, report
from lightning_zero.layout.dims import ParallelDims

if TYPE_CHECKING:
    from lightning.fabric import Fabric

_DEFAULT_SIZES_MB = {"cpu": [1.0, 8.0], "cuda": [1.0, 16.0, 128.0]}


def run(args: argparse.Namespace) -> int:
    """The whole check on this rank; its exit status (the same on every rank that joined)."""
    start = time.perf_counter()
    devices, nodes = launch_shape(args)
    host = socket.gethostname()
    try:
        from lightning.fabric import Fabric
        from lightning.fabric.strategies import DDPStrategy

        fabric = Fabric(
            accelerator=args.accelerator,
            devices=devices,
            num_nodes=nodes,
            strategy=DDPStrategy(timeout=timedelta(seconds=args.timeout)),
        )
        fabric.launch()
    except Exception as err:  # noqa: BLE001 - every way of not joining ends here, named
        print(
            f"FAIL rank {os.environ.get('RANK', os.environ.get('SLURM_PROCID', '?'))} (host {host}) could "
            f"not join the job as devices={devices} x num_nodes={nodes} (WORLD_SIZE="
            f"{os.environ.get('WORLD_SIZE', '?')}, MASTER_ADDR={os.environ.get('MASTER_ADDR', '?')}, "
            f"MASTER_PORT={os.environ.get('MASTER_PORT', '?')}) within {args.timeout:.0f} s: "
            f"{type(err).__name__}: {err}. Every rank must be told the same world size, main address "
            "and port, and the devices and nodes must match how the job was launched",
            flush=True,
        )
        return 1
    try:
        return _check(args, fabric, devices, nodes, host, start)
    finally:
        end_process_group()  # before the interpreter's exit, which could abort after the result


def _check(
    args: argparse.Namespace, fabric: Fabric, devices: int, nodes: int, host: str, start: float
) -> int:
    """The check itself, on a rank that joined."""
    env = fabric.strategy.cluster_environment  # type: ignore[attr-defined]
    device = fabric.device
    mine = RankView(
        rank=fabric.global_rank,
        host=host,
        world_size=fabric.world_size,
        local_rank=fabric.local_rank,
        node_rank=fabric.node_rank,
        main_address=str(env.main_address),
        main_port=int(env.main_port),
        devices=devices,
        num_nodes=nodes,
        shard_group_size=str(args.shard_group_size),
        torch=torch.__version__,
        lightning_zero=VERSION,
    )
    world = Comm()
    gathered = world.gather_object(asdict(mine))  # rank 0 alone receives every rank's view
    views = None if gathered is None else [RankView(**v) for v in gathered]
    problems = [] if views is None else check_views(views)
    problems += check_checkpoint_dir(world, args.checkpoint_dir, host, devices)
    problems = world.broadcast_object(problems, src=0)  # every rank goes on (or not) alike
    layout, groups = "", None
    if not problems:
        timeout = timedelta(seconds=args.timeout)
        layout, groups, layout_problems = choose_layout(
            world, mine, views, args.shard_group_size, device.type, timeout
        )
        problems = world.broadcast_object(layout_problems, src=0)
    sizes = (
        [float(s) for s in args.sizes_mb.split(",")]
        if args.sizes_mb
        else _DEFAULT_SIZES_MB.get(device.type, [1.0])
    )
    rows = measure(world, groups, sizes, device) if not problems else []
    if views is not None:
        report(views, layout, rows, problems, args.checkpoint_dir, device, time.perf_counter() - start)
    world.barrier("the end of preflight")  # nobody leaves before rank 0 has printed
    return 1 if problems else 0


def check_checkpoint_dir(world: Comm, directory: str | None, host: str, devices: int = 1) -> list[str]:
    """Every rank writes a probe into ``directory``; rank 0 lists it once and looks for every rank's
    probe, and every other rank looks for the probe of one rank on another node (``devices`` ranks
    on: the next node's when ranks are numbered node by node). So each rank makes a bounded number
    of metadata calls whatever the world size (not a listing of ``N`` probes each: ``N^2`` entries
    read from a shared file system's metadata server). Rank 0 gets the problems."""
    if directory is None:
        return []
    token = world.broadcast_object(uuid.uuid4().hex[:12] if world.rank == 0 else None, src=0)
    probe_dir = Path(directory).expanduser() / f".preflight-{token}"
    error = None
    try:
        probe_dir.mkdir(parents=True, exist_ok=True)
        (probe_dir / f"rank{world.rank}").write_text(host)
    except OSError as err:
        error = f"rank {world.rank} (host {host}) cannot write into {directory}: {err}"
    world.barrier("the checkpoint directory's probes")  # every probe written before anyone looks
    peer = (world.rank + max(devices, 1)) % world.world_size
    if peer == world.rank:
        peer = (world.rank + 1) % world.world_size
    missing = _unseen_probes(probe_dir, world.rank, world.world_size, peer)
    reports = world.gather_object((host, error, missing, directory))
    problems = []
    for rank, (rank_host, rank_error, unseen, rank_directory) in enumerate(reports or []):
        if rank_error:
            problems.append(rank_error)
        if unseen:
            problems.append(
                f"rank {rank} (host {rank_host}) cannot see the probe files of ranks {unseen} in "
                f"{rank_directory}: it is not on storage shared by all nodes (every rank writes its shard of "
                "a checkpoint there); use a shared file system path"
            )
    world.barrier("the checkpoint directory's check")  # every rank has looked
    # every rank reaches each collective whatever its file system says (a read-only mount, a path
    # under a file): a rank that raised here would leave the others waiting
    with contextlib.suppress(OSError):
        (probe_dir / f"rank{world.rank}").unlink(missing_ok=True)
    world.barrier("the checkpoint directory's clean-up")
    if world.rank == 0 or missing:
        with contextlib.suppress(OSError):  # another rank's node-local copy, or already gone
            probe_dir.rmdir()
    return problems


def _unseen_probes(probe_dir: Path, rank: int, world_size: int, peer: int) -> list[int]:
    """The ranks whose probe this rank looks for and cannot see: rank 0 every rank's (one listing),
    another rank its ``peer``'s. A directory it cannot read hides them all (never raises)."""
    try:
        if rank == 0:
            seen = {entry.name for entry in os.scandir(probe_dir)} if probe_dir.is_dir() else set()
            return [r for r in range(world_size) if f"rank{r}" not in seen]
        return [] if (probe_dir / f"rank{peer}").is_file() else [peer]
    except OSError:
        return list(range(world_size)) if rank == 0 else [peer]


def choose_layout(
    world: Comm,
    mine: RankView,
    views: list[RankView] | None,
    size: str | None,
    device_type: str,
    timeout: timedelta,
) -> tuple[str, CommGroups | None, list[str]]:
    """The layout a ``shard_group_size`` gives on these ranks, every rank told the same one
    (:func:`check_views`): its description, its groups (created with ``timeout``, so a measurement
    inside or across groups cannot outwait ``--timeout``), problems (rank 0, which has every rank's
    view in ``views``, checks that each group stays on one host; the others pass ``None``)."""
    if size is None or size == "None":
        return f"flat: every bucket split over all {world.world_size} ranks", CommGroups.flat_over(), []
    group = mine.devices if size == "auto" else int(size) if str(size).isdigit() else -1
    try:
        dims = ParallelDims.of(world.world_size, group)
    except ValueError as err:
        return "", None, [str(err).replace(f"shard_group_size={group!r}", f"shard_group_size={size}")]
    mesh = build_mesh(dims, device_type, timeout)
    groups = CommGroups.flat_over() if mesh is None else CommGroups.from_mesh(mesh)
    members = dims.mesh()
    host_of = {v.rank: v.host for v in views or []}
    spanning = [m for m in members if len({host_of[r] for r in m}) > 1] if views else []
    problems = []
    if size == "auto" and spanning:
        problems.append(
            f"shard_group_size=auto: the shard groups {spanning} span several hosts (ranks are not "
            "numbered node by node)"
        )
    text = f"{dims.layout} (shard_group_size={size}): shard groups {members}"
    if not spanning and len(set(host_of.values())) > 1:
        text += ", each within one host"
    return text, groups, problems


_BUS_TRAFFIC = {"all-reduce": 2, "reduce-scatter": 1, "all-gather": 1}
"""Times ``(n-1)/n`` of the full buffer each rank sends (and receives) in a ring, per collective."""


def bandwidths(kind: str, world_size: int, nbytes: int, seconds: float) -> tuple[float, float]:
    """(algorithm, bus) bandwidth in GB/s of one ``kind`` collective over ``world_size`` ranks on a full
    buffer of ``nbytes`` (the all-reduce's buffer, the reduce-scatter's input, the all-gather's output)
    taking ``seconds``. nccl-tests' convention: algbw = nbytes / seconds; busbw = algbw x 2(n-1)/n for an
    all-reduce, x (n-1)/n for a reduce-scatter or an all-gather, so that busbw compares with the
    links' peak bandwidth whatever the number of ranks.

    Raises:
        ValueError: for a collective other than those three.
    """
    if kind not in _BUS_TRAFFIC:
        raise ValueError(f"no bus bandwidth for {kind!r}: one of {list(_BUS_TRAFFIC)}")
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * _BUS_TRAFFIC[kind] * (world_size - 1) / world_size


def measure(
    world: Comm, groups: CommGroups | None, sizes_mb: list[float], device: torch.device, repeats: int = 3
) -> list[tuple[str, str, int, float, float, float, float]]:
    """(collective, group, ranks, MiB, ms, algorithm GB/s, bus GB/s) per size: the mean of ``repeats``
    after one warm-up, each started together (a small all-reduce first)."""
    runs: list[tuple[str, str, Comm]] = [("all-reduce", "world", world)]
    if groups is not None:  # groups of one rank (flat: no replicas) are skipped below
        runs += [("reduce-scatter", "shard group", groups.shard), ("all-gather", "shard group", groups.shard)]
        runs += [("all-reduce", "across groups", groups.replicas)]
    rows = []
    for kind, label, comm in runs:
        if comm.world_size < 2:
            continue
        for size in sizes_mb:
            numel = max(comm.world_size, int(size * 2**20 / 4) // comm.world_size * comm.world_size)
            full = torch.ones(numel, dtype=torch.float32, device=device)
            part = torch.ones(numel // comm.world_size, dtype=torch.float32, device=device)
            times = []
            for i in range(repeats + 1):
                world.wait(world.all_reduce(torch.zeros(1, device=world.device), control=True))
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                began = time.perf_counter()
                if kind == "all-reduce":
                    comm.wait(comm.all_reduce(full))
                elif kind == "reduce-scatter":
                    comm.wait(comm.reduce_scatter(part, full))
                else:
                    comm.wait(comm.all_gather(full, part))
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i:
                    times.append(time.perf_counter() - began)
            slowest = torch.tensor([sum(times) / len(times)], dtype=torch.float64, device=world.device)
            world.wait(world.all_reduce(slowest, op="max", control=True))
            seconds = slowest.item()
            algbw, busbw = bandwidths(kind, comm.world_size, numel * 4, seconds)
            rows.append((kind, label, comm.world_size, numel * 4 / 2**20, seconds * 1e3, algbw, busbw))
    return rows
