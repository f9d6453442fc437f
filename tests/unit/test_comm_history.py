"""A collective that fails names this rank's last collectives per group (issue 43, item 4,
:mod:`lightning_zero.comm.history`): the ranks' messages side by side show where their sequences
parted; on NCCL the message points to torch's flight recorder. The rings are bounded (kept in
production), shared by every ``Comm`` over one group, and dropped with the last of them."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_zero.comm import Comm, CommError, collective_failures
from lightning_zero.comm import history as history_module
from lightning_zero.comm.backends import SingleProcess, failure_hint
from lightning_zero.comm.history import SIZE, group_history, last_collectives
from lightning_zero.comm.watchdog import Watchdog


@pytest.fixture(autouse=True)
def fresh_rings() -> Iterator[None]:
    """The fake two-rank groups below share one key ((0, role, (0,), "")): each test starts anew."""
    history_module.forget()
    yield
    history_module.forget()


class FailsAtThird(SingleProcess):
    """Two ranks; the third all-reduce fails as a dead peer's would."""

    def __init__(self, device: str = "cpu", name: str = "gloo") -> None:
        super().__init__(None, 0, 2, torch.device(device), name)
        self.calls = 0

    def all_reduce(self, tensor: Tensor, op: str) -> Any:
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("Connection closed by peer")
        return super().all_reduce(tensor, op)


def test_a_failure_names_the_last_collectives_of_every_group_failed_group_first() -> None:
    shard = Comm(None, FailsAtThird(), role="shard")
    replicas = Comm(None, SingleProcess(None, 0, 2, torch.device("cpu")), role="replicas")
    again = Comm(None, FailsAtThird(), role="shard")  # another Comm over the same group: one ring
    shard.all_reduce(torch.zeros(4), what="used-parameter mask")
    with again.labelled("bucket 1"):
        again.all_gather(torch.zeros(8), torch.zeros(8), what="parameter all-gather")
    replicas.all_reduce(torch.zeros(3, dtype=torch.bfloat16), what="gradient all-reduce across replicas")
    replicas.all_gather_object({"step": 1})
    shard.all_reduce(torch.zeros(6), what="gradient all-reduce")
    with pytest.raises(CommError) as caught, shard.labelled("bucket 0"):
        shard.all_reduce(torch.zeros(2, dtype=torch.float64), what="gradient all-reduce")
    message = str(caught.value)
    assert "rank 0 of 2 in the shard group: gradient all-reduce failed (RuntimeError: Connection closed" in (
        message
    )
    assert message.endswith(
        "last collectives on this rank: shard group (2 ranks): #1 used-parameter mask (4 x float32), "
        "#2 parameter all-gather bucket 1 (8 x float32), #3 gradient all-reduce (6 x float32), "
        "#4 gradient all-reduce bucket 0 (2 x float64); replicas group (2 ranks): #1 gradient "
        "all-reduce across replicas (3 x bfloat16), #2 all-gather of a Python object (an object)"
    ), message  # the failed group first, oldest first, the failed one last; the label ends with the block
    assert "TORCH_NCCL" not in message  # gloo: no flight recorder to point to
    assert again._history is shard._history


def test_the_ring_is_bounded_and_other_groups_show_their_last_few() -> None:
    failed = group_history(0, "world", 4, [0, 1, 2, 3], "0")
    other = group_history(0, "shard", 2, [0, 1], "1")
    for n in range(3 * SIZE):
        failed.note(f"op {n}", n, torch.float32)
        other.note(f"op {n}", n, torch.float32)
    text = last_collectives(failed, 0)
    world, shard = text.removeprefix("last collectives on this rank: ").split("; ")
    assert world.startswith("world group (4 ranks): ") and shard.startswith("shard group (2 ranks): ")
    assert world.count("#") == SIZE and world.endswith(
        f"#{3 * SIZE} op {3 * SIZE - 1} ({3 * SIZE - 1} x float32)"
    )
    assert f"#{2 * SIZE} " not in world and f"#{2 * SIZE + 1} " in world  # the oldest dropped
    assert shard.count("#") == history_module.OTHERS_SHOWN  # the others: their last few


def test_groups_of_other_ranks_of_a_simulated_world_and_dropped_groups_are_not_named() -> None:
    mine = group_history(0, "world", 2, [0, 1], "0")
    theirs = group_history(1, "world", 2, [0, 1], "0")  # a simulated rank 1 in this process
    dropped = group_history(0, "tensor", 2, [0, 1], "2")
    single = group_history(0, "shard", 1, [0], "3")
    for ring in (mine, theirs, dropped, single):
        ring.note("barrier", 1, torch.float32)
    del dropped
    gc.collect()
    text = last_collectives(mine, 0)
    assert text == "last collectives on this rank: world group (2 ranks): #1 barrier (1 x float32)", text
    assert theirs.issued == single.issued == 1


def test_the_flight_recorder_hint_is_for_nccl_only() -> None:
    hint = failure_hint("nccl")
    for name in ("TORCH_NCCL_DUMP_ON_TIMEOUT=1", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"):
        assert name in hint, hint
    assert failure_hint("gloo") == failure_hint("") == failure_hint("mpi") == ""
    comm = Comm(None, FailsAtThird(name="nccl"))
    comm.all_reduce(torch.zeros(1))
    comm.all_reduce(torch.zeros(1))
    with pytest.raises(CommError) as caught:
        comm.all_reduce(torch.zeros(1))
    assert str(caught.value).endswith(f"(1 x float32); {hint}"), str(caught.value)


def test_a_failure_of_other_code_s_collective_names_them_too() -> None:
    comm = Comm(None, FailsAtThird())
    comm.all_reduce(torch.zeros(5), what="non-finite flags")
    with pytest.raises(CommError) as caught, collective_failures("Lightning's barrier"):
        raise RuntimeError("Connection reset by peer")
    assert str(caught.value).endswith(
        "last collectives on this rank: world group (2 ranks): #1 non-finite flags (5 x float32)"
    ), str(caught.value)


class Hangs(SingleProcess):
    """A CUDA-like NCCL backend (what the watchdog watches) whose object all-gather never returns."""

    def __init__(self) -> None:
        super().__init__(None, 0, 2, torch.device("cuda"), "nccl")

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
    with pytest.raises(CommError, match=r"did not complete.*world group \(2 ranks\): #1 .*#2 ") as caught:
        comm.all_gather_object({"files": ["shard-0.pt"]})
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" in str(caught.value)
