"""load_native picks its runtime from the artifact (issue 34, item 3; docs/run.md,
"Runtime"): a CPU package whose ``.so`` imports only shim set v1 runs on
``libtcg_shim.so`` (carried inside the extension) in a process without libtorch,
every other one on libtorch, and the choice says why.

The libtorch-free package is a real mint of the variant ``shim-v1``: the
engine's own ensure (key, compile, the variant's import check, parity at mint,
verified artifact); the graph is elementwise ops and a reduction, whose CPU
kernels import nothing outside the shim.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from .conftest import REFERENCE_WEIGHTS, ROOT, refused_binding


@pytest.fixture(scope="module")
def shim_minted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A graph minted with ``link_libtorch=False`` into a store, its weights file, an
    input and eager's outputs (computed here, in the parent)."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from torch_compiled_graphs import Engine, GraphClassSpec, RuntimeCompatibility, record_toolchain

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.linspace(-1, 1, 16))

        def forward(self, x: Any) -> Any:
            a = (x * self.w).sum(dim=1, keepdim=True) + torch.relu(x) * x
            b = x.t().contiguous() * 3
            c = (x * 2).t()  # a strided (transposed) output
            return a, b, c

    root = tmp_path_factory.mktemp("native-shim")
    model = Model().eval()
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(root / "w.safetensors"))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = [t.contiguous().numpy() for t in model(x)]
    # The libtorch-free variant (docs/keys.md, "Variants"): its mint judges the
    # .so's imports against shim set v1 and its parity run opens the package with
    # torch's loader, which exposes libtorch's shim for it.
    toolchain = record_toolchain(variant="shim-v1")
    spec = GraphClassSpec("tests/native-shim-elementwise", "serve", torch.export.export(model, (x,)))
    key = RuntimeCompatibility("cpu", toolchain=toolchain).key(spec.declare())
    result = Engine(root / "store").ensure(
        key, root / "graph", target="cpu", toolchain=toolchain, recipe=lambda: spec, variant="shim-v1"
    )
    np.save(root / "x.npy", x.numpy())
    stored = result.compiled_graph
    return {
        "root": root,
        "key": key,
        "stored": stored,
        "weights": root / "w.safetensors",
        "x": x.numpy(),
        "eager": eager,
    }


# Run in a fresh interpreter that never imports torch: resolve, load_native, call,
# then read this process's maps; then import torch, run the same package through
# load() (torch's own AOTInductor loader) and the shim graph again (both runtimes in one
# process, each package bound to its own).
CHILD = r"""
import ctypes, json, sys
import numpy as np
from torch_compiled_graphs import Engine, _native

root, key = sys.argv[1], sys.argv[2]
stored = Engine(root + "/store").resolve(key, root + "/child-graph")
native = stored.load_native(root + "/w.safetensors")
x = np.load(root + "/x.npy")
outs = [np.ascontiguousarray(np.asarray(o)).tolist() for o in native(x)]
maps = open("/proc/self/maps").read()
report = {
    "runtime": native.runtime,
    "reason": native.runtime_reason,
    "timings": sorted(native.timings),
    "torch_check": native.torch_check,
    "outputs": outs,
    "torch_imported": "torch" in sys.modules,
    "libtorch_mapped": _native.libtorch_mapped(),
    "libtorch_in_maps": any(n in maps for n in ("libtorch_cpu.so", "libc10.so")),
    "shim_in_maps": "libtcg_shim.so" in maps,
    # The shim is not in the global scope, where a later libtorch would find it.
    "shim_global": hasattr(ctypes.CDLL(None), "aoti_torch_empty_strided"),
}
import torch
torch_graph = stored.load(root + "/w.safetensors")
report["torch_loader_outputs"] = [o.contiguous().tolist() for o in torch_graph(torch.from_numpy(x))]
report["after_torch_outputs"] = [np.ascontiguousarray(np.asarray(o)).tolist() for o in native(x)]
report["libtorch_mapped_after"] = _native.libtorch_mapped()
print(json.dumps(report))
"""


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TORCH_COMPILED_GRAPHS_RUNTIME", None)
    python_dir = str(ROOT / "python")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (python_dir, env.get("PYTHONPATH")) if p)
    return env


def _child_report(code: str, *args: str) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter (no torch unless it imports it) and
    return the JSON report of its last line; it must exit 0."""
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=_child_env(),
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def _close(got: Any, want: np.ndarray) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=np.float32).reshape(want.shape), want, rtol=1e-5, atol=1e-6)


