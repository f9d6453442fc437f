"""``ParallelDims``: the one object that places ranks on the parallel dimensions (no process group)."""

from __future__ import annotations

import pytest

from lightning_zero.layout.dims import ParallelDims


@pytest.mark.parametrize("world_size", range(1, 17))
def test_every_rank_sits_in_one_shard_group_and_one_replica_group(world_size: int) -> None:
    for shard in [g for g in range(1, world_size + 1) if world_size % g == 0]:
        dims = ParallelDims(world_size, shard)
        grid = dims.mesh()
        assert len(grid) == dims.replicate and all(len(row) == shard for row in grid)
        assert sorted(r for row in grid for r in row) == list(range(world_size))  # each rank exactly once
        columns = [list(col) for col in zip(*grid, strict=True)]
        for rank in range(world_size):
            s, r = dims.shard_rank(rank), dims.replica_rank(rank)
            assert grid[r][s] == rank
            assert dims.shard_group(rank) == grid[r] and dims.shard_group(rank)[s] == rank
            assert dims.replica_group(rank) == columns[s] and dims.replica_group(rank)[r] == rank
        assert dims.hybrid == (shard < world_size)
        assert dims.layout == f"{world_size // shard}x{shard}"


def test_a_strategys_shard_group_size_resolves() -> None:
    assert ParallelDims.of(8) == ParallelDims(8, 8)  # None: flat
    assert ParallelDims.of(8, "auto", ranks_per_node=4) == ParallelDims(8, 4)
    assert ParallelDims.of(8, 2).replicate == 4


@pytest.mark.parametrize(
    ("world_size", "size", "message"),
    [
        (
            4,
            3,
            r"shard_group_size=3 must divide the 4 data-parallel ranks into equal shard groups: "
            r"one of \[1, 2, 4\]",
        ),
        (4, 0, r"shard_group_size=0 must divide"),
        (4, True, r"shard_group_size=True must divide"),
        (4, "2", r"shard_group_size='2' must divide"),
    ],
)
def test_a_size_that_does_not_divide_the_world_names_the_valid_ones(
    world_size: int, size: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelDims.of(world_size, size)


def test_auto_needs_the_ranks_of_a_node_and_ranks_are_checked() -> None:
    with pytest.raises(ValueError, match="'auto' shards within one node"):
        ParallelDims.of(8, "auto")
    with pytest.raises(ValueError, match="world_size must be a positive number of ranks, got 0"):
        ParallelDims(0, 1)
    with pytest.raises(ValueError, match="rank 4 is not one of the 4 ranks"):
        ParallelDims(4, 2).shard_group(4)


def test_tensor_parallel_groups_are_consecutive_ranks_and_their_data_parallel_peers_the_columns() -> None:
    dims = ParallelDims.with_tensor(8, 2, ranks_per_node=4)
    assert (dims.world_size, dims.shard, dims.tensor) == (4, 4, 2)  # 4 data-parallel ranks, flat
    grid = dims.tensor_grid()
    assert grid == [[0, 1], [2, 3], [4, 5], [6, 7]]  # a tensor-parallel group inside a node
    assert [list(col) for col in zip(*grid, strict=True)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert ParallelDims.with_tensor(4, 4).tensor_grid() == [[0, 1, 2, 3]]


@pytest.mark.parametrize(
    ("ranks", "tensor", "per_node", "message"),
    [
        (8, 3, None, r"tensor_parallel_size=3 must divide the world's 8 ranks .*one of \[1, 2, 4, 8\]"),
        (8, 8, 4, r"tensor_parallel_size=8 must divide a node's 4 ranks .*one of \[1, 2, 4\]"),
        (8, 0, None, r"tensor_parallel_size=0 must divide the world's 8 ranks"),
    ],
)
def test_a_tensor_parallel_size_that_does_not_divide_names_the_valid_ones(
    ranks: int, tensor: int, per_node: int | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelDims.with_tensor(ranks, tensor, per_node)
