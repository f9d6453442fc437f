"""``lightning-zero preflight``'s bandwidth figures against values worked out by hand from nccl-tests'
convention (its ``doc/PERFORMANCE.md``): algbw = bytes / time; busbw = algbw x 2(n-1)/n for an
all-reduce, x (n-1)/n for a reduce-scatter or an all-gather."""

from __future__ import annotations

import pytest

from lightning_zero.integrations.preflight import bandwidths

# (collective, ranks, bytes, seconds, algbw GB/s, busbw GB/s)
KNOWN = [
    ("all-reduce", 2, 10**9, 0.5, 2.0, 2.0),  # 2(n-1)/n = 1
    ("all-reduce", 4, 10**9, 0.5, 2.0, 3.0),  # 1.5
    ("all-reduce", 8, 6 * 10**9, 1.0, 6.0, 10.5),  # 1.75
    ("all-reduce", 3, 3 * 10**9, 2.0, 1.5, 2.0),  # 4/3
    ("reduce-scatter", 2, 10**9, 0.5, 2.0, 1.0),  # (n-1)/n = 1/2
    ("reduce-scatter", 4, 4 * 10**9, 1.0, 4.0, 3.0),  # 3/4
    ("all-gather", 8, 8 * 10**9, 2.0, 4.0, 3.5),  # 7/8
    ("all-gather", 3, 10**9, 0.25, 4.0, 8 / 3),  # 2/3
    ("all-reduce", 1, 10**9, 1.0, 1.0, 0.0),  # one rank moves nothing across a bus
]


@pytest.mark.parametrize(("kind", "ranks", "nbytes", "seconds", "algbw", "busbw"), KNOWN)
def test_bandwidths_follow_nccl_tests(
    kind: str, ranks: int, nbytes: int, seconds: float, algbw: float, busbw: float
) -> None:
    assert bandwidths(kind, ranks, nbytes, seconds) == pytest.approx((algbw, busbw), rel=1e-12, abs=0)


def test_an_all_reduce_moves_twice_what_a_reduce_scatter_or_all_gather_moves() -> None:
    """An all-reduce is a reduce-scatter then an all-gather: at equal time, twice the bus traffic."""
    all_reduce = bandwidths("all-reduce", 4, 10**9, 1.0)[1]
    assert all_reduce == pytest.approx(2 * bandwidths("reduce-scatter", 4, 10**9, 1.0)[1], rel=1e-12)
    assert all_reduce == pytest.approx(2 * bandwidths("all-gather", 4, 10**9, 1.0)[1], rel=1e-12)


def test_another_collective_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'broadcast'"):
        bandwidths("broadcast", 4, 10**9, 1.0)
