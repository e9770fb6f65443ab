"""Running resolved graphs: binding checks with their codes, the reference
artifact of the original implementation (with folded constants), and rebind."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from torch_compiled_graphs import StoredCompiledGraph
from torch_compiled_graphs.errors import BindingError

from .conftest import REFERENCE, REFERENCE_KEY, resolve_reference

FIXTURE = REFERENCE
KEY = REFERENCE_KEY


class Mlp(torch.nn.Module):
    """The reference fixture's model: Linear(16, 32) -> ReLU -> Linear(32, 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(16, 32)
        self.l2 = torch.nn.Linear(32, 8)

    def forward(self, x: Any) -> Any:
        return self.l2(torch.relu(self.l1(x)))


@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory) -> StoredCompiledGraph:
    found: StoredCompiledGraph = resolve_reference(tmp_path_factory.mktemp("runner"))
    return found


@pytest.fixture()
def weights() -> dict[str, Any]:
    return load_file(FIXTURE / "mlp-cpu.weights.safetensors")


def test_the_reference_artifact_runs_and_matches_its_expected_output(
    graph: StoredCompiledGraph, weights: dict[str, Any]
) -> None:
    io = load_file(FIXTURE / "mlp-cpu.io.safetensors")
    loaded = graph.load(weights)
    assert sorted(loaded.constant_fqns) == sorted(weights)
    # Folded constants (computed rows) are recomputed from the bound weights.
    assert any(row["source"] == "computed" for row in graph.constants)
    torch.testing.assert_close(loaded(io["x"]), io["y"], rtol=1e-5, atol=1e-6)


def test_rebind_after_an_out_of_place_weight_change_matches_eager(
    graph: StoredCompiledGraph, weights: dict[str, Any]
) -> None:
    x = torch.randn(4, 16)
    model = Mlp().eval()
    model.load_state_dict(weights)
    loaded = graph.load(model)
    torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        model.l1.weight = torch.nn.Parameter(model.l1.weight * -0.5)
        model.l2.bias = torch.nn.Parameter(model.l2.bias + 1.0)
    loaded.rebind(model)
    torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-6)
    loaded.rebind(weights)
    eager = Mlp().eval()
    eager.load_state_dict(weights)
    torch.testing.assert_close(loaded(x), eager(x), rtol=1e-5, atol=1e-6)


def refused(code: str, graph: StoredCompiledGraph, weights: object, **kw: Any) -> BindingError:
    with pytest.raises(BindingError) as e:
        graph.load(weights, **kw)
    assert e.value.code == code, str(e.value)
    return e.value


def test_a_missing_constant_is_refused(graph: StoredCompiledGraph, weights: dict[str, Any]) -> None:
    del weights["l2.bias"]
    assert "l2.bias" in str(refused("run.constant_missing", graph, weights))


def test_an_extra_constant_is_refused(graph: StoredCompiledGraph, weights: dict[str, Any]) -> None:
    weights["l3.weight"] = torch.zeros(2)
    assert "l3.weight" in str(refused("run.constant_unexpected", graph, weights))


def test_a_wrong_dtype_or_shape_is_refused(graph: StoredCompiledGraph, weights: dict[str, Any]) -> None:
    refused("run.constant_mismatch", graph, {**weights, "l1.bias": weights["l1.bias"].double()})
    refused("run.constant_mismatch", graph, {**weights, "l1.bias": torch.zeros(31)})


def test_a_wrong_device_is_refused(graph: StoredCompiledGraph, weights: dict[str, Any]) -> None:
    refused("run.device_mismatch", graph, {**weights, "l1.bias": weights["l1.bias"].to("meta")})
    refused("run.device_mismatch", graph, weights, device="cuda")


def test_weights_that_are_not_tensors_are_refused(graph: StoredCompiledGraph, weights: dict[str, Any]) -> None:
    refused("run.weights_invalid", graph, [1, 2])
    refused("run.weights_invalid", graph, {**weights, "l1.bias": [0.0] * 32})


