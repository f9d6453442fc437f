"""What "the same parameters" means in the recipes' resume tests: every parameter of the whole model,
each bit-identical - never a comparison that holds because nothing was compared."""

from __future__ import annotations

import torch

from tests.distributed.resume_fit import IndexedLit


def assert_same_parameters(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """`actual` and `expected` (`resume_fit.fit`'s "params") name the same whole tensors, all equal."""
    whole = dict(IndexedLit().named_parameters())
    assert expected.keys() == actual.keys() == whole.keys(), "another set of parameters (or none)"
    assert all(expected[k].shape == actual[k].shape == whole[k].shape for k in whole), "not whole tensors"
    different = [k for k in whole if not torch.equal(actual[k], expected[k])]
    assert not different, f"parameters differ: {different}"
