"""CUDA artifacts end to end (``sm_NN`` targets): mint, verification of the CUDA
package (cubins, host code, constants), restart reuse without torch on the hit
path, weights bound on the GPU and swapped, and the refusals.

Every test here needs a CUDA device and is skipped without one; the device
machine runs them through ``scripts/cuda_e2e.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.dlpack import from_dlpack

from torch_compiled_graphs import Engine, EnsureOutcome, GraphClassSpec, RuntimeCompatibility, record_toolchain
from torch_compiled_graphs import artifact as art
from torch_compiled_graphs.errors import ArtifactError, BindingError, DeclarationError

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

EM_CUDA = 190
EM_X86_64 = 62


def device_sm() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


class Net(torch.nn.Module):
    """A small graph with parameters, a buffer and a dynamic batch."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(64, 128)
        self.l2 = torch.nn.Linear(128, 64)
        self.register_buffer("shift", torch.linspace(-1.0, 1.0, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.l2(torch.relu(self.l1(x))) + self.shift
        return out


def spec_of(net: torch.nn.Module, name: str = "cuda/net") -> GraphClassSpec:
    x = torch.randn(8, 64, device="cuda")
    program = torch.export.export(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},))
    return GraphClassSpec(name, "cuda-tests", program)


def cuda_weights(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def elf_members(package: Path) -> list[dict[str, Any]]:
    """Every ELF member of a ``.pt2``: name, ``e_machine``, ``e_flags``, ELF ABI version."""
    out = []
    with zipfile.ZipFile(package) as z:
        for name in z.namelist():
            data = z.read(name)
            if data[:4] == b"\x7fELF":
                out.append(
                    {
                        "name": name,
                        "e_machine": int.from_bytes(data[0x12:0x14], "little"),
                        "e_flags": int.from_bytes(data[0x30:0x34], "little"),
                        "abi_version": data[8],
                    }
                )
    return out


@pytest.fixture(scope="module")
def minted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One real CUDA mint per module: the engine, key, resolved graph and the eager model."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("cuda")
    net = Net().cuda().eval()
    spec = spec_of(net)
    toolchain = record_toolchain()
    runtime = RuntimeCompatibility(device_sm(), toolchain=toolchain)
    key = runtime.key(spec.declare())
    engine = Engine(root / "store")
    calls: list[int] = []

    def recipe() -> GraphClassSpec:
        calls.append(1)
        return spec

    result = engine.ensure(key, root / "graph", target=device_sm(), toolchain=toolchain, recipe=recipe)
    return {
        "root": root,
        "engine": engine,
        "key": key,
        "result": result,
        "calls": calls,
        "net": net,
        "runtime": runtime,
        "toolchain": toolchain,
    }


# ----------------------------------------------------------------- target and mint


def test_the_target_must_match_the_visible_device() -> None:
    toolchain = {"torch": "record-digest"}
    assert RuntimeCompatibility(device_sm(), toolchain=toolchain).sm == device_sm()
    other = "sm_80" if device_sm() != "sm_80" else "sm_90"
    with pytest.raises(DeclarationError) as e:
        RuntimeCompatibility(other, toolchain=toolchain)
    assert e.value.code == "declaration.device_mismatch"


@pytest.mark.real_aoti
def test_a_cuda_mint_is_code_only_with_cubins_for_the_target(minted: dict[str, Any]) -> None:
    result = minted["result"]
    assert result.outcome is EnsureOutcome.MINTED and minted["calls"] == [1]
    graph = result.graph
    meta = graph.metadata
    assert meta["sm"] == device_sm() == minted["runtime"].sm
    assert meta["package_constants_in_so"] is False and meta["constant_folding_fenced"] is True
    assert meta["host_isa"] == minted["runtime"].host_isa  # the clamp applies to the host code of CUDA packages too
    elves = elf_members(graph.package_path)
    cubins = [e for e in elves if e["name"].endswith(".cubin")]
    shared = [e for e in elves if e["name"].endswith(".so")]
    assert cubins, "a CUDA package carries its kernels as cubin members"
    print("ELF members:", json.dumps(elves))  # shown by cuda_e2e's -rA report
    want = int(device_sm().removeprefix("sm_").rstrip("a"))
    for cubin in cubins:
        assert cubin["e_machine"] == EM_CUDA
        sm = cubin["e_flags"] & 0xFF if cubin["abi_version"] < 8 else (cubin["e_flags"] >> 8) & 0xFF
        assert sm == want, cubin
    assert len(shared) == 1 and shared[0]["e_machine"] == EM_X86_64
    # No weights travel: the package holds no constant payload, the table names every weight.
    with zipfile.ZipFile(graph.package_path) as z:
        assert not [n for n in z.namelist() if n.endswith((".bin", ".pt", ".safetensors"))]
    assert sorted(row["fqn"] for row in graph.constants) == sorted(minted["net"].state_dict())
    # Placement: a single-device graph declares none (SPEC-v1 §3.6 rule 9).
    assert meta["graph_class"]["placement"] == []


@pytest.mark.real_aoti
def test_the_exported_cuda_artifact_verifies_and_admits(minted: dict[str, Any]) -> None:
    out = minted["root"] / "export.tar.gz"
    minted["engine"].export_artifact(minted["key"], out)
    report = art.verify(out, host=True)
    assert report["metadata"]["sm"] == device_sm()


@pytest.mark.real_aoti
def test_a_cubin_for_another_architecture_is_refused(minted: dict[str, Any], tmp_path: Path) -> None:
    graph = minted["result"].graph
    tampered = tmp_path / "model.pt2"
    with zipfile.ZipFile(graph.package_path) as src, zipfile.ZipFile(tampered, "w", zipfile.ZIP_STORED) as dst:
        done = False
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith(".cubin") and not done:
                flags = int.from_bytes(data[0x30:0x34], "little")
                if data[8] < 8:
                    flags = (flags & ~0xFF) | 80
                else:
                    flags = (flags & ~0xFF00) | (80 << 8)
                data = data[:0x30] + flags.to_bytes(4, "little") + data[0x34:]
                done = True
            dst.writestr(info, data)
    assert done
    with pytest.raises(ArtifactError) as e:
        art.pack(tampered, graph.metadata, tmp_path / "out.tar.gz")
    assert e.value.code == "artifact.cubin_arch_mismatch"
    assert not (tmp_path / "out.tar.gz").exists()


# ----------------------------------------------------------------- reuse


REUSE = """
import json, sys
from torch_compiled_graphs import Engine
graph = Engine(sys.argv[1]).resolve(sys.argv[2], sys.argv[3])
torch_free = "torch" not in sys.modules
import torch
from safetensors.torch import load_file
loaded = graph.load(load_file(sys.argv[4], device="cuda"))
x = load_file(sys.argv[5])["x"].cuda()
y = loaded(x)
print(json.dumps({"torch_free": torch_free, "y": y.cpu().tolist()}))
"""


@pytest.mark.real_aoti
def test_a_fresh_process_resolves_without_torch_and_runs_on_the_gpu(minted: dict[str, Any], tmp_path: Path) -> None:
    from safetensors.torch import save_file

    net = minted["net"]
    save_file({k: v.cpu().contiguous() for k, v in net.state_dict().items()}, tmp_path / "w.safetensors")
    x = torch.randn(5, 64)
    save_file({"x": x}, tmp_path / "x.safetensors")
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(REUSE),
            str(minted["root"] / "store"),
            str(minted["key"]),
            str(tmp_path / "g"),
            str(tmp_path / "w.safetensors"),
            str(tmp_path / "x.safetensors"),
        ],
        capture_output=True,
        text=True,
    )
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["torch_free"] is True
    with torch.no_grad():
        expected = net(x.cuda()).cpu()
    torch.testing.assert_close(torch.tensor(report["y"]), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.real_aoti
def test_a_second_ensure_reuses_without_compiling(minted: dict[str, Any]) -> None:
    calls: list[int] = []
    again = minted["engine"].ensure(
        minted["key"],
        minted["root"] / "graph-again",
        target=device_sm(),
        toolchain=minted["toolchain"],
        recipe=lambda: calls.append(1),
    )
    assert again.outcome is EnsureOutcome.REUSED and calls == []


# ----------------------------------------------------------------- weights on the GPU


@pytest.mark.real_aoti
def test_cuda_weights_bind_and_swap(minted: dict[str, Any]) -> None:
    net = minted["net"]
    graph = minted["result"].graph
    loaded = graph.load(cuda_weights(net))
    assert loaded.device == torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(7, 64, device="cuda")
    with torch.no_grad():
        before = net(x)
    torch.testing.assert_close(loaded(x), before, rtol=1e-4, atol=1e-4)
    # An out-of-place weight change (new tensors, as an optimizer step or a LoRA merge gives).
    other = Net().cuda().eval()
    loaded.rebind(cuda_weights(other))
    with torch.no_grad():
        after = other(x)
    got = loaded(x)
    torch.testing.assert_close(got, after, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got, before)


@pytest.mark.real_aoti
def test_cuda_binding_refusals(minted: dict[str, Any]) -> None:
    graph = minted["result"].graph
    weights = cuda_weights(minted["net"])

    def refused(code: str, **kwargs: Any) -> None:
        with pytest.raises(BindingError) as e:
            graph.load(kwargs.pop("weights", weights), **kwargs)
        assert e.value.code == code, e.value

    refused("run.device_mismatch", weights={k: v.cpu() for k, v in weights.items()})
    refused("run.device_mismatch", device="cpu")
    refused("run.constant_missing", weights={k: v for k, v in weights.items() if k != "shift"})
    refused("run.constant_unexpected", weights={**weights, "extra": torch.zeros(1, device="cuda")})
    refused("run.constant_mismatch", weights={**weights, "shift": weights["shift"].half()})
    refused("run.constant_mismatch", weights={**weights, "shift": torch.zeros(65, device="cuda")})
    loaded = graph.load(weights)
    with pytest.raises(BindingError) as e:
        loaded.rebind({k: v.cpu() for k, v in weights.items()})
    assert e.value.code == "run.device_mismatch"
    # The refused rebind left the bound weights in place.
    x = torch.randn(3, 64, device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), minted["net"](x), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------- placement


class TwoDevices(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2).cpu() + 1


def test_a_graph_spanning_two_devices_declares_its_placement() -> None:
    x = torch.randn(4, device="cuda")
    program = torch.export.export(TwoDevices(), (x,))
    declaration = GraphClassSpec("cuda/two", "cuda-tests", program).declare()
    assert list(declaration.placement) == ["cpu", "cuda:0"]


# ----------------------------------------------------------------- the torch-free path on the GPU


def save_weights(net: torch.nn.Module, path: Path) -> Path:
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}, path)
    return path


