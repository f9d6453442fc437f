"""The data-parallel ranks as groups: who shards with whom, who replicates whom (node-aware sharding).

Flat sharding splits every bucket over all ``N`` data-parallel ranks. Hybrid sharding splits it over
groups of ``G`` ranks (one node, by default) and replicates the shards across the ``R = N / G``
groups, as FSDP's ``HYBRID_SHARD``, DeepSpeed's hpZ and Megatron-Core's
``num_distributed_optimizer_instances`` do. The layout is a torch ``DeviceMesh`` of shape
``(R, G)``, dims ``("replicate", "shard")``: global rank ``r * G + s`` is shard ``s`` of replica
``r``, so a shard group is ``G`` consecutive ranks: one node when ranks are numbered node by node
(SLURM's block distribution, torchrun).

:class:`CommGroups` holds one :class:`~lightning_zero.comm.Comm` per role:

  * ``shard``: the ``G`` ranks that split the buckets. Gradients are reduce-scattered (stage 2) or
    all-reduced (stage 1) and parameters all-gathered inside it; the bucket plan, the shard files of
    a checkpoint and every rank index of the layout are this group's.
  * ``replicas``: the ``R`` ranks that hold the same shard (shard ``s`` of every group). After the
    shard group's reduction each rank all-reduces its ``1/G`` shard of the gradients across them.
  * ``world``: all ``N`` ranks: what every rank must agree on (used-parameter masks, the non-finite
    guard's flags, the plan check, broadcasts of rank 0's model, checkpoint commits).

Flat sharding is the case ``R = 1``: ``shard`` and ``world`` are the same :class:`Comm` and
``replicas`` is a single-process one, whose collectives cost nothing and count nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_zero.comm.backends import SingleProcess
from lightning_zero.comm.communicator import Comm
from lightning_zero.comm.recorder import Entry
from lightning_zero.comm.signatures import SignatureCheck
from lightning_zero.comm.simulated import Peer, Simulated
from lightning_zero.layout.dims import ParallelDims

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("replicate", "shard")
"""The dim names of the meshes built here (a user's mesh may name its dims otherwise: dim 0 is
always the replicate dim, dim 1 the shard dim, as in FSDP2's hybrid sharding)."""


@dataclass
class CommGroups:
    """The three roles of the data-parallel ranks (see the module docstring)."""

    shard: Comm
    replicas: Comm
    world: Comm

    @property
    def hybrid(self) -> bool:
        """Shards are replicated across groups (``R > 1``)."""
        return self.replicas.world_size > 1

    @property
    def layout(self) -> str:
        """``"RxG"``: replica groups times ranks per shard group (``"1x4"``: flat over 4 ranks)."""
        return f"{self.replicas.world_size}x{self.shard.world_size}"

    def check_signatures(self) -> None:
        """``LZ_CHECK_COLLECTIVES``: every collective of these groups is compared across the world's
        ranks before it is issued (:mod:`lightning_zero.comm.signatures`), over a gloo group made here
        with the world's timeout. Call on all ranks of the default process group. Nothing to compare
        in a world of one rank, or a simulated one.

        Raises:
            ValueError: the world is not the default process group (its ranks alone cannot make the
                side group).
        """
        world = self.world
        if world.world_size == 1 or isinstance(world.backend, Simulated | SingleProcess):
            return
        if world.world_size != dist.get_world_size():
            raise ValueError(
                f"LZ_CHECK_COLLECTIVES needs the data-parallel ranks to be the default process group "
                f"({world.world_size} of {dist.get_world_size()} ranks here); unset it, or shard over "
                "the default group"
            )
        check = SignatureCheck(world.backend.global_ranks(), world.backend.timeout_s())
        for comm in (self.shard, self.replicas, self.world):
            if comm.world_size > 1:  # a group of one (flat sharding's replicas) issues nothing
                comm.check_signatures(check)

    @classmethod
    def of(cls, comm: Comm | CommGroups) -> CommGroups:
        """``comm`` itself if it is groups, else flat sharding over its ranks."""
        return comm if isinstance(comm, CommGroups) else cls(comm, Comm.single(comm.device), comm)

    @classmethod
    def flat_over(cls, process_group: ProcessGroup | None = None) -> CommGroups:
        """Every bucket split over all ranks of ``process_group`` (``None``: the default group)."""
        return cls.of(Comm(process_group))

    @classmethod
    def simulated(
        cls,
        rank: int,
        world_size: int,
        shard_group_size: int | None = None,
        device: str = "cpu",
        peer: Peer | None = None,
        log: list[Entry] | None = None,
    ) -> CommGroups:
        """Rank ``rank`` of a simulated world of ``world_size`` ranks in this process
        (:mod:`lightning_zero.comm.simulated`): flat sharding, or ``shard_group_size`` ranks per shard
        group laid out as :func:`hybrid_mesh` lays them (groups of consecutive ranks). ``peer``: what
        another rank sends in an object collective; ``log``: a list every group of this rank appends
        its collectives to, in the order issued (the order check).

        Raises:
            ValueError: a rank outside the world, or a group size that does not divide it.
        """
        dev = torch.device(device)
        dims = ParallelDims.of(world_size, shard_group_size)
        world_backend = Simulated(rank, world_size, dev, "simulated world", peer=peer, log=log)
        world = Comm(None, world_backend, role="world")
        if not dims.hybrid:
            return cls(world, Comm.single(dev), world)
        shard_ranks, across_ranks = dims.shard_group(rank), dims.replica_group(rank)
        shard = Simulated(dims.shard_rank(rank), dims.shard, dev, "simulated shard", shard_ranks, peer, log)
        across = Simulated(
            dims.replica_rank(rank), dims.replicate, dev, "simulated replicas", across_ranks, peer, log
        )
        return cls(Comm(None, shard, role="shard"), Comm(None, across, role="replicas"), world)

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> CommGroups:
        """The groups of a 1-D mesh (flat sharding over it) or a 2-D ``(replicate, shard)`` mesh.

        Raises:
            ValueError: a mesh of another number of dims, or a 2-D one that does not span the
                default process group (whose ranks then are the world every rank agrees over).
        """
        if mesh.ndim == 1:
            return cls.flat_over(mesh.get_group(0))
        if mesh.ndim != 2:
            raise ValueError(
                f"device_mesh has {mesh.ndim} dims {mesh.mesh_dim_names}; pass a 1-D mesh (flat sharding) or "
                "a 2-D one whose dim 0 replicates and dim 1 shards, e.g. init_device_mesh(device, (R, G))"
            )
        if mesh.size() != dist.get_world_size():
            raise ValueError(
                f"the 2-D device_mesh holds {mesh.size()} ranks, the default process group "
                f"{dist.get_world_size()}: hybrid sharding runs over all ranks of the default group "
                "(build the mesh over all of them, or pass a 1-D mesh or a process_group for flat sharding)"
            )
        return cls(
            Comm(mesh.get_group(1), role="shard"), Comm(mesh.get_group(0), role="replicas"), Comm(None)
        )


def hybrid_mesh(
    shard_group_size: int | str,
    device_type: str,
    timeout: timedelta | None = None,
    ranks_per_node: int | None = None,
) -> DeviceMesh | None:
    """A ``(N / G, G)`` mesh over the default process group with ``G = shard_group_size`` ranks per
    shard group (``"auto"``: ``ranks_per_node``; :func:`build_mesh`); ``None`` when ``G`` is the world
    size. Call on all ranks.

    Raises:
        ValueError: ``shard_group_size`` is not a positive divisor of the world size (named).
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return build_mesh(ParallelDims.of(world, shard_group_size, ranks_per_node), device_type, timeout)


def build_mesh(dims: ParallelDims, device_type: str, timeout: timedelta | None = None) -> DeviceMesh | None:
    """The ``(R, G)`` mesh of ``dims`` over the default process group, dims :data:`MESH_DIMS`;
    ``None`` for flat sharding (it needs no new group). Call on all ranks.

    Its process groups are created here (every shard group and every replica group, in one fixed order
    on every rank) with ``timeout``, the training group's: torch's ``init_device_mesh`` would give them
    its default (10 minutes on NCCL, 30 on gloo), which a hung peer inside a shard or replica collective
    would then cost every rank. ``None``: torch's default.

    Raises:
        ValueError: ``dims`` is not a layout of the default process group's ranks.
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if dims.world_size != world:
        raise ValueError(f"a layout of {dims.world_size} ranks ({dims.layout}) over a world of {world}")
    if not dims.hybrid:
        return None
    return _grid_mesh(dims.mesh(), MESH_DIMS, device_type, timeout)  # row r a shard group, column s a replica


TENSOR_MESH_DIMS = ("data_parallel", "tensor_parallel")
"""The dims of :func:`tensor_mesh`: Lightning ``ModelParallelStrategy``'s names, so that a user's
``configure_model`` written for it finds ``self.device_mesh["tensor_parallel"]``."""


def tensor_mesh(
    tensor: int, device_type: str, timeout: timedelta | None = None, ranks_per_node: int | None = None
) -> DeviceMesh:
    """The ``(N / T, T)`` mesh :data:`TENSOR_MESH_DIMS` over the default process group, ``T = tensor``
    consecutive ranks per tensor-parallel group (:meth:`ParallelDims.with_tensor`), its groups created
    with ``timeout`` (:func:`build_mesh`). Call on all ranks.

    Raises:
        ValueError: ``tensor`` does not divide the world or the ranks of a node (named).
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    dims = ParallelDims.with_tensor(world, tensor, ranks_per_node)
    return _grid_mesh(dims.tensor_grid(), TENSOR_MESH_DIMS, device_type, timeout)


def tensor_groups(
    dims: ParallelDims, device_type: str, timeout: timedelta | None = None
) -> tuple[CommGroups, DeviceMesh]:
    """Node-aware sharding beside tensor parallelism: this rank's :class:`CommGroups` (its shard group,
    its replicas and all data-parallel ranks of its tensor rank) and its ``(data_parallel,
    tensor_parallel)`` mesh (:func:`tensor_mesh`), over the default process group laid out as ``dims``
    (:meth:`ParallelDims.with_tensor`). Every group is created here, by every rank in one order, with
    ``timeout``. Call on all ranks.

    Raises:
        ValueError: ``dims`` is not a layout of the default process group's ranks.
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if dims.world_size * dims.tensor != world:
        raise ValueError(f"a layout of {dims.world_size * dims.tensor} ranks over a world of {world}")
    mesh = _grid_mesh(dims.tensor_grid(), TENSOR_MESH_DIMS, device_type, timeout)
    rank = dist.get_rank()
    mine: dict[str, ProcessGroup] = {}
    for t in range(dims.tensor):

        def at(data_ranks: list[int], t: int = t) -> list[int]:
            return [dims.global_rank(d, t) for d in data_ranks]

        layouts = {
            "shard": [at(row) for row in dims.mesh()],
            "replicas": [at(list(col)) for col in zip(*dims.mesh(), strict=True)],
        }
        for name, members in layouts.items():
            for ranks in members:
                group = dist.new_group(ranks=ranks, timeout=timeout)
                if rank in ranks:
                    mine[name] = group
    data = mesh[TENSOR_MESH_DIMS[0]].get_group()  # all data-parallel ranks of this tensor rank
    groups = CommGroups(
        Comm(mine["shard"], role="shard"), Comm(mine["replicas"], role="replicas"), Comm(data, role="world")
    )
    return groups, mesh


