"""Pipeline stages (:mod:`lightning_zero.layout.stages`) and the pipeline dimension of the layout
(:func:`lightning_zero.layout.dims.pipeline_grid`): pure arithmetic and module surgery, no ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero.layout.dims import pipeline_grid
from lightning_zero.layout.stages import (
    OnOtherStage,
    check_stage_split,
    keep_stages,
    layer_names,
    rank_stages,
    stage_layers,
    whole_order,
)


def test_stages_take_consecutive_layers_in_equal_numbers_the_first_ones_the_rest() -> None:
    assert stage_layers(8, 2) == [range(0, 4), range(4, 8)]
    assert stage_layers(5, 4) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert stage_layers(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ValueError, match="has 3 pipeline layers, fewer than the 4 stages"):
        stage_layers(3, 4)


def test_each_rank_runs_every_p_th_stage() -> None:
    assert rank_stages(0, 2) == [0]
    assert rank_stages(1, 2, virtual=2) == [1, 3]
    assert rank_stages(2, 4, virtual=3) == [2, 6, 10]
    with pytest.raises(ValueError, match="pipeline rank 2 is not one of the 2"):
        rank_stages(2, 2)


def test_the_pipeline_dimension_is_outermost_and_the_tensor_one_innermost() -> None:
    assert pipeline_grid(8, 2, 2) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert pipeline_grid(4, 4) == [[[0]], [[1]], [[2]], [[3]]]
    with pytest.raises(
        ValueError,
        match=r"pipeline_parallel_size=3 x tensor_parallel_size=1 must divide the 4 ranks.*\[1, 2, 4\]",
    ):
        pipeline_grid(4, 3)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(2, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 2)

    def layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]


def test_a_rank_keeps_only_its_stages_layers_under_their_names() -> None:
    net = Net()
    before = {n: p.clone() for n, p in net.named_parameters()}
    bounds = stage_layers(5, 2)  # embed, blocks.0, blocks.1 | blocks.2, head
    keep_stages(net, net.layers(), bounds, mine=[1])
    assert sorted(n for n, _ in net.named_parameters()) == [
        "blocks.2.bias",
        "blocks.2.weight",
        "head.bias",
        "head.weight",
    ]
    assert all(torch.equal(p, before[n]) for n, p in net.named_parameters())
    assert isinstance(net.embed, OnOtherStage) and isinstance(net.blocks[0], OnOtherStage)
    assert len(net.blocks) == 3  # the list keeps its indices: blocks.2 stays blocks.2
    with pytest.raises(RuntimeError, match="layer 'blocks.1' runs on pipeline stage 0, not on this rank"):
        net.blocks[1](torch.zeros(4))


def test_a_group_of_modules_is_one_layer_of_the_cut_kept_or_dropped_whole() -> None:
    """[embed + block 0], block 1, [block 2 + head]: two stages of equal numbers of blocks hold the
    embedding with the first and the head with the last."""
    net = Net()
    groups = [[net.embed, net.blocks[0]], net.blocks[1], [net.blocks[2], net.head]]
    bounds = stage_layers(len(groups), 2)
    assert layer_names(net, groups) == [["embed", "blocks.0"], ["blocks.1"], ["blocks.2", "head"]]
    check_stage_split(net, groups, bounds)
    keep_stages(net, groups, bounds, mine=[1])
    assert sorted({n.rpartition(".")[0] for n, _ in net.named_parameters()}) == ["blocks.2", "head"]
    assert isinstance(net.embed, OnOtherStage) and isinstance(net.blocks[1], OnOtherStage)
    assert whole_order(net) == [n for n, _ in Net().named_parameters()]


class HeadFirst(Net):
    """The head registered before the blocks, a block's weight shared by two of its linears: the
    registration order (the one a torch optimizer numbers parameters in) is not the layers' order."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.head = nn.Linear(4, 2)
        self.embed = nn.Linear(2, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(3))
        self.blocks[1][1].weight = self.blocks[1][0].weight


@pytest.mark.parametrize("mine", [[0], [1], [0, 2], [1, 3], [0, 1, 2, 3]])
def test_every_rank_of_a_cut_model_knows_the_whole_models_parameter_order(mine: list[int]) -> None:
    """Interleaved (four stages on two ranks: [0, 2] and [1, 3]) and contiguous cuts alike."""
    whole = [n for n, _ in HeadFirst().named_parameters()]
    net = HeadFirst()
    keep_stages(net, net.layers(), stage_layers(5, 4 if len(mine) != 1 else 2), mine)
    assert whole_order(net) == whole
    assert len(list(net.parameters())) < len(whole) or len(mine) == 4


def test_a_split_that_would_lose_or_share_a_parameter_is_refused_by_name() -> None:
    net = Net()
    bounds = stage_layers(5, 2)
    check_stage_split(net, net.layers(), bounds)  # every parameter in one stage
    net.scale = nn.Parameter(torch.ones(()))
    with pytest.raises(ValueError, match=r"parameters outside every pipeline layer: \['scale'\]"):
        check_stage_split(net, net.layers(), bounds)
    del net.scale
    net.head.weight = nn.Parameter(net.embed.weight.detach().t().clone())
    net.blocks[2].weight = net.blocks[0].weight  # stage 0's and stage 1's
    with pytest.raises(ValueError, match="'blocks.0.weight' is used by layers of pipeline stages 0 and 1"):
        check_stage_split(net, net.layers(), bounds)


def test_the_layers_must_be_the_models_own_and_listed_once() -> None:
    net = Net()
    assert layer_names(net, net.layers()) == [["embed"], ["blocks.0"], ["blocks.1"], ["blocks.2"], ["head"]]
    with pytest.raises(ValueError, match=r"pipeline_layers\(\)\[1\] \(Linear\) is not a submodule"):
        layer_names(net, [net.embed, nn.Linear(4, 4)])
    with pytest.raises(ValueError, match=r"lists 'embed' twice \(positions \[0\] and \[1\]\[1\]\)"):
        layer_names(net, [net.embed, [net.head, net.embed]])
    with pytest.raises(ValueError, match=r"pipeline_layers\(\)\[1\]\[0\] \(Linear\) is not a submodule"):
        layer_names(net, [net.embed, [nn.Linear(4, 4)]])
    with pytest.raises(ValueError, match=r"pipeline_layers\(\)\[1\] is \[\]: each entry must be"):
        layer_names(net, [net.embed, []])
    with pytest.raises(ValueError, match=r"pipeline_layers\(\)\[0\] \(Net\) is not a submodule"):
        layer_names(net, [net])
