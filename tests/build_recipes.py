"""Recipes of the build-farm tests: tiny 2-layer nets, one that kills its own cell process the
first time it runs in one (the marker file remembers), and a GPU-labelled one."""

from __future__ import annotations

import os
import signal
from typing import Any


def mlp(width: int, target: str, seed: int = 0) -> Any:
    """Linear(8, width) -> ReLU -> Linear(width, 4), exported on the CPU for a batch of 2."""
    import torch
    from torch import nn

    from torch_compiled_graphs import GraphClassSpec

    class Net(nn.Module):
        # Named layers: an nn.Sequential's "0.weight" is not a name the package keeps.
        def __init__(self) -> None:
            super().__init__()
            self.l1 = nn.Linear(8, width)
            self.l2 = nn.Linear(width, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.l2(torch.relu(self.l1(x)))

    torch.manual_seed(seed)
    model = Net().eval()
    program = torch.export.export(model, (torch.randn(2, 8),))
    return GraphClassSpec(f"build-tests/mlp-w{width}", target, program)


def killer(width: int, marker: str, target: str) -> Any:
    """:func:`mlp`, except that the first call inside a cell process SIGKILLs that process."""
    from torch_compiled_graphs.build import CELL_ENV

    if os.environ.get(CELL_ENV) is not None and not os.path.exists(marker):
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.fsync(fd)
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)
    return mlp(width, target, seed=1)


def broken(target: str) -> Any:
    """A recipe whose export fails (a deterministic failure)."""
    raise RuntimeError("export failed: this recipe is broken on purpose")