def dev() -> str:
    return f"cuda:{torch.cuda.current_device()}"


@pytest.mark.real_aoti
def test_load_native_runs_on_the_gpu_with_dlpack_in_and_out(minted: dict[str, Any], tmp_path: Path) -> None:
    import numpy as np

    from torch_compiled_graphs.native import from_buffer

    net, graph = minted["net"], minted["result"].graph
    native = graph.load_native(save_weights(net, tmp_path / "w.safetensors"), device=dev())
    assert native.device == dev() and native.stream == 0
    x = torch.randn(7, 64, device="cuda")
    with torch.no_grad():
        expected = net(x)
    out = native(x)  # a CUDA torch tensor in through DLPack
    assert (out.device, out.dtype, out.shape) == (dev(), "float32", (7, 64))
    assert out.__dlpack_device__() == (2, torch.cuda.current_device())
    y = from_dlpack(out)  # zero-copy out: two imports alias the output's one buffer
    assert y.device == x.device and y.data_ptr() == from_dlpack(out).data_ptr()
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
    # Versioned capsules too, and the exported tensor outlives the output object.
    z = from_dlpack(out.__dlpack__(max_version=(1, 0)))
    del out
    torch.testing.assert_close(z, expected, rtol=1e-4, atol=1e-4)
    # Host inputs (numpy, a CPU torch tensor) are copied to the GPU; host outputs come back by cpu().
    host = x.cpu().numpy()
    got = native(host)
    assert got.device == dev()
    np.testing.assert_allclose(np.asarray(got.cpu()), expected.cpu().numpy(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(from_dlpack(native(x.cpu())), expected, rtol=1e-4, atol=1e-4)
    # A tensor placed on the GPU once from raw bytes, reused across calls.
    placed = from_buffer(host, "float32", host.shape, device=dev())
    assert placed.device == dev()
    torch.testing.assert_close(from_dlpack(native(placed)), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.real_aoti
def test_load_native_on_a_side_stream_orders_inputs_and_outputs(minted: dict[str, Any], tmp_path: Path) -> None:
    net, graph = minted["net"], minted["result"].graph
    native = graph.load_native(save_weights(net, tmp_path / "w.safetensors"), device=dev())
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    native.stream = side.cuda_stream
    for _ in range(3):
        x = torch.randn(64, 64, device="cuda") * 3  # queued on the default stream
        out = native(x)  # the side stream waits for x (DLPack stream handshake)
        assert out.stream == side.cuda_stream
        y = from_dlpack(out)  # the current stream waits for the side stream
        with torch.no_grad():
            torch.testing.assert_close(y, net(x), rtol=1e-4, atol=1e-4)
    native.synchronize()
    native.stream = 0


@pytest.mark.real_aoti
def test_load_native_rebind_on_the_gpu_and_every_refusal(minted: dict[str, Any], tmp_path: Path) -> None:
    import copy

    import numpy as np
    from safetensors.torch import save_file

    from torch_compiled_graphs import StoredCompiledGraph

    net, graph = minted["net"], minted["result"].graph
    weights = save_weights(net, tmp_path / "w.safetensors")
    native = graph.load_native(weights, device=dev())
    x = torch.randn(5, 64, device="cuda")
    other = Net().cuda().eval()
    native.rebind(save_weights(other, tmp_path / "other.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(from_dlpack(native(x)), other(x), rtol=1e-4, atol=1e-4)
    state = {k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}

    def written(name: str, tensors: dict[str, torch.Tensor]) -> Path:
        save_file(tensors, tmp_path / name)
        return tmp_path / name

    def refused(code: str, call: Any, *args: Any, **kwargs: Any) -> None:
        with pytest.raises(BindingError) as e:
            call(*args, **kwargs)
        assert e.value.code == code, e.value

    missing = written("missing.safetensors", {k: v for k, v in state.items() if k != "shift"})
    extra = written("extra.safetensors", {**state, "extra": torch.zeros(1)})
    dtype = written("dtype.safetensors", {**state, "shift": state["shift"].half()})
    shape = written("shape.safetensors", {**state, "shift": torch.zeros(65)})
    for code, path in [
        ("run.constant_missing", missing),
        ("run.constant_unexpected", extra),
        ("run.constant_mismatch", dtype),
        ("run.constant_mismatch", shape),
    ]:
        refused(code, graph.load_native, path, device=dev())
        refused(code, native.rebind, path)
    # The refused rebinds left the other weights in place.
    with torch.no_grad():
        torch.testing.assert_close(from_dlpack(native(x)), other(x), rtol=1e-4, atol=1e-4)
    # Devices: the CPU, a device that does not exist, a capability that is not the artifact's.
    refused("run.device_mismatch", graph.load_native, weights, device="cpu")
    refused("run.device_mismatch", graph.load_native, weights, device=f"cuda:{torch.cuda.device_count()}")
    edited = copy.deepcopy(graph.metadata)
    edited["sm"] = "sm_80" if device_sm() != "sm_80" else "sm_90"
    restated = StoredCompiledGraph(graph.key, graph.path, edited, graph.manifest)
    refused("run.device_mismatch", restated.load_native, weights, device=dev())
    # Inputs, checked before the graph runs.
    refused("run.input_mismatch", native, x.double())
    refused("run.input_mismatch", native, torch.zeros(65, 64, device="cuda"))  # batch is at most 64
    refused("run.input_mismatch", native, torch.zeros(4, 63, device="cuda"))
    refused("run.input_layout", native, torch.zeros(64, 4, device="cuda").T)
    refused("run.input_mismatch", native, np.zeros((4, 64), np.float64))
    refused("run.call_invalid", native, x, x)


NATIVE_REUSE = """
import json, sys
import numpy as np
from torch_compiled_graphs import Engine
graph = Engine(sys.argv[1]).resolve(sys.argv[2], sys.argv[3])
native = graph.load_native(sys.argv[4], device="cuda:0")
x = np.load(sys.argv[5])
y = np.asarray(native(x).cpu())
print(json.dumps({"torch_free": "torch" not in sys.modules, "y": y.tolist(), "device": native.device}))
"""


@pytest.mark.real_aoti
def test_a_fresh_process_runs_the_gpu_graph_without_ever_importing_torch(
    minted: dict[str, Any], tmp_path: Path
) -> None:
    import numpy as np

    net = minted["net"]
    weights = save_weights(net, tmp_path / "w.safetensors")
    x = torch.randn(9, 64)
    np.save(tmp_path / "x.npy", x.numpy())
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(NATIVE_REUSE),
            str(minted["root"] / "store"),
            str(minted["key"]),
            str(tmp_path / "g"),
            str(weights),
            str(tmp_path / "x.npy"),
        ],
        capture_output=True,
        text=True,
    )
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["torch_free"] is True and report["device"] == "cuda:0"
    with torch.no_grad():
        expected = net(x.cuda()).cpu()
    torch.testing.assert_close(torch.tensor(report["y"]), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.real_aoti
def test_the_rust_serve_example_runs_the_gpu_graph(minted: dict[str, Any], tmp_path: Path) -> None:
    """The Rust serving path on the GPU: ``scripts/cuda_e2e.py`` passes the example
    binary built on the development machine (``--serve-bin``)."""
    import os

    from safetensors.torch import save_file

    binary = os.environ.get("TCG_SERVE_BIN")
    if not binary:
        pytest.skip("TCG_SERVE_BIN names no serve example binary (cuda_e2e.py --serve-bin sets it)")
    from torch_compiled_graphs.native import find_torch_lib

    net = minted["net"]
    weights = save_weights(net, tmp_path / "w.safetensors")
    x = torch.randn(6, 64)
    with torch.no_grad():
        y = net(x.cuda()).cpu()
    save_file({"x": x, "y": y}, tmp_path / "io.safetensors")
    base = [binary, "--store", str(minted["root"] / "store"), "--key", str(minted["key"])]
    base += ["--torch-lib", find_torch_lib(), "--weights", str(weights), "--io", str(tmp_path / "io.safetensors")]
    flags = ["--dest", str(tmp_path / "d"), "--in", "x", "--out", "y", "--device", "cuda:0", "--repeat", "50"]
    run = subprocess.run([*base, *flags, "--rtol", "1e-4", "--atol", "1e-4"], capture_output=True, text=True)
    print("serve example:", run.stdout, run.stderr)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["ok"] is True and report["device"] == "cuda:0" and report["calls"] == 50
    assert report["torch_check"] == "record digest"


# ----------------------------------------------------------------- weights too large for the device


class Wide(torch.nn.Module):
    """64 MiB of float32 weights: more than the room a filled device leaves."""

    def __init__(self) -> None:
        super().__init__()
        self.l = torch.nn.Linear(4096, 4096)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.l(x)
        return out


FILLED = """
import json, sys
import torch
from torch_compiled_graphs import Engine
from torch_compiled_graphs.errors import BindingError
graph = Engine(sys.argv[1]).resolve(sys.argv[2], sys.argv[3])
# Fill the device (1 GiB, then 64 MiB, then 2 MiB pieces) so that less than
# the weights' 64 MiB is left.
hold = []
for size in (1 << 30, 1 << 26, 1 << 21):
    while True:
        try:
            hold.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            break
out = {"free": torch.cuda.mem_get_info()[0]}
for name, call in [("load_native", graph.load_native), ("load", graph.load)]:
    try:
        call(sys.argv[4], device="cuda:0")
        out[name] = "loaded"
    except BindingError as e:
        out[name] = e.code
        out[name + "_message"] = str(e)
# With the room given back, the same weights load and run.
hold.clear()
torch.cuda.empty_cache()
native = graph.load_native(sys.argv[4], device="cuda:0")
x = torch.ones(2, 4096, device="cuda")
out["after"] = list(torch.from_dlpack(native(x)).shape)
print(json.dumps(out))
"""


@pytest.mark.real_aoti
def test_weights_too_large_for_the_device_are_refused_and_nothing_is_left_behind(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = Wide().cuda().eval()
    program = torch.export.export(net, (torch.randn(2, 4096, device="cuda"),))
    spec = GraphClassSpec("cuda/wide", "cuda-tests", program)
    toolchain = record_toolchain()
    key = RuntimeCompatibility(device_sm(), toolchain=toolchain).key(spec.declare())
    engine = Engine(tmp_path / "store")
    engine.ensure(key, tmp_path / "graph", target=device_sm(), toolchain=toolchain, recipe=lambda: spec)
    weights = save_weights(net, tmp_path / "w.safetensors")
    child = subprocess.run(
        [sys.executable, "-c", FILLED, str(tmp_path / "store"), str(key), str(tmp_path / "r"), str(weights)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["free"] < 64 << 20, report
    assert report["load_native"] == "run.weights_too_large", report
    assert report["load"] == "run.weights_too_large", report
    assert "cuda:0" in report["load_native_message"], report
    assert report["after"] == [2, 4096], report


@pytest.mark.real_aoti
def test_the_default_compilers_mint_runs_on_every_load_path(minted: dict[str, Any], tmp_path: Path) -> None:
    """Issue 31, with this machine's default CXX (a GCC that links libstdc++ statically on the
    GPU machine): the mint passed parity, through the torch-free runner when the .so carries its
    own C++ runtime, and load() (module tensors on the GPU, bound through the runner's
    caller-owned buffers), load() of a checkpoint and load_native all agree with eager."""
    from safetensors.torch import save_file

    from torch_compiled_graphs import _native

    graph = minted["result"].compiled_graph
    own = _native.package_own_cxx_runtime(str(graph.package_path), graph.graph_class)
    runner = "native" if own else "torch"
    assert graph.mint_record["parity"]["runner"] == runner
    net = minted["net"]
    x = torch.randn(5, 64, device="cuda")
    with torch.no_grad():
        want = net(x)
    loaded = graph.load(cuda_weights(net))
    assert loaded.runner == runner
    torch.testing.assert_close(loaded(x), want, rtol=1e-4, atol=1e-4)
    weights = tmp_path / "w.safetensors"
    save_file({k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}, weights)
    torch.testing.assert_close(graph.load(weights)(x), want, rtol=1e-4, atol=1e-4)
    native = graph.load_native(weights, device=f"cuda:{torch.cuda.current_device()}")
    torch.testing.assert_close(from_dlpack(native(x)), want, rtol=1e-4, atol=1e-4)
