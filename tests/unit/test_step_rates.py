"""The step profile's inputs and rates without a process group: the peak table, the token and FLOP
rules (:mod:`lightning_zero.integrations.trainer.step_rates`), the communication layer's tally and
gather wait, the engine's high-water mark of gathered units, and the estimate it is compared with."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.throughput import measure_flops
from torch import nn

from lightning_zero.comm.communicator import Comm
from lightning_zero.comm.handles import CommStats
from lightning_zero.config import ZeroConfig
from lightning_zero.integrations.options import ZeroOptions
from lightning_zero.integrations.trainer import step_rates
from lightning_zero.integrations.trainer.step_rates import (
    FlopCount,
    batch_tokens,
    given_activation_bytes,
    given_flops_per_token,
    peak_tflops,
    rates,
)
from lightning_zero.layout.memory import POOL_SLOTS, estimate_components

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("name", "precision", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16-mixed", 989.4),
        ("NVIDIA H100 PCIe", "bf16-true", 756.0),
        ("NVIDIA H100 NVL", "16-mixed", 835.5),
        ("NVIDIA H200", "bf16-mixed", 989.4),
        ("NVIDIA A100-SXM4-80GB", "bf16-mixed", 312.0),
        ("NVIDIA A100 80GB PCIe", "16-true", 312.0),
        ("NVIDIA H100 80GB HBM3", "32-true", None),
        ("NVIDIA GeForce RTX 4090", "bf16-mixed", None),
    ],
)
def test_peak_by_device_name(monkeypatch: pytest.MonkeyPatch, name: str, precision: str, tflops: Any) -> None:
    monkeypatch.setattr(step_rates.torch.cuda, "get_device_name", lambda device: name)
    peak, source = peak_tflops(CUDA, precision, None)
    assert peak == tflops, source
    assert (name in source) if tflops else ("profile_peak_tflops" in source)


def test_the_option_overrides_the_table_and_a_cpu_has_no_peak() -> None:
    assert peak_tflops(CUDA, "bf16-mixed", 500) == (500.0, "profile_peak_tflops")
    assert peak_tflops(torch.device("cpu"), "32-true", 1.5) == (1.5, "profile_peak_tflops")
    peak, source = peak_tflops(torch.device("cpu"), "bf16-mixed", None)
    assert peak is None and "cpu" in source and "profile_peak_tflops" in source


@pytest.mark.parametrize("bad", [0, -1.0, "989", True])
def test_the_peak_option_is_checked(bad: Any) -> None:
    with pytest.raises(ValueError, match="profile_peak_tflops"):
        ZeroOptions(config=ZeroConfig(), profile_steps=(1, 2), profile_peak_tflops=bad)


def test_the_peak_option_needs_a_profile() -> None:
    with pytest.raises(ValueError, match="profile_steps"):
        ZeroOptions(config=ZeroConfig(), profile_peak_tflops=989.4)
    assert (
        ZeroOptions(config=ZeroConfig(), profile_steps=[1, 2], profile_peak_tflops=989).profile_peak_tflops
        == 989
    )


class Plain(pl.LightningModule):
    pass


class Stated(pl.LightningModule):
    def tokens_in_batch(self, batch: Any) -> int:
        return 7

    def flops_per_token(self, batch: Any) -> float:
        return 6.0 * len(batch)

    def activation_bytes(self, batch: Any) -> float:
        return 1024.0 * len(batch)


def test_tokens_of_a_batch() -> None:
    ids = torch.zeros(4, 16, dtype=torch.long)
    assert batch_tokens(Plain(), {"input_ids": ids, "labels": torch.zeros(4, 99)}) == 64
    assert batch_tokens(Plain(), (ids, torch.zeros(4, 99))) == 64  # the first tensor: the inputs
    assert batch_tokens(Plain(), ids) == 64
    assert batch_tokens(Plain(), {"text": ["a"]}) is None and batch_tokens(Plain(), "text") is None
    assert batch_tokens(Stated(), (ids, ids)) == 7  # the module's word first


def test_flops_per_token_given() -> None:
    assert given_flops_per_token(Plain(), (1, 2)) is None
    assert given_flops_per_token(Stated(), (1, 2)) == 12.0
    module = Plain()
    module.flops_per_token = 3  # a number
    assert given_flops_per_token(module, None) == 3.0


def test_activation_bytes_given() -> None:
    assert given_activation_bytes(Plain(), (1, 2)) is None
    assert given_activation_bytes(Stated(), (1, 2, 3)) == 3072 and isinstance(
        given_activation_bytes(Stated(), (1,)), int
    )
    module = Plain()
    module.activation_bytes = 5.0  # a number
    assert given_activation_bytes(module, None) == 5


def test_the_flop_count_is_lightnings_measure_flops() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 5))
    x = torch.randn(6, 32)
    expected = measure_flops(model, lambda: model(x), lambda y: y.sum())
    counter = FlopCount()
    counter.start(6 * 32)
    model(x).sum().backward()
    counter.stop()
    assert expected > 0 and counter.flops_per_token == expected / (6 * 32)
    counter.stop()  # once: a second stop changes nothing
    assert counter.flops_per_token == expected / (6 * 32)


def test_rates_follow_the_stated_formula() -> None:
    tokens = [[100, 100, 100], [100, 100, 100]]  # two ranks, three steps
    step_s = [[0.5, 0.5, 0.5], [0.5, 0.6, 0.5]]  # the slowest rank's window: 1.6 s
    out = rates(tokens, step_s, 1e9, "given", 4, (10.0, "table"))
    assert out["tokens_per_step"] == 200 and out["window_s"] == pytest.approx(1.6)
    assert out["tokens_per_s"] == pytest.approx(600 / 1.6)
    assert out["tokens_per_s_per_device"] == pytest.approx(600 / 1.6 / 4)
    assert out["achieved_tflops_per_device"] == pytest.approx(1e9 * 600 / 1.6 / 4 / 1e12)
    assert out["mfu"] == pytest.approx(out["achieved_tflops_per_device"] / 10.0)
    assert out["flops_formula"] == "given" and out["peak_source"] == "table"
    unknown = rates([[100, -1], [100, 100]], step_s, 1e9, "given", 4, (None, "cpu"))
    assert unknown["tokens_per_s"] is None and unknown["achieved_tflops_per_device"] is None
    no_peak = rates(tokens, step_s, 1e9, "given", 4, (None, "cpu"))
    assert no_peak["mfu"] is None and no_peak["achieved_tflops_per_device"] is not None
    no_flops = rates(tokens, step_s, None, "not counted", 4, (10.0, "table"))
    assert no_flops["achieved_tflops_per_device"] is None and no_flops["mfu"] is None


def test_the_tally_counts_by_kind_only_while_on() -> None:
    stats = CommStats()
    stats.count(10, torch.float32, kind="reduce_scatter")
    assert stats.tally is None and stats.stop_tally() == {}  # off: nothing kept
    stats.start_tally()
    stats.count(10, torch.float32, kind="reduce_scatter")
    stats.count(6, torch.bfloat16, kind="all_gather")
    stats.reset()  # log_comm_stats's monitor resets between logs, inside a profiled window
    stats.count(6, torch.bfloat16, kind="all_gather")
    stats.count(2, torch.float64, control=True, kind="all_reduce")
    assert stats.stop_tally() == {
        "reduce_scatter": [1, 40],
        "all_gather": [2, 24],
        "all_reduce_control": [1, 16],
    }
    assert stats.tally is None and stats.bytes_sent == 12 and stats.control_bytes_sent == 16  # since reset()


def test_parameter_gather_waits_are_counted_apart() -> None:
    comm = Comm.single(torch.device("cpu"))
    out, shard = torch.zeros(8), torch.ones(8)
    comm.wait(comm.all_gather(out, shard, params=True))
    gathered = comm.stats.gather_wait_s
    assert gathered > 0 and gathered == comm.stats.wait_s
    comm.wait(comm.all_gather(out, shard))  # not parameters: a wait, not a gather wait
    comm.wait(comm.all_reduce(out))
    assert comm.stats.gather_wait_s == gathered < comm.stats.wait_s
    waited = comm.stats.wait_s
    comm.stats.reset()
    assert comm.stats.gather_wait_s == 0.0 == comm.stats.wait_s
    assert comm.stats.waits_since_start_s == (waited, gathered)  # no reset clears them


def test_the_estimate_bounds_buckets_by_the_model() -> None:
    """A model smaller than the pool's buckets: its gradients, not 3 x bucket_cap_mb; stage 3 with a unit
    no larger than a bucket: 3 units in the buckets (one filling, two in flight), a larger unit 2."""
    small = estimate_components(1000, 2, "32-true", 25.0)
    assert small["zero2"]["gradient buckets"] == 4000
    big = estimate_components(1e9, 2, "32-true", 25.0)
    assert big["zero2"]["gradient buckets"] == POOL_SLOTS * 25 * 2**20
    units = estimate_components(1e6, 2, "32-true", 25.0, unit_params=1e5)
    assert units["zero3"]["gradient buckets"] == POOL_SLOTS * 4e5
    large_units = estimate_components(1e10, 2, "32-true", 25.0, unit_params=1e8)
    assert large_units["zero3"]["gradient buckets"] == 2 * 4e8
