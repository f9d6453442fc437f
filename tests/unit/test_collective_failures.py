"""A peer that dies while Lightning itself runs a collective (``ModelCheckpoint``'s reduce, a barrier)
ends the strategy's rank with a ``CommError``, as every collective of ours does, so that what acts on
peer failures (the recipes' requeue) sees it. Seen in the SLURM test: rank 1 killed while rank 0 was
in ``ModelCheckpoint.file_exists``'s reduce; the job ended FAILED instead of requeueing."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_zero.comm import CommError


@pytest.fixture
def broken_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.distributed as a gloo group whose peer has gone: every collective raises like gloo."""
    import torch.distributed as dist

    def closed(*args: Any, **kwargs: Any) -> None:
        raise dist.DistBackendError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "gloo")
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    for name in ("barrier", "all_reduce", "broadcast_object_list"):
        monkeypatch.setattr(dist, name, closed)


@pytest.mark.usefixtures("broken_group")
@pytest.mark.parametrize("call", ["barrier", "reduce", "broadcast"])
def test_a_failed_lightning_collective_is_a_comm_error_the_recipes_requeue_on(call: str) -> None:
    from lightning_zero import ZeroStrategy
    from recipes.training.callbacks import peer_failure

    strategy = ZeroStrategy()
    calls = {
        "barrier": lambda: strategy.barrier("file_exists"),
        "reduce": lambda: strategy.reduce(torch.tensor(1.0), reduce_op="sum"),
        "broadcast": lambda: strategy.broadcast("path"),
    }
    with pytest.raises(CommError, match=f"Lightning's {call}.*Connection closed by peer") as caught:
        calls[call]()
    assert peer_failure(caught.value) is caught.value


def test_an_error_of_the_callers_own_is_not_a_peer_failure() -> None:
    from lightning_zero.comm import collective_failures

    with pytest.raises(TypeError), collective_failures("a reduce"):
        raise TypeError("not a tensor")