def pipeline_mesh(
    pipeline: int, tensor: int, device_type: str, timeout: timedelta | None = None
) -> DeviceMesh:
    """The ``(P, D, T)`` mesh :data:`PIPELINE_MESH_DIMS` over the default process group
    (:func:`~lightning_zero.layout.dims.pipeline_grid`: the pipeline dimension outermost, ``T``
    consecutive ranks per tensor-parallel group), its groups created with ``timeout``. Call on all ranks.

    Raises:
        ValueError: ``pipeline * tensor`` does not divide the world (named).
    """
    from lightning_zero.layout.dims import pipeline_grid

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return _grid_mesh(pipeline_grid(world, pipeline, tensor), PIPELINE_MESH_DIMS, device_type, timeout)


PIPELINE_MESH_DIMS = ("pipeline_parallel", *TENSOR_MESH_DIMS)
"""The dims of :func:`pipeline_mesh`: the pipeline dimension before Lightning's two."""


def _grid_mesh(
    grid: list[Any], names: tuple[str, ...], device_type: str, timeout: timedelta | None
) -> DeviceMesh:
    """A mesh of the global ranks in ``grid`` (nested lists, one level per dim): dim ``k``'s groups
    are the lines of ranks along axis ``k``; every group created here, by every rank in one order
    (``dist.new_group`` is a collective of the world), innermost dim first."""
    from torch.distributed.device_mesh import DeviceMesh

    rank = dist.get_rank()
    ranks = torch.tensor(grid)
    mine: dict[int, ProcessGroup] = {}
    for dim in reversed(range(ranks.ndim)):
        for line in ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist():
            group = dist.new_group(ranks=line, timeout=timeout)
            if rank in line:
                mine[dim] = group
    return DeviceMesh.from_group(
        [mine[d] for d in range(ranks.ndim)], device_type, mesh=ranks, mesh_dim_names=names
    )


def is_device_mesh(obj: Any) -> bool:
    """Whether ``obj`` is a torch ``DeviceMesh``."""
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(obj, DeviceMesh)
