"""Issue 39, item 5: stage 3 after a backward that raised, and ``gather_dtype="int8"`` with an
evaluation forward between a training forward and its backward.

A training loop that catches an error in backward (an out-of-memory error, to skip the batch) and
goes on must train as a single process that skipped that batch does: autograd never runs the
end-of-backward callbacks of a backward that raised, so what they reset (the units' arrived
gradients, the queued flag) used to stay, and two backward passes later a unit was freed after its
first gradient. (torch DDP cannot do this at all: every forward after such a backward raises
"Expected to have finished reduction in the prior iteration".)"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_zero import ShardedAdamW, ZeroConfig


class _Boom(torch.autograd.Function):
    """The identity, whose backward raises while ``armed``."""

    armed = False

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        if _Boom.armed:
            raise RuntimeError("simulated out of memory in backward")
        return grad


class _Block(nn.Module):
    """Two branches: the backward of ``b`` runs (its gradients arrive) before ``a``'s raises."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(_Boom.apply(self.a(x)) + self.b(x))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), _Block(), _Block(), _Block(), nn.Linear(6, 3)).double()


def _batch(step: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(step), dtype=torch.float64)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_loop_that_skips_a_batch_whose_backward_raised_trains_as_one_that_never_ran_it(
    accumulate: int,
) -> None:
    model = _model()
    reference = copy.deepcopy(model)
    config = ZeroConfig(stage=3, min_unit_numel=0, bucket_cap_mb=0.0002, first_bucket_cap_mb=0.0002)
    opt = ShardedAdamW(model.parameters(), lr=1e-2, config=config, module=model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    raised = 0
    for step in range(5):
        for micro in range(accumulate):
            _Boom.armed = step == 1 and micro == accumulate - 1
            try:
                model(_batch(10 * step + micro)).pow(2).mean().backward()
            except RuntimeError:
                raised += 1
                opt.zero_grad()  # the batch is skipped, its gradients dropped
                ref_opt.zero_grad()
                continue
            finally:
                _Boom.armed = False
            reference(_batch(10 * step + micro)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    assert raised == 1
    with opt.engine.full_parameters():
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-10)


def _checkpointed() -> nn.Module:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(nn.Linear(300, 300) for _ in range(3))

        def forward(self, x: torch.Tensor, recompute: bool = True) -> torch.Tensor:
            for block in self.blocks:
                x = torch.tanh(checkpoint(block, x, use_reentrant=False) if recompute else block(x))
            return x

    return Net()


def test_an_evaluation_forward_between_forward_and_backward_leaves_the_int8_backward_as_it_was() -> None:
    """``gather_dtype="int8"``: a training forward computes on dequantized weights, and its backward,
    a non-reentrant checkpoint's recomputation included, must gather those again; an evaluation forward
    of a unit in between (exact weights) used to make the recomputation gather exact ones."""
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    grads = []
    for evaluate_between in (False, True):
        model = _checkpointed()
        config = ZeroConfig(stage=3, min_unit_numel=0, gather_dtype="int8", reshard_after_forward=True)
        opt = ShardedAdamW(model.parameters(), lr=1e-2, config=config, module=model)
        loss = model(x).pow(2).sum()
        if evaluate_between:
            with torch.no_grad():
                model(x, recompute=False)
        loss.backward()
        opt.engine.finish_grad_sync()
        grads.append(torch.cat([g.clone() for g in opt.engine.reducer.grad_shards]))
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


@pytest.mark.parametrize("stage", [2, 3])
def test_the_next_backward_without_zero_grad_after_a_raised_one_is_refused_until_zero_grad(
    stage: int,
) -> None:
    """A raised backward leaves a round part-way (some buckets sent, some gradients in): going on from
    it would add that batch's partial gradients to the next one's. The next backward raises, naming
    the fix, until ``zero_grad()``; after it training goes on as a single process that skipped the batch."""
    model = _model()
    reference = copy.deepcopy(model)
    units = {"min_unit_numel": 0} if stage == 3 else {}
    config = ZeroConfig(stage=stage, bucket_cap_mb=0.0002, first_bucket_cap_mb=0.0002, **units)
    opt = ShardedAdamW(model.parameters(), lr=1e-2, config=config, module=model if stage == 3 else None)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    _Boom.armed = True
    try:
        with pytest.raises(RuntimeError, match="simulated out of memory"):
            model(_batch(0)).pow(2).mean().backward()
    finally:
        _Boom.armed = False
    for _ in range(2):  # refused again while the partial round is kept
        with pytest.raises(RuntimeError, match=r"call optimizer\.zero_grad\(\) before the next backward"):
            model(_batch(1)).pow(2).mean().backward()
    opt.zero_grad()
    for step in range(2, 4):
        model(_batch(step)).pow(2).mean().backward()
        reference(_batch(step)).pow(2).mean().backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    with opt.engine.full_parameters():
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-10)
