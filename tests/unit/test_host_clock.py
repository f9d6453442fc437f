"""The host's time in our code (``host_s`` of a step profile, :mod:`lightning_zero.comm.host_clock`):
entry points nested in one another count once, the host's waits on collectives inside them do not
count, another thread's calls do not count, nothing counts while the clock is off; and every way into
lightning-zero's code during a step (autograd's hooks, the forward's, the optimizer's and Lightning's
calls) is a timed entry point, at every stage, with the features that add hooks."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

import lightning_zero
from lightning_zero import ShardedAdamW, ZeroConfig
from lightning_zero.comm import CommGroups
from lightning_zero.comm.host_clock import CLOCK, StageClock, timed

PACKAGE = str(Path(lightning_zero.__file__).parent)
WRAPPER = timed(lambda: None).__code__  # the code object of every timed entry point's wrapper


class FakeClock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeClock]:
    fake = FakeClock()
    monkeypatch.setattr(time, "perf_counter", fake)
    for name, value in (("on", False), ("seconds", 0.0), ("_depth", 0), ("_thread", None)):
        monkeypatch.setattr(CLOCK, name, value)  # the process's clock, as it was after the test
    yield fake


def test_nested_entries_count_once_and_waits_inside_do_not_count(clock: FakeClock) -> None:
    @timed
    def inner() -> None:
        clock.now += 2.0
        CLOCK.waited(0.5)  # of those 2 s the host blocked 0.5 s on a collective

    @timed
    def outer() -> None:
        clock.now += 1.0
        inner()
        clock.now += 4.0

    @timed
    def raises() -> None:
        clock.now += 8.0
        raise ValueError("a hook that raises")

    outer()
    assert CLOCK.seconds == 0.0  # off: nothing counted
    CLOCK.start()
    outer()
    assert CLOCK.seconds == 6.5
    with pytest.raises(ValueError):
        raises()
    assert CLOCK.seconds == 14.5 and CLOCK._depth == 0
    CLOCK.waited(3.0)  # a wait outside any entry point: not ours to subtract
    thread = threading.Thread(target=outer)  # the asynchronous checkpoint writer's calls, say
    thread.start()
    thread.join()
    assert CLOCK.seconds == 14.5
    CLOCK.stop()
    outer()
    assert CLOCK.seconds == 14.5


def test_the_stage_clock_times_its_blocks_only_while_on(clock: FakeClock) -> None:
    stages = StageClock()
    with stages.timing(torch.device("cpu")):
        clock.now += 1.0
    assert stages.start() is False
    with stages.timing(torch.device("cpu")):
        clock.now += 2.0
    with pytest.raises(ValueError), stages.timing(torch.device("cpu")):
        clock.now += 4.0
        raise ValueError("a stage's forward that raises")
    stages.flush()
    stages.stop()
    assert stages.seconds == 6.0


# every entry point is timed --------------------------------------------------------------------------


WRAPPERS = ("torch/utils/_contextlib.py", "torch/_dynamo/eval_frame.py", "torch/_compile.py")
"""torch's decorators (``torch.no_grad()``, ``torch.compiler.disable``): a call through them is a call
by the function they decorate's caller."""
ALLOWED = {
    "ShardedAdamW.step": "it runs Lightning's closure (the training step: not ours), then its timed update",
    "_AfterImport.find_spec": "an import hook: runs when a module is first imported, not a step's work",
}


def _ours(frame: FrameType | None) -> bool:
    return frame is not None and frame.f_code.co_filename.startswith(PACKAGE)


def _caller(frame: FrameType) -> FrameType | None:
    """The frame that called ``frame``, past torch's decorators."""
    caller = frame.f_back
    while caller is not None and caller.f_code.co_filename.endswith(WRAPPERS):
        caller = caller.f_back
    return caller


def _untimed_entries(run: Any) -> list[str]:
    """Run ``run()`` under a profile of Python calls; every call into lightning-zero's code from code
    that is not ours (torch's autograd and module hooks, the test standing in for Lightning) must be a
    timed wrapper, or be made while one is running. Returns the others, by function and file."""
    found: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or not _ours(frame) or _ours(_caller(frame)) or frame.f_code is WRAPPER:
            return
        code = frame.f_code
        if CLOCK._depth == 0 and code.co_qualname not in ALLOWED:
            found.append(f"{code.co_qualname} ({Path(code.co_filename).name}:{code.co_firstlineno})")

    was = CLOCK.start()
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
        CLOCK.stop(keep=was)
    return found


class Net(torch.nn.Module):
    """Three blocks, a parameter of the root's own (stage 3 gathers it before the root's forward) and a
    norm too small to be a unit at ``min_unit_numel=50`` (its parameters the root's: a hook gathers the
    root before it runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(8))
        self.blocks = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(3)))
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.blocks(x * self.scale))


CASES = {
    "stage 1": dict(stage=1),
    "stage 2, overlapped gathers": dict(stage=2, overlap_param_gather=True),
    "stage 2, unused parameters": dict(stage=2, find_unused_parameters=True, skip_nonfinite_steps=3),
    "stage 3": dict(stage=3, min_unit_numel=50),
    "stage 3, prefetch": dict(stage=3, min_unit_numel=50, prefetch_units=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_way_into_our_code_during_a_step_is_timed(case: str) -> None:
    torch.manual_seed(0)
    model = Net().double()
    config = ZeroConfig(bucket_cap_mb=0.0002, **CASES[case])  # type: ignore[arg-type]
    opt = ShardedAdamW(
        model.parameters(), lr=1e-2, config=config, groups=CommGroups.simulated(0, 2), module=model
    )
    if config.overlap_param_gather:
        opt.install_forward_waits(model)

    def steps() -> None:
        for _ in range(2):  # the second step's forward meets the first one's gathers in flight
            model(torch.randn(4, 8, dtype=torch.float64)).pow(2).mean().backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()

    assert _untimed_entries(steps) == []
    before = CLOCK.seconds
    was = CLOCK.start()
    steps()
    CLOCK.stop(keep=was)
    assert CLOCK.seconds > before and CLOCK._depth == 0


class SlowWork:
    """A collective in flight whose wait blocks the host ``seconds`` of the fake clock."""

    def __init__(self, clock: FakeClock, seconds: float) -> None:
        self.clock, self.seconds = clock, seconds

    def wait(self) -> bool:
        self.clock.now += self.seconds
        return True


def test_a_communicators_wait_inside_an_entry_point_is_not_host_time(clock: FakeClock) -> None:
    comm = CommGroups.simulated(0, 2).world

    @timed
    def hook() -> None:
        clock.now += 1.0
        comm.wait(SlowWork(clock, 5.0))  # the host blocks on the collective: comm_exposed_s, not ours
        clock.now += 2.0

    CLOCK.start()
    waited = comm.stats.wait_s
    hook()
    CLOCK.stop()
    assert comm.stats.wait_s - waited == 5.0 and CLOCK.seconds == 3.0
