"""``StepProfiler`` driven hook by hook in one process, over an engine of figures set by the test: the
FLOP count on the step before the window (ended by the batch's end when no backward comes), tokens
per step (unknown stays unknown), the collective tally as reported (absent where the ranks' kinds
differ), the host's time in our code and a pipeline stage's idle time, and the report's new fields."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.fabric.utilities.throughput import measure_flops
from torch import nn

from lightning_zero.comm.host_clock import STAGE_CLOCK
from lightning_zero.engine.figures import EngineMemory
from lightning_zero.integrations.trainer.step_profile import PROFILE_FILE, StepProfiler


class Engine:
    """The engine's figures the profiler reads; two ranks, rank 1 a copy of rank 0 (or ``differ``)."""

    def __init__(self, differ: bool = False) -> None:
        self.wait = self.gather_wait = 0.0
        self.reset_at = (0.0, 0.0)  # the waits when the counters were last reset
        self.tally: dict[str, tuple[int, int]] | None = None
        self.differ = differ
        self.gathers = 0
        self.host, self.host_on = 0.0, False  # seconds in our code; whether its clock is on

    def time_host(self, on: bool = True) -> bool:
        was, self.host_on = self.host_on, on
        return was

    def host_s(self) -> float:
        return self.host

    def synchronize_device(self) -> None: ...
    def flush_timings(self) -> None: ...
    def time_device_waits(self, on: bool = True) -> bool:
        return False

    def comm_wait_s(self, since_start: bool = False) -> float:
        return self.wait - (0.0 if since_start else self.reset_at[0])

    def comm_gather_wait_s(self, since_start: bool = False) -> float:
        return self.gather_wait - (0.0 if since_start else self.reset_at[1])

    def reset_comm_stats(self) -> None:
        self.reset_at = (self.wait, self.gather_wait)

    def start_collective_tally(self) -> None:
        self.tally = {}

    def stop_collective_tally(self) -> dict[str, tuple[int, int]]:
        tally, self.tally = self.tally or {}, None
        return tally

    def gathered_peak_bytes(self, reset: bool = False) -> int:
        return 0

    def memory(self) -> EngineMemory:
        return EngineMemory(8, 4, 0, 0, 0, param_bytes=8)  # state, grad shards, pool, adopted, outside

    def peak_memory_bytes(self) -> tuple[int, str]:
        return 100, "process_max_rss"

    def estimated_memory(self, precision: str) -> dict[str, int]:
        return {"param_bytes": 8}

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        self.gathers += 1
        other = list(values)
        if self.differ and self.gathers == 1:
            other[-1] += 1  # another rank's kinds
        elif self.gathers == 1:
            other[0] = 1.0  # its rank
        return [values, other]


class Module(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
        self.logged: dict[str, float] = {}

    def log_dict(self, metrics: dict[str, float], **kwargs: Any) -> None:
        self.logged = metrics


def trainer(tmp: Path) -> Any:
    return SimpleNamespace(
        global_step=0,
        global_rank=0,
        is_global_zero=True,
        log_dir=str(tmp),
        world_size=2,
        precision="32-true",
        strategy=SimpleNamespace(root_device=torch.device("cpu")),
    )


def run(profiler: StepProfiler, t: Any, module: Any, batches: list[Any], backward: bool = True) -> None:
    """Steps 0..3 of one batch each; the engine waits 0.5 s (0.25 s on gathers) and, while its tally
    is on, sends one reduce-scatter of 40 bytes per step."""
    engine = profiler.engine
    for step, batch in enumerate(batches):
        t.global_step = step
        profiler.on_train_batch_start(t, module, batch, step)
        engine.reset_comm_stats()  # as the log_comm_stats monitor's batch start may, after the profiler's
        x = batch[0] if isinstance(batch, tuple) else batch
        x = x if isinstance(x, torch.Tensor) else torch.randn(4, 16)
        loss = module.net(x).sum()
        profiler.on_before_backward(t, module, loss)
        if backward:
            loss.backward()
            profiler.on_after_backward(t, module)
        engine.wait += 0.5
        engine.gather_wait += 0.25
        engine.host += 0.125 if engine.host_on else 1.0  # counted only while the profiler has it on
        if engine.tally is not None:
            count, nbytes = engine.tally.get("reduce_scatter world", (0, 0))
            engine.tally["reduce_scatter world"] = (count + 1, nbytes + 40)
        profiler.on_before_optimizer_step(t, module, None)
        t.global_step = step + 1
        profiler.on_train_batch_end(t, module, None, batch, step)
    t.global_step = len(batches)
    profiler.on_train_batch_start(t, module, batches[0], len(batches))  # the report


def test_a_counted_window(tmp_path: Path) -> None:
    module = Module()
    x = torch.randn(4, 16)
    expected = measure_flops(module, lambda: module.net(x), lambda y: y.sum())
    profiler = StepProfiler(Engine(), 1, 2)  # type: ignore[arg-type]
    run(profiler, trainer(tmp_path), module, [(x, None)] * 4)
    report = json.loads((tmp_path / PROFILE_FILE).read_text())
    rates = report["throughput"]
    assert rates["flops_per_token"] == expected / 64 and "FlopCounterMode" in rates["flops_formula"]
    assert rates["tokens_per_step"] == 2 * 64 and rates["mfu"] is None
    for rank in report["ranks"]:
        assert [s["tokens"] for s in rank["steps"]] == [64, 64]
        assert [s["gather_wait_s"] for s in rank["steps"]] == [0.25, 0.25]
        assert [s["host_s"] for s in rank["steps"]] == [0.125, 0.125]
        assert rank["comm"] == {"reduce_scatter world": {"count": 2, "bytes": 80}}  # the window's 2 steps
    assert report["estimate"] == {"param_bytes": 8}
    assert (
        module.logged["zero/profile/gather_wait_s"] == 0.25 and "zero/profile/tokens_per_s" in module.logged
    )
    assert module.logged["zero/profile/host_s"] == 0.125
    assert not profiler.engine.host_on  # off again after the window's last step (it was off before)


def test_a_count_without_backward_ends_with_its_batch(tmp_path: Path) -> None:
    module = Module()
    profiler = StepProfiler(Engine(), 1, 2)  # type: ignore[arg-type]
    run(profiler, trainer(tmp_path), module, [(torch.randn(4, 16), None)] * 4, backward=False)
    assert profiler._counter._mode is None  # not left counting through the window
    forward = measure_flops(module, lambda: module.net(torch.randn(4, 16)))
    assert profiler.report is not None and profiler.report["throughput"]["flops_per_token"] == forward / 64


def test_unknown_tokens_and_kinds_that_differ(tmp_path: Path) -> None:
    module = Module()
    profiler = StepProfiler(Engine(differ=True), 1, 2)  # type: ignore[arg-type]
    run(profiler, trainer(tmp_path), module, [torch.randn(4, 16), "text", "text", torch.randn(4, 16)])
    report = profiler.report
    assert report is not None
    assert all("comm" not in rank for rank in report["ranks"])
    assert all(s["tokens"] == -1 for rank in report["ranks"] for s in rank["steps"])
    assert report["throughput"]["tokens_per_s"] is None and report["throughput"]["tokens_per_step"] is None


class Halves(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h[:, :16] * h[:, 16:]  # the product saves both halves: two views of one storage


def test_the_activations_of_the_step_before_the_window(tmp_path: Path) -> None:
    """What autograd saves in the forward of step 0's micro-batch, each storage once: the input (read
    by the first weight's gradient), the Tanh's output (its own backward; the product's two halves are
    views of it) and the product (the last Linear's input); not the weights nor their transposed views.
    The count ends before the backward."""
    module = Module()
    module.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), Halves(), nn.Linear(16, 1))
    x = torch.randn(4, 16)
    profiler = StepProfiler(Engine(), 1, 2)  # type: ignore[arg-type]
    run(profiler, trainer(tmp_path), module, [(x, None)] * 4)
    assert not profiler._activations.counting
    report = json.loads((tmp_path / PROFILE_FILE).read_text())
    hidden, product = 4 * 32 * 4, 4 * 16 * 4  # float32
    assert [r["memory"]["activation_bytes"] for r in report["ranks"]] == [x.nbytes + hidden + product] * 2


