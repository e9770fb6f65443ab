"""Binding from the checkpoints users have, on the 0.2.0 reference artifact (no
compile): sharded checkpoints by their index, directories, several files,
prefixes, and the refusals of each, through ``load_native`` and ``load`` alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .conftest import REFERENCE, REFERENCE_WEIGHTS, refused_binding


@pytest.fixture(scope="module")
def tensors() -> dict[str, Any]:
    from safetensors.numpy import load_file

    return dict(load_file(REFERENCE_WEIGHTS))


def _sharded(dir: Path, tensors: dict[str, Any], prefix: str = "", index: str = "model.safetensors.index.json") -> Path:
    """A checkpoint as ``save_pretrained`` writes it past its shard size: one shard per tensor."""
    from safetensors.numpy import save_file

    dir.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, (name, value) in enumerate(sorted(tensors.items())):
        shard = f"model-{i + 1:05d}-of-{len(tensors):05d}.safetensors"
        save_file({prefix + name: value}, str(dir / shard))
        weight_map[prefix + name] = shard
    (dir / index).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return dir / index


def _run(graph: Any, io: dict[str, Any], **kwargs: Any) -> Any:
    native = graph.load_native(**kwargs)
    return np.asarray(native(io["x"]))


def test_a_sharded_checkpoint_binds_by_its_index_or_its_directory(
    graph: Any, io: dict[str, Any], tensors: dict[str, Any], tmp_path: Path
) -> None:
    index = _sharded(tmp_path / "ckpt", tensors)
    want = _run(graph, io, weights=REFERENCE_WEIGHTS)
    np.testing.assert_array_equal(_run(graph, io, weights=index), want)
    np.testing.assert_array_equal(_run(graph, io, weights=tmp_path / "ckpt"), want)
    # Several files: each tensor in a file of its own.
    files = [p for p in sorted((tmp_path / "ckpt").iterdir()) if p.suffix == ".safetensors"]
    np.testing.assert_array_equal(_run(graph, io, weights=files), want)


def test_a_pipeline_checkpoint_binds_with_strip_prefix_and_a_bare_one_with_add_prefix(
    graph: Any, io: dict[str, Any], tensors: dict[str, Any], tmp_path: Path
) -> None:
    from safetensors.numpy import save_file

    want = _run(graph, io, weights=REFERENCE_WEIGHTS)
    pipeline = {"unet." + k: v for k, v in tensors.items()}
    pipeline["vae.decoder.conv.weight"] = np.zeros((2, 2), dtype=np.float32)
    save_file(pipeline, str(tmp_path / "pipeline.safetensors"))
    native = graph.load_native(tmp_path / "pipeline.safetensors", strip_prefix="unet.")
    np.testing.assert_array_equal(np.asarray(native(io["x"])), want)
    assert native.outside_prefix == 1 and native.ignored_constants == []
    # Without the prefix, the refusal names it.
    err = refused_binding("run.constant_missing", graph.load_native, tmp_path / "pipeline.safetensors")
    assert 'strip_prefix="unet."' in str(err)
    # A checkpoint whose names lack a prefix the graph has: the refusal names it.
    bare = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("l1.")}
    save_file(bare, str(tmp_path / "l1.safetensors"))
    err = refused_binding("run.constant_missing", graph.load_native, tmp_path / "l1.safetensors")
    assert 'add_prefix="l1."' in str(err)
    # Both prefixes at once: "m.1.weight" -> "1.weight" -> "l1.weight".
    renamed = {"m." + k[1:]: v for k, v in tensors.items()}
    save_file(renamed, str(tmp_path / "renamed.safetensors"))
    native = graph.load_native(tmp_path / "renamed.safetensors", strip_prefix="m.", add_prefix="l")
    np.testing.assert_array_equal(np.asarray(native(io["x"])), want)


def test_refusals_of_checkpoints_on_disk(graph: Any, tensors: dict[str, Any], tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    # A shard that escapes the index's directory.
    bad = tmp_path / "escape"
    index = _sharded(bad, tensors)
    doc = json.loads(index.read_text())
    doc["weight_map"] = {k: "../" + v for k, v in doc["weight_map"].items()}
    index.write_text(json.dumps(doc))
    refused_binding("run.weights_invalid", graph.load_native, index)
    # A shard that holds a name its index does not map to it.
    lying = tmp_path / "lying"
    index = _sharded(lying, tensors)
    doc = json.loads(index.read_text())
    first = sorted(doc["weight_map"])[0]
    doc["weight_map"][first] = doc["weight_map"][sorted(doc["weight_map"])[1]]
    index.write_text(json.dumps(doc))
    refused_binding("run.weights_invalid", graph.load_native, index)
    # Not an index at all.
    (tmp_path / "x.safetensors.index.json").write_text("[1, 2]")
    refused_binding("run.weights_invalid", graph.load_native, tmp_path / "x.safetensors.index.json")
    # A directory with two candidate files and no index.
    two = tmp_path / "two"
    two.mkdir()
    save_file(tensors, str(two / "a.safetensors"))
    save_file(tensors, str(two / "b.safetensors"))
    refused_binding("run.weights_invalid", graph.load_native, two)
    # A name two files hold.
    refused_binding("run.weights_invalid", graph.load_native, [two / "a.safetensors", two / "b.safetensors"])
    # A name foreign to the declaration, beside a complete set.
    extra = dict(tensors)
    extra["l3.weight"] = np.zeros((1,), dtype=np.float32)
    save_file(extra, str(tmp_path / "extra.safetensors"))
    err = refused_binding("run.constant_unexpected", graph.load_native, tmp_path / "extra.safetensors")
    assert "l3.weight" in str(err)
    refused_binding("run.weights_invalid", graph.load_native, [])


def test_the_reference_has_the_contract_its_metadata_implies(graph: Any) -> None:
    contract = graph.weights_contract
    assert contract["recorded"] is False
    assert set(contract["kinds"]) == set(graph.metadata["graph_class"]["graph"]["constant_fqns"])
    assert set(contract["kinds"].values()) == {"unknown"}
    assert contract["dropped"] == [] and contract["alias_groups"] == []


def test_load_binds_the_same_checkpoints_as_load_native(
    graph: Any, io: dict[str, Any], tensors: dict[str, Any], tmp_path: Path
) -> None:
    import torch

    index = _sharded(tmp_path / "ckpt", tensors, prefix="unet.")
    loaded = graph.load(index, strip_prefix="unet.")
    want = np.asarray(graph.load_native(REFERENCE_WEIGHTS)(io["x"]))
    got = loaded(torch.from_numpy(io["x"])).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    refused_binding("run.constant_missing", graph.load, index)


def _with_so(graph: Any, tmp_path: Path, patch: Any) -> Any:
    """A copy of ``graph`` whose package's .so is ``patch(bytes)``, as a resolved graph."""
    import shutil
    import zipfile

    from torch_compiled_graphs.engine import StoredCompiledGraph

    copy = tmp_path / "graph"
    shutil.copytree(graph.path, copy)
    with zipfile.ZipFile(graph.package_path) as src, zipfile.ZipFile(copy / "model.pt2", "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info, patch(data) if info.filename.endswith(".so") else data)
    return StoredCompiledGraph(graph.key, copy, graph.metadata, graph.manifest)


def test_regression_a_so_that_does_not_name_libstdcxx_is_not_taken_for_a_static_runtime(
    graph: Any, tmp_path: Path
) -> None:
    """Issue 31: the check was "libstdc++.so.6 is not in DT_NEEDED", which refused .so files
    that need no C++ runtime at all. Naming another runtime (or none) proves nothing: only
    a .so that defines the runtime's symbols is kept from torch's loader."""
    from torch_compiled_graphs import _native

    def rename(data: bytes) -> bytes:
        assert b"libstdc++.so.6\x00" in data
        # Same length: the dynamic string table keeps its layout, DT_NEEDED names another runtime.
        return data.replace(b"libstdc++.so.6\x00", b"libstdc++.so.9\x00")

    patched = _with_so(graph, tmp_path, rename)
    package = str(patched.package_path)
    assert _native.package_own_cxx_runtime(package, graph.graph_class) == []
    _native.package_check_torch_loader(package, graph.graph_class)
    # torch's loader then finds no libstdc++.so.9 to open: a typed refusal, never a crash.
    refused_binding("run.package_invalid", patched.load, REFERENCE_WEIGHTS)


def test_a_package_whose_so_defines_the_cxx_runtime_goes_to_the_native_runner(graph: Any, tmp_path: Path) -> None:
    """A .so linked with a static libstdc++ (testdata/elf/cxx-static.so, real linker output)
    never reaches torch's loader: the check refuses it and load() hands it to the torch-free
    runner, which here refuses it as no AOTInductor graph (it is a plain library)."""
    import gzip

    from torch_compiled_graphs import _native

    static = gzip.decompress((REFERENCE.parent / "elf" / "cxx-static.so.gz").read_bytes())
    patched = _with_so(graph, tmp_path, lambda _: static)
    package = str(patched.package_path)
    assert "__cxa_throw" in _native.package_own_cxx_runtime(package, graph.graph_class)
    err = refused_binding("run.loader_unsupported", _native.package_check_torch_loader, package, graph.graph_class)
    assert "__cxa_throw" in str(err)
    err = refused_binding("run.package_invalid", patched.load, REFERENCE_WEIGHTS)
    assert "AOTInductorModelContainer" in str(err)


def test_a_parameter_the_compiler_records_as_a_literal_is_refused_with_the_fix() -> None:
    """Inductor records the parameters of a top-level nn.Sequential ("0.weight") with
    ConstantType::Unknown, which SPEC-v1 §8.3 reads as a literal: the mint says why and what to do."""
    import torch

    from torch_compiled_graphs.compile import literal_tensors
    from torch_compiled_graphs.errors import AdmissionError

    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    program = torch.export.export(model, (torch.randn(2, 4),))
    with pytest.raises(AdmissionError) as e:
        literal_tensors(program, [{"fqn": "0.weight"}])
    assert e.value.code == "admission.literal_unbound"
    assert "nn.Sequential" in str(e.value) and "parameter or buffer" in str(e.value)
