"""A collective that fails names the group's last collectives on this rank (issue 43, item 4): the
ranks' messages side by side show where their sequences parted; on NCCL the message points to torch's
flight recorder. The ring is bounded (kept in production)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_zero.comm import Comm, CommError
from lightning_zero.comm.backends import SingleProcess
from lightning_zero.comm.handles import History
from lightning_zero.comm.watchdog import Watchdog


class FailsAtThird(SingleProcess):
    """Two ranks; the third all-reduce fails as a dead peer's would."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__(None, 0, 2, torch.device(device))
        self.calls = 0

    def all_reduce(self, tensor: Tensor, op: str) -> Any:
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("Connection closed by peer")
        return super().all_reduce(tensor, op)


def test_a_failure_names_the_last_collectives() -> None:
    comm = Comm(None, FailsAtThird())
    comm.all_reduce(torch.zeros(4), what="used-parameter mask")
    comm.all_gather(torch.zeros(8), torch.zeros(8), what="parameter all-gather")
    comm.all_reduce(torch.zeros(6), what="gradient all-reduce")
    with pytest.raises(CommError) as caught:
        comm.all_reduce(torch.zeros(2), what="gradient all-reduce")
    message = str(caught.value)
    assert "rank 0 of 2: gradient all-reduce failed (RuntimeError: Connection closed by peer)" in message
    assert message.endswith(
        "its last collectives here: #1 used-parameter mask (4 elements), #2 parameter all-gather "
        "(8 elements), #3 gradient all-reduce (6 elements), #4 gradient all-reduce (2 elements)"
    ), message  # the failed one last
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in message  # gloo: no flight recorder to point to


def test_the_ring_is_bounded_and_points_to_the_flight_recorder_on_nccl() -> None:
    history = History(torch.device("cuda"))
    for n in range(3 * History.SIZE):
        history.note(f"op {n}", n)
    text = history.describe()
    assert text.count("#") == History.SIZE and f"#{3 * History.SIZE} op {3 * History.SIZE - 1}" in text
    assert "#1 " not in text and "TORCH_NCCL_TRACE_BUFFER_SIZE=2000" in text


class Hangs(SingleProcess):
    """A CUDA-like backend (what the watchdog watches) whose object all-gather never returns."""

    def __init__(self) -> None:
        super().__init__(None, 0, 2, torch.device("cuda"))

    def all_gather_object(self, obj: Any) -> list[Any]:
        end = time.monotonic() + 5.0
        while time.monotonic() < end:
            time.sleep(0.01)
        return [obj, obj]

    def abort(self) -> None:
        pass


def test_a_timeout_found_by_the_watchdog_names_them_too() -> None:
    comm = Comm(None, Hangs())
    comm.watch(Watchdog(CommError, poll_s=0.05, exit_after=None), 0.5)
    comm.all_reduce(torch.zeros(3), what="non-finite flags")  # watched, done at once
    with pytest.raises(CommError, match=r"did not complete.*its last collectives here: #1 .*#2 ") as caught:
        comm.all_gather_object({"files": ["shard-0.pt"]})
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" in str(caught.value)
