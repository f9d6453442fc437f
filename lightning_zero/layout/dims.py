"""The ranks laid out over the parallel dimensions: one object owns the arithmetic.

Every layer asks :class:`ParallelDims` where a rank sits and who its groups are (torchtitan's
``ParallelDims`` plays this part there); nothing else recomputes a rank or a group from sizes. The
dimensions, outermost first, and the global rank of a coordinate:

  * ``replicate`` (``R = world_size / G``): groups holding the same shards (node-aware sharding);
  * ``shard`` (``G``, ``shard_group_size``): the ranks that split every bucket;

  ``rank = r * G + s``: a shard group is ``G`` consecutive ranks, one node when ranks are numbered
  node by node (SLURM's block distribution, torchrun). Flat sharding is ``R = 1``.

With tensor parallelism (``tensor = T > 1``) a third dimension sits innermost: each data-parallel
rank ``d`` above is a group of ``T`` consecutive ranks, ``rank = d * T + t`` (a node's ranks, over
NVLink), whose data-parallel peers are the ranks of the same ``t``.

With pipeline parallelism (``P`` stages) the pipeline dimension sits outermost
(:func:`pipeline_grid`): ``rank = p * D * T + d * T + t``, so a stage's ``D * T`` ranks are
consecutive (whole nodes) and only activations cross between them.

Pure arithmetic: no process group, no torch (``lightning-zero estimate`` reads it). The process
groups and the ``DeviceMesh`` of a layout are built from :meth:`ParallelDims.mesh` by
:func:`lightning_zero.comm.groups.hybrid_mesh`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

AUTO = "auto"
"""``shard_group_size="auto"``: the ranks of one node."""


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the dimensions of ``world_size`` ranks (see the module docstring).

    Raises:
        ValueError: a world size that is no positive count, or a ``shard`` size that does not divide
            it into equal groups (named, with the sizes that would).
    """

    world_size: int
    """The data-parallel ranks (all ranks when ``tensor`` is 1)."""
    shard: int
    tensor: int = 1
    """``T``: ranks per tensor-parallel group, innermost."""

    def __post_init__(self) -> None:
        if not _is_count(self.world_size):
            raise ValueError(f"world_size must be a positive number of ranks, got {self.world_size!r}")
        if not _is_count(self.tensor):
            raise ValueError(f"tensor_parallel_size must be a positive number of ranks, got {self.tensor!r}")
        if not _is_count(self.shard) or self.world_size % self.shard:
            divisors = [g for g in range(1, self.world_size + 1) if self.world_size % g == 0]
            raise ValueError(
                f"shard_group_size={self.shard!r} must divide the {self.world_size} data-parallel ranks "
                f"into equal shard groups: one of {divisors} (or 'auto': the ranks of one node)"
            )

    @classmethod
    def of(
        cls, world_size: int, shard_group_size: Any = None, ranks_per_node: int | None = None
    ) -> ParallelDims:
        """The layout a strategy's ``shard_group_size`` gives on ``world_size`` ranks: ``None`` flat,
        ``"auto"`` ``ranks_per_node`` per group, a number that many.

        Raises:
            ValueError: the size does not divide the world (named, with the valid ones), or ``"auto"``
                without ``ranks_per_node``.
        """
        if shard_group_size is None:
            return cls(world_size, world_size)
        if shard_group_size == AUTO:
            if ranks_per_node is None:
                raise ValueError("shard_group_size='auto' shards within one node: give the ranks of a node")
            return cls(world_size, ranks_per_node)
        return cls(world_size, shard_group_size)

    @property
    def replicate(self) -> int:
        """``R``: how many shard groups hold the same shards."""
        return self.world_size // self.shard

    @property
    def hybrid(self) -> bool:
        """Shards are replicated across groups (``R > 1``)."""
        return self.replicate > 1

    @property
    def layout(self) -> str:
        """``"RxG"`` (``"1x4"``: flat over 4 ranks)."""
        return f"{self.replicate}x{self.shard}"

    def shard_rank(self, rank: int) -> int:
        """``s``: ``rank``'s index in its shard group (the shard it owns)."""
        return self._check(rank) % self.shard

    def replica_rank(self, rank: int) -> int:
        """``r``: ``rank``'s index in its replica group (which shard group it is in)."""
        return self._check(rank) // self.shard

    def shard_group(self, rank: int) -> list[int]:
        """The global ranks of ``rank``'s shard group, in shard order."""
        base = self.replica_rank(rank) * self.shard
        return list(range(base, base + self.shard))

    def replica_group(self, rank: int) -> list[int]:
        """The global ranks holding the same shard as ``rank``, in replica order."""
        return list(range(self.shard_rank(rank), self.world_size, self.shard))

    def mesh(self) -> list[list[int]]:
        """The ``(R, G)`` grid of global ranks: row ``r`` is a shard group, column ``s`` a replica group."""
        return [list(range(r * self.shard, (r + 1) * self.shard)) for r in range(self.replicate)]

    @classmethod
    def with_tensor(
        cls, ranks: int, tensor: int, ranks_per_node: int | None = None, shard_group_size: Any = None
    ) -> ParallelDims:
        """``ranks`` in all, ``tensor`` per tensor-parallel group (innermost: inside a node), and the
        ``ranks / tensor`` data-parallel ranks sharded flat or in groups of ``shard_group_size``
        (:meth:`of`; ``"auto"``: the data-parallel ranks of one node, ``ranks_per_node / tensor``).

        Raises:
            ValueError: ``tensor`` does not divide ``ranks``, or the ranks of a node; a shard group
                size that does not divide the data-parallel ranks (named, with the sizes that would).
        """
        for what, count in (("the world's", ranks), ("a node's", ranks_per_node)):
            if count is not None and (not _is_count(tensor) or count % tensor):
                sizes = [t for t in range(1, count + 1) if count % t == 0]
                raise ValueError(
                    f"tensor_parallel_size={tensor!r} must divide {what} {count} ranks (a tensor-parallel "
                    f"group lives inside one node): one of {sizes}"
                )
        data = ranks // tensor
        per_node = None if ranks_per_node is None else ranks_per_node // tensor
        return cls(data, cls.of(data, shard_group_size, per_node).shard, tensor)

    def global_rank(self, data_rank: int, tensor_rank: int) -> int:
        """The global rank of data-parallel rank ``data_rank`` (0 to ``world_size - 1``) and tensor
        rank ``tensor_rank``."""
        return self._check(data_rank) * self.tensor + tensor_rank

    def tensor_grid(self) -> list[list[int]]:
        """The ``(D, T)`` grid of global ranks: row ``d`` a tensor-parallel group, column ``t`` the
        data-parallel ranks of tensor rank ``t``."""
        return [list(range(d * self.tensor, (d + 1) * self.tensor)) for d in range(self.world_size)]

    def _check(self, rank: int) -> int:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} is not one of the {self.world_size} ranks")
        return rank


def pipeline_grid(world_size: int, pipeline: int, tensor: int = 1) -> list[list[list[int]]]:
    """The ``(P, D, T)`` grid of global ranks with the pipeline dimension outermost and the tensor
    dimension innermost: ``grid[p][d][t] = p * D * T + d * T + t`` (``D = world_size / (P * T)``).

    Raises:
        ValueError: ``pipeline`` (times ``tensor``) does not divide ``world_size``, named with the
            pipeline sizes that would.
    """
    if not _is_count(pipeline):
        raise ValueError(f"pipeline_parallel_size must be a positive number of stages, got {pipeline!r}")
    if not _is_count(tensor) or world_size % (pipeline * tensor):
        sizes = [p for p in range(1, world_size + 1) if world_size % (p * tensor) == 0]
        raise ValueError(
            f"pipeline_parallel_size={pipeline} x tensor_parallel_size={tensor} must divide the {world_size} "
            f"ranks (each stage gets the same number of ranks): pipeline sizes {sizes}"
        )
    data = world_size // (pipeline * tensor)
    return [
        [[(p * data + d) * tensor + t for t in range(tensor)] for d in range(data)] for p in range(pipeline)
    ]