def test_a_call_outside_the_convention_is_refused(graph: StoredCompiledGraph, weights: dict[str, Any]) -> None:
    loaded = graph.load(weights)
    with pytest.raises(BindingError) as e:
        loaded(torch.zeros(4, 16), extra=torch.zeros(1))
    assert e.value.code == "run.call_invalid"
    with pytest.raises(BindingError) as e:
        loaded(torch.zeros(4, 16), torch.zeros(4, 16))
    assert e.value.code == "run.call_invalid"


def test_loading_does_not_import_the_inductor_stack(graph: StoredCompiledGraph) -> None:
    code = f"""
        import sys
        from safetensors.torch import load_file
        from torch_compiled_graphs import Engine
        g = Engine({str(graph.path.parent / "store")!r}).resolve({KEY!r}, {str(graph.path.parent / "fresh")!r})
        m = g.load(load_file({str(FIXTURE / "mlp-cpu.weights.safetensors")!r}))
        io = load_file({str(FIXTURE / "mlp-cpu.io.safetensors")!r})
        assert (m(io["x"]) - io["y"]).abs().max() < 1e-5
        assert "torch._inductor" not in sys.modules
        """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_the_store_path_of_a_resolved_graph(graph: StoredCompiledGraph) -> None:
    assert isinstance(graph.path, Path) and (graph.path / "model.pt2").is_file()


def test_a_package_that_disagrees_with_its_metadata_is_refused(
    graph: StoredCompiledGraph, weights: dict[str, Any]
) -> None:
    import copy

    metadata = copy.deepcopy(graph.metadata)
    metadata["graph_class"]["constants"] = metadata["graph_class"]["constants"][1:]
    tampered = StoredCompiledGraph(graph.key, graph.path, metadata, graph.manifest)
    with pytest.raises(BindingError) as e:
        tampered.load(weights)
    assert e.value.code == "run.package_invalid"
    renamed = copy.deepcopy(graph.metadata)
    renamed["graph_class"]["name"] = "model/other-entry"
    with pytest.raises(BindingError) as e:
        StoredCompiledGraph(graph.key, graph.path, renamed, graph.manifest).load(weights)
    assert e.value.code == "run.package_invalid"


def test_an_input_on_another_device_is_refused_before_the_run(
    graph: StoredCompiledGraph, weights: dict[str, Any]
) -> None:
    """The container reads every input as memory of the graph's device: a tensor
    elsewhere (here a meta tensor, which has no memory at all) is refused with the
    argument and both devices named, never handed over (issue: a CPU timestep fed
    to a CUDA graph aborted the process)."""
    loaded = graph.load(weights)
    with pytest.raises(BindingError) as e:
        loaded(torch.empty(4, 16, device="meta"))
    assert e.value.code == "run.call_invalid"
    assert "meta" in str(e.value) and "cpu" in str(e.value)
    # The module takes the same call once the tensor is where the graph runs.
    io = load_file(FIXTURE / "mlp-cpu.io.safetensors")
    torch.testing.assert_close(loaded(io["x"]), io["y"], rtol=1e-5, atol=1e-6)


def test_the_torch_free_loader_runs_single_threaded_for_captures(
    graph: StoredCompiledGraph, weights: dict[str, Any]
) -> None:
    """load()'s torch-free runner (packages carrying their own C++ runtime) runs captured
    calls through the container's single-threaded run, as torch's loader does: the same
    outputs, and the mode is the model's own."""
    from torch_compiled_graphs._native_loader import NativeLoader

    io = load_file(FIXTURE / "mlp-cpu.io.safetensors")
    outs = []
    for single in (False, True):
        loader = NativeLoader(graph.package_path, graph.graph_class, -1, graph.sm, graph.constants, single)
        assert loader._model.single_threaded is single
        loader.load_constants(dict(weights), False, True, False)
        outs.append(loader.boxed_run([io["x"]])[0])
    torch.testing.assert_close(outs[1], io["y"], rtol=1e-5, atol=1e-6)
    assert torch.equal(outs[0], outs[1])
