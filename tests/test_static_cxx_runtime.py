"""A compiler that links libstdc++ statically (issue 31): the mint succeeds and every load path runs the artifact.

The GPU machine's default ``CXX`` is a GCC that links libstdc++ into every
shared object it makes; torch's package loader crashes on such a ``.so``. Here
a compiler wrapper adds ``-static-libstdc++ -static-libgcc`` to g++, as that
compiler does, and one tiny model is minted with it (one real AOTInductor
compile, module fixture): parity at mint runs through the torch-free runner
(recorded as ``parity.runner``), and ``load(module)``, ``load(state_dict)`` and
``load_native`` all run the artifact and agree with eager. The C++-runtime test
itself is covered on committed real ELF fixtures by ``crates/tcg-core/tests/cxx_runtime.rs``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torch_compiled_graphs import Engine, GraphClassSpec, RuntimeCompatibility, _native, record_toolchain

from .conftest import refused_binding


class Tiny(nn.Module):
    """Linear -> tanh, of sizes no other test compiles (no compile cache to hit)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(31)
        self.lin = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def _static_cxx(bin_dir: Path) -> Path:
    """A ``g++`` that links the C++ runtime into what it makes (named g++: inductor
    recognises GCC by its name)."""
    gxx = shutil.which("g++")
    assert gxx is not None, "the real_aoti tests need g++"
    archive = subprocess.run([gxx, "-print-file-name=libstdc++.a"], capture_output=True, text=True, check=True)
    # A bare name back means the static archive is not installed: a missing prerequisite, not a pass.
    assert os.path.isabs(archive.stdout.strip()), f"no libstdc++.a for {gxx}: install libstdc++-dev"
    bin_dir.mkdir(parents=True, exist_ok=True)
    wrapper = bin_dir / "g++"
    # Only when it links, as such a GCC's specs do (g++ links even a precompiled
    # header when handed -static-libstdc++).
    wrapper.write_text(
        "#!/bin/sh\n"
        f'for a in "$@"; do case "$a" in -c|-S|-E|c++-header) exec {gxx} "$@";; esac; done\n'
        f'exec {gxx} "$@" -static-libstdc++ -static-libgcc\n'
    )
    wrapper.chmod(0o755)
    return wrapper


@pytest.fixture(scope="module")
def minted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import torch._inductor.config as inductor_config

    root = tmp_path_factory.mktemp("static-cxx")
    wrapper = _static_cxx(root / "bin")
    model = Tiny().eval()
    program = torch.export.export(model, (torch.randn(2, 6, generator=torch.Generator().manual_seed(3)),))
    spec = GraphClassSpec("mint/static-cxx", "static-cxx-tests", program)
    # As a machine whose default CXX links statically: inductor reads $CXX into its
    # config when imported, so both are set. The config through its own patch: a
    # monkeypatch of a config proxy is undone by a delattr, which hides `cpp.cxx` from
    # every later compile of the process ("torch._inductor.config.cpp.cxx does not exist").
    with pytest.MonkeyPatch.context() as mp, inductor_config.patch({"cpp.cxx": (None, str(wrapper))}):
        mp.setenv("CXX", str(wrapper))
        toolchain = record_toolchain()
        key = str(RuntimeCompatibility("cpu", toolchain=toolchain).key(spec.declare()))
        result = Engine(root / "store").ensure(
            key, root / "graph", target="cpu", toolchain=toolchain, recipe=lambda: spec
        )
    return {"root": root, "model": model, "result": result}


@pytest.mark.real_aoti
def test_a_static_runtime_compiler_mints_with_parity_through_the_native_runner(minted: dict[str, Any]) -> None:
    result = minted["result"]
    assert result.outcome == "minted"
    graph = result.compiled_graph
    package = str(graph.package_path)
    own = _native.package_own_cxx_runtime(package, graph.graph_class)
    assert "__cxa_throw" in own or "__gxx_personality_v0" in own, own
    refused_binding("run.loader_unsupported", _native.package_check_torch_loader, package, graph.graph_class)
    parity = graph.mint_record["parity"]
    assert parity["status"] == "passed" and parity["runner"] == "native"


@pytest.mark.real_aoti
def test_every_load_path_runs_a_package_that_carries_its_own_runtime(minted: dict[str, Any], tmp_path: Path) -> None:
    import numpy as np
    from safetensors.torch import save_file

    graph = minted["result"].compiled_graph
    model = minted["model"]
    x = torch.randn(2, 6)
    with torch.no_grad():
        want = model(x)

    loaded = graph.load(model)
    assert loaded.runner == "native"
    torch.testing.assert_close(loaded(x), want)
    # The module's tensors are bound in place, as with torch's loader (docs/run.md,
    # "Weights once"): an in-place change is seen by the next call, and a rebind keeps it.
    assert loaded.copied_constants == []
    with torch.no_grad():
        model.lin.bias.add_(1.0)
        moved = model(x)
    torch.testing.assert_close(loaded(x), moved)
    loaded.rebind(model)
    torch.testing.assert_close(loaded(x), moved)

    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.testing.assert_close(graph.load(state)(x), moved)

    weights = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, weights)
    torch.testing.assert_close(graph.load(weights)(x), moved)
    native = graph.load_native(weights)
    np.testing.assert_allclose(np.asarray(native(x.numpy())), moved.numpy(), rtol=1.3e-6, atol=1e-5)

    refused_binding("run.constant_missing", graph.load, {"lin.weight": state["lin.weight"]})