def test_no_activations_are_counted_from_step_0_or_under_a_pipeline(tmp_path: Path) -> None:
    for first, pipeline in ((0, False), (1, True)):
        profiler = StepProfiler(Engine(), first, 2, pipeline=pipeline)  # type: ignore[arg-type]
        run(profiler, trainer(tmp_path), Module(), [(torch.randn(4, 16), None)] * 4)
        assert profiler.report is not None
        assert all("activation_bytes" not in r["memory"] for r in profiler.report["ranks"]), (first, pipeline)


class Stating(Module):
    """States its activation bytes: 100 per input element, so that the report shows which micro-batch
    it was asked about."""

    def activation_bytes(self, batch: tuple[torch.Tensor, None]) -> int:
        return 100 * batch[0].numel()


def test_the_estimate_holds_the_modules_activation_bytes_of_the_micro_batch_measured(tmp_path: Path) -> None:
    """A LightningModule that states ``activation_bytes`` (the recipe's) has it in ``estimate`` beside the
    engine's kinds, for the micro-batch whose activations are measured (step 0's); a window from step 0
    measures none and states none, nor does a module without the method (``test_a_counted_window``)."""
    batches = [(torch.randn(rows, 16), None) for rows in (3, 4, 5, 6)]
    for first, stated in ((1, 100 * 3 * 16), (0, None)):
        profiler = StepProfiler(Engine(), first, 2)  # type: ignore[arg-type]
        run(profiler, trainer(tmp_path), Stating(), batches)
        assert profiler.report is not None
        assert profiler.report["estimate"].get("activation_bytes") == stated, first
        assert profiler.report["estimate"]["param_bytes"] == 8  # the engine's kinds still there


class FakeClock:
    """``time.perf_counter`` advanced only by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_pipeline_stages_idle_time_is_its_schedule_outside_its_own_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a pipeline the schedule (in the training step) takes 1 s per step, of which the stage's
    own work (timed by the stage clock) 0.75 s: 0.25 s idle. Outside the window the stage clock is off."""
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    profiler = StepProfiler(Engine(), 1, 2, pipeline=True)  # type: ignore[arg-type]
    t, module = trainer(tmp_path), Module()
    clocked = []
    for step in range(4):
        t.global_step = step
        profiler.on_train_batch_start(t, module, None, step)
        clocked.append(STAGE_CLOCK.on)
        with STAGE_CLOCK.timing(torch.device("cpu")):  # a micro-batch's forward and backward
            clock.now += 0.75
        clock.now += 0.25  # waiting for a neighbour
        profiler.on_after_backward(t, module)
        profiler.on_before_optimizer_step(t, module, None)
        clock.now += 0.5
        t.global_step = step + 1
        profiler.on_train_batch_end(t, module, None, None, step)
    profiler.on_train_batch_start(t, module, None, 4)
    assert profiler.report is not None
    assert clocked == [False, True, True, False] and not STAGE_CLOCK.on
    for rank in profiler.report["ranks"]:
        for step in rank["steps"]:
            assert (step["pipeline_s"], step["pipeline_idle_s"]) == (1.0, 0.25), step
            assert (step["forward_s"], step["backward_s"], step["optimizer_s"]) == (0.0, 0.0, 0.5), step
