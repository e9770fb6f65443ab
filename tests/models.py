"""Small shared test models (import torch only where used: these tests need torch)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Sine(nn.Module):
    """The SPEC §3.7 fixture: ``forward(x) = x.sin()``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sin()


class Cosine(nn.Module):
    """Sine with a different op: a different witness."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.cos()


class MLP(nn.Module):
    """The reference 0.2.0 interop model: Linear(16,32) -> ReLU -> Linear(32,8) (fqns l1.*, l2.*)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 32)
        self.relu = nn.ReLU()
        self.l2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.relu(self.l1(x)))


class SwapModel(nn.Module):
    """The weight-swap graph (SPEC §13.3).

    ``linear`` holds ordinary parameters, ``scale`` is a rank-0 parameter and
    ``shift`` a short 1-D buffer (both inlinable by inductor unless fenced),
    ``offset`` an ordinary buffer. The pointwise tail vectorises on x86-64.
    """

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 32)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.register_buffer("shift", torch.zeros(4))
        self.register_buffer("offset", torch.linspace(-1.0, 1.0, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.linear(x)) * self.scale + self.offset
        return y.reshape(y.shape[0], 8, 4) + self.shift


def swap_weights(seed: int) -> dict[str, torch.Tensor]:
    """A full state dict for :class:`SwapModel`; seed 0 keeps A's uniform ``shift`` (zeros)."""
    g = torch.Generator().manual_seed(seed)
    state = {
        "linear.weight": torch.randn(32, 16, generator=g),
        "linear.bias": torch.randn(32, generator=g),
        "scale": torch.tensor(1.5) if seed == 0 else torch.randn((), generator=g),
        "shift": torch.zeros(4) if seed == 0 else torch.randn(4, generator=g),
        "offset": torch.linspace(-1.0, 1.0, 32) if seed == 0 else torch.randn(32, generator=g),
    }
    return state


class WithLiteral(nn.Module):
    """A plain tensor attribute used in forward: export lifts it as a literal constant."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.tensor([[1.0, 2.0], [3.0, 4.0]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.table


class Pair(nn.Module):
    """Two inputs, one passed by keyword: an ingress with two parameters."""

    def forward(self, x: torch.Tensor, *, y: torch.Tensor) -> Any:
        return x + y