@pytest.mark.real_aoti
def test_a_covered_package_runs_on_the_shim_in_a_process_without_libtorch(shim_minted: dict[str, Any]) -> None:
    stored = shim_minted["stored"]
    imports = stored.shim_imports
    assert imports["other"] == [] and imports["aoti_torch"], imports
    report = _child_report(CHILD, str(shim_minted["root"]), shim_minted["key"])
    assert report["runtime"] == "shim-v1"
    assert report["reason"] == f"every import ({len(imports['aoti_torch'])} aoti_torch_*) in shim set v1"
    assert report["torch_check"] == "not needed (shim runtime)"
    assert "choose_runtime" in report["timings"] and "read_weights" in report["timings"]
    assert not report["torch_imported"]
    assert not report["libtorch_mapped"] and not report["libtorch_in_maps"]
    assert report["shim_in_maps"] and not report["shim_global"]
    for got, want in zip(report["outputs"], shim_minted["eager"], strict=True):
        _close(got, want)
    # torch imported afterwards: its loader runs the same package on libtorch, the
    # shim graph keeps running on the shim, and both still agree with eager.
    assert report["libtorch_mapped_after"]
    for outs in (report["torch_loader_outputs"], report["after_torch_outputs"]):
        for got, want in zip(outs, shim_minted["eager"], strict=True):
            _close(got, want)


# The runtime choice for CUDA in a process without libtorch: the covered package
# goes to the shim only where a CUDA runtime is found for it.
CUDA_CHOICE_CHILD = r"""
import json, os, sys
from torch_compiled_graphs import Engine, _native

root, key = sys.argv[1], sys.argv[2]
stored = Engine(root + "/store").resolve(key, root + "/choice-graph")
package, entry = os.fspath(stored.package_path), stored.graph_class
report = {}
os.environ["TORCH_COMPILED_GRAPHS_CUDART"] = os.path.join(root, "no-such-dir", "libcudart.so.13")
report["missing"] = _native.choose_runtime(package, entry, "cuda:0", "auto")
fake = os.path.join(root, "fake-cudart", "libcudart.so.13")
os.makedirs(os.path.dirname(fake), exist_ok=True)
open(fake, "wb").close()
os.environ["TORCH_COMPILED_GRAPHS_CUDART"] = fake
report["named"] = _native.choose_runtime(package, entry, "cuda:0", "auto")
report["libtorch"] = _native.choose_runtime(package, entry, "cuda:0", "libtorch")
print(json.dumps(report))
"""


@pytest.mark.real_aoti
def test_on_cuda_a_covered_package_goes_to_the_shim_where_a_cuda_runtime_is_found(
    shim_minted: dict[str, Any],
) -> None:
    n = len(shim_minted["stored"].shim_imports["aoti_torch"])
    report = _child_report(CUDA_CHOICE_CHILD, str(shim_minted["root"]), shim_minted["key"])
    assert report["missing"] == [
        "libtorch",
        "no CUDA runtime (libcudart.so.N) found for the shim: see TORCH_COMPILED_GRAPHS_CUDART",
    ]
    assert report["named"] == ["shim-v1", f"every import ({n} aoti_torch_*) in shim set v1"]
    assert report["libtorch"] == ["libtorch", "forced by option"]


@pytest.mark.real_aoti
def test_the_same_package_runs_on_libtorch_where_torch_is_loaded_and_on_the_shim_when_forced(
    shim_minted: dict[str, Any],
) -> None:
    from torch_compiled_graphs import _native

    # This process imported torch (the fixture minted with it).
    assert _native.libtorch_mapped()
    stored, weights, x = shim_minted["stored"], shim_minted["weights"], shim_minted["x"]
    on_torch = stored.load_native(weights)
    assert (on_torch.runtime, on_torch.runtime_reason) == ("libtorch", "libtorch already loaded in this process")
    assert on_torch.torch_check == "record digest"
    forced = stored.load_native(weights, runtime="shim")
    assert (forced.runtime, forced.runtime_reason) == ("shim-v1", "forced by option")
    for native in (on_torch, forced):
        for got, want in zip(native(x), shim_minted["eager"], strict=True):
            _close(np.asarray(got), want)


