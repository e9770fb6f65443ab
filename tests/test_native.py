"""The native load path (``StoredCompiledGraph.load_native``): the reference
artifact (with folded constants) run without torch, every refusal with its
code, rebind, and a real dynamic-batch graph with its call ingress."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from torch_compiled_graphs import Engine, StoredCompiledGraph
from torch_compiled_graphs.native import NativeGraph, find_torch_lib

from .conftest import REFERENCE, REFERENCE_KEY, ROOT
from .conftest import refused_binding as refused

FIXTURE = REFERENCE
KEY = REFERENCE_KEY
WEIGHTS = FIXTURE / "mlp-cpu.weights.safetensors"


def restated(graph: StoredCompiledGraph, metadata: dict[str, Any]) -> StoredCompiledGraph:
    """The same unpacked artifact described by edited metadata."""
    return StoredCompiledGraph(graph.key, graph.path, metadata, graph.manifest)


def weights_with(tmp_path: Path, **changes: np.ndarray | None) -> Path:
    tensors = load_file(WEIGHTS)
    for name, value in changes.items():
        name = name.replace("__", ".")
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    path = tmp_path / "weights.safetensors"
    save_file(tensors, path)
    return path


def test_the_reference_artifact_runs_natively_and_matches_its_expected_output(
    graph: StoredCompiledGraph, native: NativeGraph, io: dict[str, np.ndarray]
) -> None:
    assert any(row["source"] == "computed" for row in graph.constants)
    assert native.constant_fqns == ["l1.weight", "l2.weight", "l1.bias", "l2.bias"]
    out = native(io["x"])
    y = np.asarray(out)
    assert y.dtype == np.float32 and y.shape == (4, 8)
    np.testing.assert_allclose(y, io["y"], rtol=1e-5, atol=1e-6)
    # A zero-copy view: the array's memory is the output's, and the array keeps it alive.
    assert y.__array_interface__["data"][0] == out.__array_interface__["data"][0]
    del out
    np.testing.assert_allclose(y, io["y"], rtol=1e-5, atol=1e-6)
    # The same call through keywords-free positional args and a memoryview-backed buffer.
    x = bytearray(io["x"].tobytes())
    view = memoryview(x).cast("B").cast("f", shape=[4, 16])
    np.testing.assert_allclose(np.asarray(native(view)), io["y"], rtol=1e-5, atol=1e-6)


def test_loading_natively_never_imports_torch(graph: StoredCompiledGraph) -> None:
    code = f"""
        import sys
        import numpy as np
        from safetensors.numpy import load_file
        from torch_compiled_graphs import Engine
        g = Engine({str(graph.path.parent / "store")!r}).resolve({KEY!r}, {str(graph.path.parent / "fresh")!r})
        m = g.load_native({str(WEIGHTS)!r})
        io = load_file({str(FIXTURE / "mlp-cpu.io.safetensors")!r})
        y = np.asarray(m(io["x"]))
        assert np.abs(y - io["y"]).max() < 1e-5
        assert "torch" not in sys.modules, sorted(k for k in sys.modules if k.startswith("torch."))
        print("ok")
        """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_rebind_after_a_weight_change_changes_the_output(
    graph: StoredCompiledGraph, io: dict[str, np.ndarray], tmp_path: Path
) -> None:
    native = graph.load_native(WEIGHTS)
    before = np.asarray(native(io["x"])).copy()
    w = load_file(WEIGHTS)
    changed = weights_with(tmp_path, l2__bias=w["l2.bias"] + 1.0, l1__weight=w["l1.weight"] * -0.5)
    native.rebind(changed)
    after = np.asarray(native(io["x"]))
    # Recompute the MLP in numpy: the folded (transposed) weights must follow the rebind.
    h = np.maximum(io["x"] @ (w["l1.weight"] * -0.5).T + w["l1.bias"], 0)
    np.testing.assert_allclose(after, h @ w["l2.weight"].T + w["l2.bias"] + 1.0, rtol=1e-5, atol=1e-5)
    assert not np.allclose(after, before)
    native.rebind(WEIGHTS)
    np.testing.assert_allclose(np.asarray(native(io["x"])), before, rtol=0, atol=0)


def test_missing_extra_and_mismatched_constants_are_refused(graph: StoredCompiledGraph, tmp_path: Path) -> None:
    w = load_file(WEIGHTS)
    e = refused("run.constant_missing", graph.load_native, weights_with(tmp_path, l2__bias=None))
    assert "l2.bias" in str(e)
    e = refused(
        "run.constant_unexpected", graph.load_native, weights_with(tmp_path, l3__weight=np.zeros(2, np.float32))
    )
    assert "l3.weight" in str(e)
    refused(
        "run.constant_mismatch", graph.load_native, weights_with(tmp_path, l1__bias=w["l1.bias"].astype(np.float64))
    )
    refused("run.constant_mismatch", graph.load_native, weights_with(tmp_path, l1__bias=np.zeros(31, np.float32)))
    (tmp_path / "garbage.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    refused("run.weights_invalid", graph.load_native, tmp_path / "garbage.safetensors")
    refused("run.weights_invalid", graph.load_native, tmp_path / "absent.safetensors")


def test_rebind_refuses_with_the_same_checks_and_keeps_the_old_weights(
    native: NativeGraph, io: dict[str, np.ndarray], tmp_path: Path
) -> None:
    refused("run.constant_missing", native.rebind, weights_with(tmp_path, l1__weight=None))
    np.testing.assert_allclose(np.asarray(native(io["x"])), io["y"], rtol=1e-5, atol=1e-6)


def test_wrong_inputs_are_refused_before_the_graph_runs(native: NativeGraph, io: dict[str, np.ndarray]) -> None:
    x = io["x"]
    refused("run.input_mismatch", native, x.astype(np.float64))
    refused("run.input_mismatch", native, x.astype(np.int32))
    refused("run.input_mismatch", native, x.reshape(64))
    refused("run.input_mismatch", native, np.zeros((5, 16), np.float32))
    refused("run.input_layout", native, np.asfortranarray(x))
    refused("run.input_layout", native, np.zeros((4, 32), np.float32)[:, ::2])
    refused("run.input_mismatch", native, np.zeros((4, 16), np.complex64))


def test_a_buffer_protocol_input_runs_and_is_pinned_during_the_call(
    native: NativeGraph, io: dict[str, np.ndarray]
) -> None:
    from torch_compiled_graphs.native import _buffer

    x = np.ascontiguousarray(io["x"], dtype=np.float32)
    raw = bytearray(x.tobytes())
    with memoryview(raw) as base, base.cast("f", x.shape) as view:  # a plain buffer, no __array_interface__
        np.testing.assert_allclose(np.asarray(native(view)), io["y"], rtol=1e-5, atol=1e-6)
    # What the call holds while the graph runs (the GIL released) pins the buffer:
    # the bytearray cannot be resized or freed under the graph.
    _address, nbytes, dtype, shape, keep = _buffer("x", raw)
    assert (nbytes, dtype, shape) == (len(raw), "uint8", [len(raw)])
    with pytest.raises(BufferError):
        raw.extend(b"\0" * 4096)
    del keep
    raw.extend(b"\0" * 4096)


def test_a_call_outside_the_convention_is_refused(native: NativeGraph, io: dict[str, np.ndarray]) -> None:
    x = io["x"]
    e = refused("run.call_invalid", native, x, x)
    assert "tuple of 1" in str(e)
    refused("run.call_invalid", native, x, extra=x)
    refused("run.call_invalid", native)
    refused("run.call_invalid", native, None)


def test_a_missing_torch_lib_directory_is_refused(graph: StoredCompiledGraph, tmp_path: Path) -> None:
    refused("run.torch_not_found", graph.load_native, WEIGHTS, torch_lib=tmp_path)
    refused("run.torch_not_found", find_torch_lib, tmp_path / "absent")
    # Without torch on the path, the package's own search finds nothing.
    code = f"""
        import sys
        sys.path = [p for p in sys.path if "site-packages" not in p] + [{str(ROOT / "python")!r}]
        from torch_compiled_graphs.native import find_torch_lib
        from torch_compiled_graphs.errors import BindingError
        try:
            find_torch_lib()
        except BindingError as e:
            print(e.code)
        """
    out = subprocess.run([sys.executable, "-S", "-c", textwrap.dedent(code)], capture_output=True, text=True)
    assert out.stdout.strip() == "run.torch_not_found", out.stderr


def test_the_installed_torch_is_checked_against_the_recorded_digest(graph: StoredCompiledGraph) -> None:
    from torch_compiled_graphs.toolchain import _distributions, _record_digest

    assert graph.load_native(WEIGHTS).torch_check == "not recorded"  # the reference records no digest
    installed = _record_digest(_distributions()["torch"])
    ok = copy.deepcopy(graph.metadata)
    ok["toolchain"]["torch"] = installed
    assert restated(graph, ok).load_native(WEIGHTS).torch_check == "record digest"
    other = copy.deepcopy(graph.metadata)
    other["toolchain"]["torch"] = "0123456789abcdef"
    refused(
        "run.torch_mismatch", StoredCompiledGraph(graph.key, graph.path, other, graph.manifest).load_native, WEIGHTS
    )


def test_a_package_that_disagrees_with_its_metadata_is_refused(graph: StoredCompiledGraph) -> None:
    dropped = copy.deepcopy(graph.metadata)
    dropped["graph_class"]["constants"] = dropped["graph_class"]["constants"][1:]
    refused("run.package_invalid", restated(graph, dropped).load_native, WEIGHTS)
    renamed = copy.deepcopy(graph.metadata)
    renamed["graph_class"]["name"] = "model/other-entry"
    refused(
        "run.package_invalid", StoredCompiledGraph(graph.key, graph.path, renamed, graph.manifest).load_native, WEIGHTS
    )
    cuda = copy.deepcopy(graph.metadata)
    cuda["sm"] = "sm_90"
    # A CUDA artifact runs natively on its GPU only; on the CPU it is refused, whatever the machine.
    claims_cuda = StoredCompiledGraph(graph.key, graph.path, cuda, graph.manifest)
    refused("run.device_mismatch", claims_cuda.load_native, WEIGHTS, device="cpu")
    refused("run.device_mismatch", graph.load_native, WEIGHTS, device="cuda:0")
    refused("run.device_mismatch", graph.load_native, WEIGHTS, device="tpu")


def with_ingress(graph: StoredCompiledGraph, shape: list[Any], symbols: dict[str, list[int]]) -> NativeGraph:
    metadata = copy.deepcopy(graph.metadata)
    metadata["graph_class"]["graph"]["pytree"]["ingress"] = {
        "v": 1,
        "parameters": ["x"],
        "flat_arity": 1,
        "inputs": [
            {
                "name": "x",
                "position": 0,
                "param": "x",
                "param_position": 0,
                "path": [],
                "exported_name": "x",
                "dtype": "float32",
                "shape": shape,
            }
        ],
        "symbols": symbols,
        "excluded_inputs": [],
    }
    return restated(graph, metadata).load_native(WEIGHTS)


def test_symbols_of_the_call_ingress_are_checked_for_range_and_consistency(
    graph: StoredCompiledGraph, io: dict[str, np.ndarray]
) -> None:
    ranged = with_ingress(graph, ["S0", 16], {"S0": [2, 4]})
    np.testing.assert_allclose(np.asarray(ranged(io["x"])), io["y"], rtol=1e-5, atol=1e-6)
    e = refused("run.input_mismatch", ranged, np.zeros((1, 16), np.float32))
    assert "S0 must be in [2, 4]" in str(e)
    tied = with_ingress(graph, ["S0", "S0"], {"S0": [1, 16]})
    e = refused("run.input_mismatch", tied, io["x"])
    assert "S0 is 4 elsewhere" in str(e)


def test_a_call_spec_with_an_unknown_node_type_is_refused() -> None:
    from torch_compiled_graphs.native import _parse_spec

    spec = '[1, {"type": "collections.namedtuple", "context": "{}", "children_spec": []}]'
    refused("run.native_unsupported", _parse_spec, spec, "input")
    refused("run.native_unsupported", _parse_spec, "[2, {}]", "input")
    refused("run.native_unsupported", _parse_spec, "not json", "input")
    nested = (
        '[1, {"type": "builtins.tuple", "context": "null", "children_spec": ['
        '{"type": "builtins.list", "context": "null", "children_spec": [{"type": null, "context": null, '
        '"children_spec": []}]}, {"type": "builtins.dict", "context": "[\\"b\\", \\"a\\"]", "children_spec": ['
        '{"type": null, "context": null, "children_spec": []}, {"type": null, "context": null, "children_spec": []}'
        "]}]}]"
    )
    assert _parse_spec(nested, "input") == (
        "tuple",
        [("list", [("leaf",)]), ("dict", ["b", "a"], [("leaf",), ("leaf",)])],
    )


@pytest.mark.real_aoti
def test_a_minted_dynamic_batch_graph_runs_natively_within_its_ingress(
    demo_minted: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    import demo

    workdir, result = demo_minted
    stored = Engine(workdir / "store").resolve(result["mint"]["key"], tmp_path / "graph")
    assert stored is not None
    assert stored.metadata["graph_class"]["graph"]["pytree"]["ingress"]["symbols"]
    weights = workdir / "demo-small.weights.safetensors"
    native = stored.load_native(weights)
    assert native.torch_check == "record digest"
    cfg = demo.SIZES["small"]
    model = demo.build_model(cfg["dim"], cfg["heads"], cfg["hidden"])
    from safetensors.torch import load_file as load_tensors

    model.load_state_dict(load_tensors(weights))  # type: ignore[attr-defined]
    for batch in (1, 7, 16):
        x = np.random.default_rng(batch).standard_normal((batch, cfg["seq"], cfg["dim"]), dtype=np.float32)
        with torch.no_grad():
            expected = model(torch.from_numpy(x)).numpy()  # type: ignore[operator]
        np.testing.assert_allclose(np.asarray(native(x)), expected, rtol=1e-4, atol=1e-4)
    refused("run.input_mismatch", native, np.zeros((17, cfg["seq"], cfg["dim"]), np.float32))
    refused("run.input_mismatch", native, np.zeros((2, cfg["seq"] + 1, cfg["dim"]), np.float32))


def test_a_graph_with_a_proxy_executor_call_is_refused_before_loading(tmp_path: Path) -> None:
    """The reference artifact re-packed with one proxy-executor call (the form torch 2.15 emits for a
    ``torch.library`` op without a C shim) spliced into its wrapper: resolve serves it, ``load_native``
    refuses it up front with ``run.native_unsupported`` and says to use ``load()``; no compile needed."""
    import json
    import tarfile
    import zipfile

    from torch_compiled_graphs import _native

    from .conftest import REFERENCE_WEIGHTS, resolve_reference

    with tarfile.open(REFERENCE / "mlp-cpu.tar.gz") as tar:
        tar.extractall(tmp_path / "members", filter="data")
    call = (
        "    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_proxy_executor_call_function(proxy_executor, 0, 0, "
        "std::array<int64_t, 0>{}.data(), 2, std::array<AtenTensorHandle, 2>{buf0, buf1}.data()));\n"
    )
    table = json.dumps({"nodes": [{"name": "buf1", "node": {"target": "mylib::scale", "inputs": [], "outputs": []}}]})
    doctored = tmp_path / "model.pt2"
    with zipfile.ZipFile(tmp_path / "members" / "model.pt2") as src, zipfile.ZipFile(doctored, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith(".wrapper.cpp"):
                text = data.decode()
                at = text.index("\n", text.index("AOTIProxyExecutorHandle proxy_executor")) + 1
                data = (text[:at] + call + text[at:]).encode()
                dst.writestr(info.filename.removesuffix(".cpp") + ".json", table)
            dst.writestr(info, data)
    metadata = json.loads((tmp_path / "members" / "metadata.json").read_text())
    envelope = tmp_path / "doctored.tar.gz"
    _native.artifact_pack(str(doctored), metadata, None, str(envelope))
    engine = Engine(tmp_path / "store")
    engine.import_artifact(REFERENCE_KEY, envelope)
    graph = engine.resolve(REFERENCE_KEY, tmp_path / "graph")
    assert graph is not None
    want = [{"call": "aoti_torch_proxy_executor_call_function", "count": 1, "target": "mylib::scale"}]
    assert graph.native_unsupported_calls == want
    assert graph.mint_record is None  # packed, not minted: no record
    err = refused("run.native_unsupported", graph.load_native, REFERENCE_WEIGHTS)
    assert "mylib::scale" in str(err) and "use load()" in str(err)
    # The untouched reference artifact scans clean.
    plain = resolve_reference(tmp_path / "plain")
    assert plain.native_unsupported_calls == [] and plain.mint_record is None


def test_the_shim_imports_of_the_reference_so_are_read_without_torch(
    graph: StoredCompiledGraph, tmp_path: Path
) -> None:
    """``shim_imports`` reads the ``.so``'s dynamic symbol table (docs/shim.md): the reference MLP calls
    23 libtorch C shim functions, one of them op-specific (``aoti_torch_cpu_addmm_out``, its GEMM), and
    imports nothing else outside glibc, libstdc++ and libgcc_s. Reading it imports no torch."""
    imports = graph.shim_imports
    assert sorted(imports) == ["aoti_torch", "other"]
    assert imports["other"] == []
    shims = imports["aoti_torch"]
    assert len(shims) == 23 and shims == sorted(set(shims))
    assert all(name.startswith("aoti_torch_") for name in shims)
    for name in ("aoti_torch_cpu_addmm_out", "aoti_torch_empty_strided", "aoti_torch_get_data_ptr"):
        assert name in shims
    probe = textwrap.dedent(
        f"""
        import sys
        from torch_compiled_graphs import Engine
        engine = Engine({str(tmp_path / "store")!r})
        engine.import_artifact({REFERENCE_KEY!r}, {str(REFERENCE / "mlp-cpu.tar.gz")!r})
        g = engine.resolve({REFERENCE_KEY!r}, {str(tmp_path / "graph")!r})
        print(len(g.shim_imports["aoti_torch"]), "torch" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["23", "False"]
