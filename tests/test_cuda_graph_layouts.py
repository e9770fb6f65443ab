"""Replays of graphs whose outputs are not C-contiguous (docs/run.md, "CUDA graphs").

A compiled graph returns each output with the strides the exported program gave
it: a transposed view, a slice that leaves gaps, an expanded column (stride 0), a
permuted reshape (what an attention block's output is before the residual add, and
so every channels-last activation after it). A replayed call hands back a copy of
the capture's output buffers; that copy is the output only if it keeps the layout.
Each captured call is compared, values and strides, with the same graph loaded with
``cuda_graphs=False``: on ``load()`` here, and on ``load_native`` in a process
without torch (its captures go through ``tcg_run::capture``, where a copy that
dropped the strides once returned the VAE decoder's outputs in another order).

Needs a CUDA device; skipped without one. ``scripts/cuda_e2e.py`` runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_compiled_graphs import Engine, GraphClassSpec, RuntimeCompatibility, record_toolchain
from torch_compiled_graphs.capture import ENV_CUDA_GRAPHS, WARMUP_RUNS

from .test_cuda import device_sm

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class Layouts(torch.nn.Module):
    """Four outputs, none C-contiguous, over a dynamic batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 48)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = torch.tanh(self.lin(x))
        heads = (y * 2.0).view(-1, 6, 8).transpose(1, 2)  # [B, 8, 6], permuted
        return y.t(), y[:, ::2], y[:, :1].expand(-1, 5), heads


@pytest.fixture(scope="module")
def minted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """One real CUDA mint: the resolved graph and its store."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("cuda-layouts")
    net = Layouts().cuda().eval()
    x = torch.randn(8, 64, device="cuda")
    program = torch.export.export(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},))
    spec = GraphClassSpec("cuda/layouts", "cuda-tests", program)
    toolchain = record_toolchain()
    key = RuntimeCompatibility(device_sm(), toolchain=toolchain).key(spec.declare())
    result = Engine(root / "store").ensure(
        key, root / "graph", target=device_sm(), toolchain=toolchain, recipe=lambda: spec
    )
    torch.save(net.state_dict(), root / "net.pt")
    return result.compiled_graph, root


def x_of(batch: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed * 1000 + batch)
    return torch.randn(batch, 64, device="cuda", generator=g)


@pytest.mark.real_aoti
def test_load_replays_keep_each_outputs_layout(minted: tuple[Any, Path]) -> None:
    graph, root = minted
    net = Layouts().cuda().eval()
    net.load_state_dict(torch.load(root / "net.pt"))
    on = graph.load(net, cuda_graphs=True)
    off = graph.load(net, cuda_graphs=False)
    with torch.no_grad():
        eager = net(x_of(3))
    assert [t.is_contiguous() for t in eager] == [False] * 4
    for batch in (1, 3, 8):
        for i in range(WARMUP_RUNS + 3):
            got, want = on(x_of(batch, i)), off(x_of(batch, i))
            for a, b in zip(got, want, strict=True):
                assert a.stride() == b.stride(), (batch, i)
                assert torch.equal(a, b), (batch, i)
    assert on.stats["captures"] == 3 and on.stats["replays"] == 3 * 3


NATIVE_CHILD = r"""
import json, sys
import numpy as np
from torch_compiled_graphs import Engine

store, key, dest, weights = sys.argv[1:5]
g = Engine(store).resolve(key, dest)
on = g.load_native(weights, device="cuda:0")
off = g.load_native(weights, device="cuda:0", cuda_graphs=False)
out = {"reason": on.cuda_graphs_reason, "wrong": [], "strides": {}}
for batch in (1, 3, 8):
    for i in range(2 + 3):
        x = np.random.default_rng(batch * 100 + i).standard_normal((batch, 64), dtype=np.float32)
        got, want = on(x), off(x)
        for n, (a, b) in enumerate(zip(got, want)):
            out["strides"][f"{batch}/{n}"] = [list(a.strides), list(b.strides)]
            if list(a.strides) != list(b.strides) or not np.array_equal(np.asarray(a.cpu()), np.asarray(b.cpu())):
                out["wrong"].append([batch, i, n])
out["stats"] = on.stats
print(json.dumps(out))
"""


@pytest.mark.real_aoti
def test_load_native_replays_keep_each_outputs_layout(minted: tuple[Any, Path], tmp_path: Path) -> None:
    from safetensors.torch import save_file

    graph, root = minted
    weights = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in torch.load(root / "net.pt").items()}, str(weights))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    env.pop(ENV_CUDA_GRAPHS, None)
    argv = [sys.executable, "-c", NATIVE_CHILD, str(root / "store"), graph.key, str(tmp_path / "g"), str(weights)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["reason"] is None, got
    assert got["wrong"] == [], got
    # The layouts are the program's: a transposed [48, B] view has a unit row stride.
    assert got["strides"]["3/0"][1] == [4, 48 * 4], got["strides"]
    assert got["stats"]["captures"] == 3 and got["stats"]["replays"] == 3 * 3, got["stats"]
