"""``skip_nonfinite_steps`` at world size 1 (no process group: the verdict needs only a host
synchronisation), the option's values, and the fp16 loss-scaling interplay."""

from __future__ import annotations

import pytest
import torch

from lightning_zero import NonFiniteGradientError, ShardedAdamW, ZeroConfig
from tests.distributed.workers_nonfinite import consecutive, skip_case


@pytest.mark.parametrize(
    "case",
    [
        {"stage": 2, "dtype": "float64", "accum": 2, "bad": (0, 2, 1)},
        {
            "stage": 1,
            "dtype": "float32",
            "accum": 3,
            "bad": (0, 1, 0),
            "kind": "inf_grad",
            "find_unused": False,
        },
        {"stage": 2, "dtype": "bfloat16", "accum": 1, "bad": (0, 3, 0), "kind": "neg_inf_grad"},
    ],
)
def test_one_rank_skip_equals_a_twin_that_skipped_the_step(case: dict) -> None:
    result = skip_case(0, 1, **case)
    assert result["skipped"] == 1 and result["ranks"] == [0]
    assert result["params_equal"] and result["state_equal"] and result["unchanged_over_bad_step"]
    assert result["finite"] and result["moved"] > 1e-2


def test_one_rank_raises_at_the_limit_naming_step_and_rank() -> None:
    result = consecutive(0, 1, limit=2, bad_at={1: [0], 2: [0]}, stage=2, find_unused=False)
    assert (result["step"], result["ranks"], result["skipped"]) == (2, [0], 2)
    assert "optimizer step 2 on rank(s) 0: 2 step(s) in a row skipped (steps 1 to 2)" in result["message"]
    assert result["unchanged"]


def test_off_by_default_a_nan_reaches_the_parameters_as_under_ddp() -> None:
    model = torch.nn.Linear(3, 2)
    opt = ShardedAdamW(model.parameters(), lr=0.1)
    (model(torch.ones(1, 3)).sum() * float("nan")).backward()
    opt.step()
    assert opt.skipped_steps == 0 and not bool(torch.isfinite(model.weight).all())


def test_limit_one_raises_at_the_first_non_finite_step_with_nothing_updated() -> None:
    model = torch.nn.Linear(3, 2)
    before = model.weight.detach().clone()
    opt = ShardedAdamW(model.parameters(), lr=0.1, config=ZeroConfig(skip_nonfinite_steps=1))
    (model(torch.ones(1, 3)).sum() * float("inf")).backward()
    with pytest.raises(NonFiniteGradientError, match="optimizer step 0 on rank.s. 0") as raised:
        opt.step()
    assert raised.value.step == 0 and raised.value.ranks == [0]
    assert torch.equal(model.weight, before) and not opt.engine.accumulating
    model(torch.ones(1, 3)).sum().backward()  # training can go on after the error is handled
    opt.step()
    assert not torch.equal(model.weight, before) and opt.skipped_steps == 1


def test_loss_scaling_overflow_is_the_scalers_skip_and_is_not_counted() -> None:
    """``unscale_`` finds the overflow: the caller drops the step (as the precision plugins do) and the
    guard never sees it; a finite ``unscale_`` tells the guard so (no second check)."""
    model = torch.nn.Linear(3, 2)
    opt = ShardedAdamW(model.parameters(), lr=0.1, config=ZeroConfig(skip_nonfinite_steps=1))
    (model(torch.ones(1, 3)).sum() * float("inf")).backward()
    assert opt.unscale_(1024.0)
    opt.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    assert not opt.unscale_(1024.0)
    opt.step()
    assert opt.skipped_steps == 0
