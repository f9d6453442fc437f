"""Every argument of both strategies is checked at construction (issue: none accepted and ignored).

The table below must name a bad value for every parameter of ``ZeroStrategy`` and
``ZeroFabricStrategy``: a new parameter without a check (and an entry here) fails this test.
"""

from __future__ import annotations

import inspect
from datetime import timedelta

import pytest
import torch

BAD = {
    # ours: ZeroConfig and ZeroOptions
    "stage": 4,
    "bucket_cap_mb": 0,
    "first_bucket_cap_mb": -1.0,
    "overlap_comm": "yes",
    "overlap_param_gather": 1,
    "reduce_dtype": "fp8",
    "error_feedback": "yes",
    "gather_dtype": "int4",
    "find_unused_parameters": "no",
    "align_numel": 0,
    "skip_nonfinite_steps": -1,
    "sharded_accumulation": "yes",
    "reshard_after_forward": "yes",
    "prefetch_units": -1,
    "unit_modules": ["no.such.Block"],
    "min_unit_numel": -1,
    "log_comm_stats": "yes",
    "sharded_checkpoint": "no",
    "async_checkpoint": 1,
    "broadcast_buffers": None,
    "shard_group_size": 0,
    "device_mesh": "2x2",
    "tensor_parallel_size": 0,
    "pipeline_parallel_size": 0,
    "pipeline_schedule": "zero_bubble",
    "pipeline_microbatches": 0,
    "pipeline_virtual_stages": 0,
    "param_init_fn": "normal",
    "profile_steps": (2, 1),
    "profile_peak_tflops": 0,
    # Lightning's DDPStrategy
    "accelerator": "cpu",
    "parallel_devices": ["cpu"],
    "cluster_environment": "slurm",
    "checkpoint_io": "torch",
    "precision_plugin": "bf16-mixed",
    "precision": "bf16-mixed",
    "process_group_backend": 7,
    "timeout": 30,
    "start_method": "thread",
}
GOOD = {"timeout": timedelta(seconds=30), "parallel_devices": [torch.device("cpu")], "start_method": "spawn"}


def _strategies() -> list[type]:
    from lightning_zero import ZeroFabricStrategy, ZeroStrategy

    return [ZeroStrategy, ZeroFabricStrategy]


@pytest.mark.parametrize("index", [0, 1], ids=["ZeroStrategy", "ZeroFabricStrategy"])
def test_every_argument_has_a_check(index: int) -> None:
    cls = _strategies()[index]
    names = [n for n in inspect.signature(cls.__init__).parameters if n != "self"]
    unchecked = [n for n in names if n not in BAD]
    assert not unchecked, f"{cls.__name__}: add a check and a bad value in BAD for {unchecked}"
    for name in names:
        with pytest.raises((TypeError, ValueError)) as caught:
            cls(**{name: BAD[name]})
        message = str(caught.value)
        assert name in message and repr(BAD[name]) in message, (name, message)
    for name, value in GOOD.items():
        cls(**{name: value})  # the checks accept what is valid


@pytest.mark.parametrize("index", [0, 1], ids=["ZeroStrategy", "ZeroFabricStrategy"])
@pytest.mark.parametrize("timeout", [timedelta(0), timedelta(seconds=-5)], ids=["zero", "negative"])
def test_a_timeout_that_is_not_positive_is_refused(index: int, timeout: timedelta) -> None:
    """``timedelta(0)`` (or less) leaves no collective any time to complete: refused at construction,
    naming the value and what is valid (the type check alone let it through)."""
    cls = _strategies()[index]
    with pytest.raises(ValueError, match="timeout") as caught:
        cls(timeout=timeout)
    message = str(caught.value)
    assert repr(timeout) in message and "positive datetime.timedelta" in message, message


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            {"tensor_parallel_size": 2, "device_mesh": "a mesh"},
            "builds its own mesh: leave device_mesh unset",
        ),
        ({"tensor_parallel_size": True}, "tensor_parallel_size must be a positive number"),
        (
            {"tensor_parallel_size": 2, "sharded_checkpoint": False},
            "sharded_checkpoint=False is not supported with tensor_parallel_size=2",
        ),
    ],
)
def test_tensor_parallelism_refuses_what_it_does_not_compose_with_yet(arguments: dict, message: str) -> None:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_zero import ZeroStrategy

    if arguments.get("device_mesh") == "a mesh":  # a DeviceMesh object, without a process group
        arguments = {**arguments, "device_mesh": DeviceMesh.__new__(DeviceMesh)}
    with pytest.raises(ValueError, match=message):
        ZeroStrategy(**arguments)
