"""``zero/slowest_rank`` and the spreads ``CommStatsMonitor`` logs, from every rank's times: the rank
named is the one busy longest (outside communication waits), never the fastest."""

from __future__ import annotations

import lightning.pytorch  # noqa: F401  # before the monitor, which imported first breaks the registration
import pytest

from lightning_zero.integrations.trainer.monitor import straggler_figures


@pytest.mark.parametrize(
    ("busy_times", "slowest"),
    [
        ([0.30, 0.90, 0.10], 1),  # the fastest (rank 2) is last: naming it would be wrong
        ([0.10, 0.90, 0.30], 1),  # the fastest is first
        ([0.95, 0.20, 0.40, 0.30], 0),
        ([0.20, 0.30, 0.40, 0.50], 3),
        ([0.50, 0.50, 0.20], 0),  # equals: the first of them
    ],
)
def test_slowest_rank_is_the_one_busy_longest(busy_times: list[float], slowest: int) -> None:
    step_times = [1.0] * len(busy_times)  # ranks wait for one another: batch times are close
    assert straggler_figures(step_times, busy_times)["zero/slowest_rank"] == float(slowest)


def test_spreads_are_the_min_median_and_max_across_ranks() -> None:
    figures = straggler_figures([1.2, 1.0, 1.1], [0.3, 0.9, 0.1])
    assert figures == {
        "zero/step_time_min_s": 1.0,
        "zero/step_time_median_s": 1.1,
        "zero/step_time_max_s": 1.2,
        "zero/busy_time_min_s": 0.1,
        "zero/busy_time_median_s": 0.3,
        "zero/busy_time_max_s": 0.9,
        "zero/slowest_rank": 1.0,
    }