def test_the_reference_package_runs_on_libtorch_naming_addmm_and_a_forced_shim_is_refused(
    graph: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCH_COMPILED_GRAPHS_RUNTIME", raising=False)
    native = graph.load_native(REFERENCE_WEIGHTS)
    assert native.runtime == "libtorch"
    assert native.runtime_reason == "imports outside shim set v1: aoti_torch_cpu_addmm_out"
    err = refused_binding("run.native_unsupported", graph.load_native, REFERENCE_WEIGHTS, runtime="shim")
    assert "forced by option" in str(err) and str(err).endswith("aoti_torch_cpu_addmm_out"), str(err)
    monkeypatch.setenv("TORCH_COMPILED_GRAPHS_RUNTIME", "shim")
    err = refused_binding("run.native_unsupported", graph.load_native, REFERENCE_WEIGHTS)
    assert "forced by TORCH_COMPILED_GRAPHS_RUNTIME" in str(err), str(err)
    # The option wins over the environment.
    assert graph.load_native(REFERENCE_WEIGHTS, runtime="libtorch").runtime_reason == "forced by option"
    monkeypatch.setenv("TORCH_COMPILED_GRAPHS_RUNTIME", "torch")
    refused_binding("run.option_invalid", graph.load_native, REFERENCE_WEIGHTS)
    monkeypatch.delenv("TORCH_COMPILED_GRAPHS_RUNTIME")
    refused_binding("run.option_invalid", graph.load_native, REFERENCE_WEIGHTS, runtime="shim-v1")


def test_a_cuda_device_follows_the_imports_as_the_cpu_does(graph: Any) -> None:
    from torch_compiled_graphs import _native

    package = os.fspath(graph.package_path)
    # The reference package's GEMM keeps it on libtorch under auto, on CUDA as on the CPU.
    assert _native.choose_runtime(package, graph.graph_class, "cuda:0", "auto") == (
        "libtorch",
        "imports outside shim set v1: aoti_torch_cpu_addmm_out",
    )
    with pytest.raises(Exception) as e:
        _native.choose_runtime(package, graph.graph_class, "cuda:0", "shim")
    assert getattr(e.value, "code", None) == "run.native_unsupported", str(e.value)
    assert "aoti_torch_cpu_addmm_out" in str(e.value)


# An embedding lookup: inductor's CPU kernel checks each index against the table
# through AOTI_TORCH_CHECK, so the package imports aoti_torch_check, whose failure
# the shim raises as a C++ exception for the container to catch.
CHECK_CHILD = r"""
import json, sys
import numpy as np
from torch_compiled_graphs import Engine
from torch_compiled_graphs.errors import BindingError

root, key = sys.argv[1], sys.argv[2]
native = Engine(root + "/store").resolve(key, root + "/child-graph").load_native(root + "/w.safetensors")
idx = np.load(root + "/idx.npy")
report = {"runtime": native.runtime, "ok": np.asarray(native(idx)).tolist()}
bad = idx.copy()
bad[1] = 99
try:
    native(bad)
    report["bad"] = None
except BindingError as exc:
    report["bad"] = [exc.code, str(exc)]
report["after"] = np.asarray(native(idx)).tolist()
print(json.dumps(report))
"""


@pytest.mark.real_aoti
def test_a_failed_index_check_on_the_shim_is_a_typed_error_and_the_graph_keeps_serving(
    tmp_path: Any,
) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from torch_compiled_graphs import Engine, GraphClassSpec, RuntimeCompatibility, record_toolchain

    class Lookup(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.arange(32, dtype=torch.float32).reshape(8, 4))

        def forward(self, idx: Any) -> Any:
            return torch.nn.functional.embedding(idx, self.table) * 2

    model = Lookup().eval()
    save_file({"table": model.table.detach().contiguous()}, str(tmp_path / "w.safetensors"))
    idx = torch.tensor([3, 0, 7, 5], dtype=torch.int64)
    np.save(tmp_path / "idx.npy", idx.numpy())
    with torch.no_grad():
        eager = model(idx).numpy()
    toolchain = record_toolchain(variant="shim-v1")
    spec = GraphClassSpec("tests/native-shim-lookup", "serve", torch.export.export(model, (idx,)))
    key = RuntimeCompatibility("cpu", toolchain=toolchain).key(spec.declare())
    stored = (
        Engine(tmp_path / "store")
        .ensure(key, tmp_path / "graph", target="cpu", toolchain=toolchain, recipe=lambda: spec, variant="shim-v1")
        .compiled_graph
    )
    assert "aoti_torch_check" in stored.shim_imports["aoti_torch"], stored.shim_imports
    report = _child_report(CHECK_CHILD, str(tmp_path), key)
    assert report["runtime"] == "shim-v1"
    assert np.array_equal(np.asarray(report["ok"], dtype=np.float32), eager)
    assert report["bad"] is not None and report["bad"][0] == "run.execution_failed", report["bad"]
    assert np.array_equal(np.asarray(report["after"], dtype=np.float32), eager)
