"""Small models and batches shared by the distributed parity tests."""

from __future__ import annotations

import torch
from torch import nn


class TinyNet(nn.Module):
    """Two param groups' worth of tensors, a frozen layer and a sometimes-unused parameter."""

    def __init__(self, width: int = 13) -> None:
        super().__init__()
        self.inp = nn.Linear(7, width)
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(width)
        self.extra = nn.Parameter(torch.randn(width) * 0.1)
        self.out = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = torch.tanh(self.frozen(torch.relu(self.inp(x))))
        if use_extra:
            h = h + self.extra
        return self.out(self.norm(h))


def param_groups(model: nn.Module) -> list[dict]:
    """Weight decay for matrices, none for vectors (norms, biases, ``extra``)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def batch(
    step: int, micro: int, rank: int, size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The deterministic micro-batch ``micro`` of rank ``rank`` at ``step``."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    x = torch.randn(size, 7, generator=g, dtype=dtype)
    y = torch.randn(size, 5, generator=g, dtype=dtype)
    return x, y


def uses_extra(step: int, rank: int) -> bool:
    """``extra`` is unused by every rank on steps 2 mod 3 and by rank 1 only on odd steps."""
    if step % 3 == 2:
        return False
    return not (rank == 1 and step % 2 == 1)


class Block(nn.Module):
    """A residual block with a gate that some steps leave unused (a unit at stage 3)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.gate = nn.Parameter(torch.randn(width) * 0.1)

    def forward(self, h: torch.Tensor, use_gate: bool) -> torch.Tensor:
        out = h + torch.tanh(self.fc(self.norm(h)))
        return out * (1 + self.gate) if use_gate else out


class BlockNet(nn.Module):
    """TinyNet's inputs and outputs with three blocks in an ``nn.ModuleList`` between (stage 3's units),
    a frozen layer, and a gate in the middle block used as ``uses_extra`` says."""

    def __init__(self, width: int = 13) -> None:
        super().__init__()
        self.inp = nn.Linear(7, width)
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))
        self.out = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = torch.tanh(self.frozen(torch.relu(self.inp(x))))
        for i, block in enumerate(self.blocks):
            h = block(h, use_extra and i == 1)
        return self.out(h)


class RootedBlockNet(BlockNet):
    """BlockNet with a parameter the root module holds itself, a mixing matrix between the input layer
    and the blocks: stage 3's root unit is not empty (in BlockNet every parameter is in a unit)."""

    def __init__(self, width: int = 13) -> None:
        super().__init__(width)
        self.mix = nn.Parameter(torch.eye(width) + 0.1 * torch.randn(width, width))

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = torch.tanh(self.frozen(torch.relu(self.inp(x)))) @ self.mix
        for i, block in enumerate(self.blocks):
            h = block(h, use_extra and i == 1)
        return self.out(h)


HOOK_KINDS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def hooks_left(model: nn.Module) -> list[str]:
    """Where ``model`` holds hooks: ``"<module name>.<kind>"`` per module, a parameter's name for its
    gradient hooks (a plain module holds none)."""
    found = [
        f"{name or '<root>'}.{kind}"
        for name, module in model.named_modules()
        for kind in HOOK_KINDS
        if getattr(module, kind)
    ]
    for name, param in model.named_parameters():
        if param._backward_hooks or getattr(param, "_post_accumulate_grad_hooks", None):
            found.append(name)
    return found
