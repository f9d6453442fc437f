"""Models whose ranks use different parameters inside a unit (issue 39): what a router, a conditional
branch or a sometimes-used head does. Each is a residual stack of four blocks in an ``nn.ModuleList``
(stage 3's units with ``unit_modules=UNITS``) between an input and an output layer held by the root;
the third block, or the root, is where the ranks differ, as :func:`path_of` says for (step, micro,
rank). (Two units before it: at stage 3 the backward gather of the first comes after the third's
gradients, where a launch that follows the data would go before or after it.)

  * ``gate``: the third block multiplies by a learned gate on some (step, rank) pairs only;
  * ``moe``: the third block is a mixture of experts: a top-1 router over 4 experts, each sample sent
    to its highest-scoring expert and scaled by its softmax weight, so the experts a rank uses follow
    its data (a micro-batch of 2 samples reaches at most 2 of the 4);
  * ``head``: the root holds an auxiliary head whose loss is added on some (step, rank) pairs only.
"""

from __future__ import annotations

import torch
from torch import nn

KINDS = ("gate", "moe", "head")


def path_of(step: int, micro: int, rank: int) -> bool:
    """Whether rank ``rank`` takes the optional path (gate, auxiliary head) in that micro-batch: rank 0
    on even steps, rank 1 on odd ones, every rank on steps 3 mod 4 (so some steps no rank does)."""
    if step % 4 == 3:
        return True
    return (step + micro + rank) % 3 == 0


class PlainBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, path: bool) -> torch.Tensor:
        return h + torch.tanh(self.fc(self.norm(h)))


class GateBlock(PlainBlock):
    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.gate = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, path: bool) -> torch.Tensor:
        out = torch.tanh(self.fc(self.norm(h)))
        if path:
            out = out * torch.sigmoid(self.gate(h))
        return h + out


class MoEBlock(nn.Module):
    """A top-1 mixture of 4 experts (each a 2-layer MLP) behind a linear router."""

    def __init__(self, width: int, experts: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width))
            for _ in range(experts)
        )

    def forward(self, h: torch.Tensor, path: bool) -> torch.Tensor:
        x = self.norm(h)
        weights = torch.softmax(self.router(x), dim=-1)  # (batch, experts)
        top = weights.argmax(dim=-1)  # (batch,)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            chosen = (top == e).nonzero(as_tuple=True)[0]
            if len(chosen):  # an expert no sample chose never runs: its parameters get no gradient
                out = out.index_add(0, chosen, expert(x[chosen]) * weights[chosen, e : e + 1])
        return h + out


UNITS = (PlainBlock, GateBlock, MoEBlock)
"""The unit classes at stage 3 (``ZeroConfig(unit_modules=UNITS)``): the blocks; the rest is the root."""


class PathNet(nn.Module):
    """Input layer, four blocks (the third of ``kind``), output layer, and for ``kind="head"`` an
    auxiliary head in the root: ``forward`` returns the output and the auxiliary output or ``None``."""

    def __init__(self, kind: str, width: int = 8) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        middle = {"gate": GateBlock, "moe": MoEBlock, "head": PlainBlock}[kind]
        self.inp = nn.Linear(7, width)
        self.blocks = nn.ModuleList([PlainBlock(width), PlainBlock(width), middle(width), PlainBlock(width)])
        self.out = nn.Linear(width, 5)
        self.aux = nn.Linear(width, 5) if kind == "head" else None

    def forward(self, x: torch.Tensor, path: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = torch.relu(self.inp(x))
        for block in self.blocks:
            h = block(h, path)
        aux = self.aux(h) if self.aux is not None and path else None
        return self.out(h), aux


def loss_of(output: tuple[torch.Tensor, torch.Tensor | None], y: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the output, plus the auxiliary head's where it ran."""
    out, aux = output
    loss = torch.nn.functional.mse_loss(out, y)
    return loss if aux is None else loss + 0.5 * torch.nn.functional.mse_loss(aux, y.flip(-1))


def batch(step: int, micro: int, rank: int, size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch ``micro`` of ``step`` (float64): different on every rank, so the
    router sends them to different experts."""
    g = torch.Generator().manual_seed(1_000 * step + 10 * micro + rank)
    return torch.randn(size, 7, generator=g, dtype=torch.float64), torch.randn(
        size, 5, generator=g, dtype=torch.float64
    )
