"""One native weights set for several graphs (issue 33 on the native path):
``NativeWeightsSet`` reads a checkpoint once, without torch, and native graphs bind
its memory without a copy, each through its own weights contract.

The binding tests use the 0.2.0 reference artifact (no compile). The memory test
mints one model of 192 MiB of float32 weights in two shape buckets (two real
compiles, module-scoped) whose batch-1 graph drops a parameter its batch-4 graph
keeps, and measures the process's resident memory.
"""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .conftest import REFERENCE_WEIGHTS, refused_binding, resolve_reference


def _x() -> Any:
    return np.random.default_rng(3).standard_normal((4, 16)).astype(np.float32)


def _out(graph: Any, x: Any) -> Any:
    return np.asarray(graph(x)).copy()


def _reference_tensors() -> dict[str, Any]:
    from safetensors.numpy import load_file

    return dict(load_file(REFERENCE_WEIGHTS))


def test_two_graphs_bind_one_native_set_without_a_copy_and_release_in_any_order(tmp_path: Path) -> None:
    from torch_compiled_graphs import NativeWeightsSet

    stored_a = resolve_reference(tmp_path / "a")
    stored_b = resolve_reference(tmp_path / "b")
    files = resolve_reference(tmp_path / "files").load_native(REFERENCE_WEIGHTS)
    x = _x()
    want = _out(files, x)
    weights_bytes = (16 * 32 + 32 + 32 * 8 + 8) * 4
    # A graph bound from files holds every constant it read.
    assert files.added_nbytes == weights_bytes

    weights = NativeWeightsSet(REFERENCE_WEIGHTS)
    assert weights.nbytes == weights_bytes
    assert weights.names == ["l1.bias", "l1.weight", "l2.bias", "l2.weight"]
    assert weights.device == "cpu" and weights.outside_prefix == 0
    assert {"plan_weights", "allocate_weights", "read_weights", "set_total"} <= set(weights.timings)
    assert repr(weights) == f"NativeWeightsSet(4 tensors, {weights_bytes} bytes, device='cpu')"

    a, b = stored_a.load_native(weights), stored_b.load_native(weights)
    np.testing.assert_array_equal(_out(a, x), want)
    np.testing.assert_array_equal(_out(b, x), want)
    # Nothing but literals (this artifact has none) is the graphs' own.
    assert a.added_nbytes == b.added_nbytes == 0
    assert a.ignored_constants == [] and a.device == "cpu"

    # The set released first: the graphs hold its memory.
    ref = weakref.ref(weights)
    del weights
    gc.collect()
    assert ref() is None
    np.testing.assert_array_equal(_out(a, x), want)
    np.testing.assert_array_equal(_out(b, x), want)
    # A graph released, then the other bound to another set, and back to files.
    del a
    gc.collect()
    np.testing.assert_array_equal(_out(b, x), want)
    b.rebind(NativeWeightsSet([REFERENCE_WEIGHTS]))
    gc.collect()
    np.testing.assert_array_equal(_out(b, x), want)
    assert b.added_nbytes == 0
    b.rebind(REFERENCE_WEIGHTS)
    assert b.added_nbytes == weights_bytes
    np.testing.assert_array_equal(_out(b, x), want)


def test_a_native_set_serves_each_components_graph_by_prefix_and_rebinds_a_graph(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    from torch_compiled_graphs import NativeWeightsSet

    tensors = _reference_tensors()
    negated = {k: -v for k, v in tensors.items()}
    path = tmp_path / "pipeline.safetensors"
    save_file({**{f"first.{k}": v for k, v in tensors.items()}, **{f"second.{k}": v for k, v in negated.items()}}, path)
    one = NativeWeightsSet(path, strip_prefix="first.")
    two = NativeWeightsSet(path, strip_prefix="second.")
    assert one.outside_prefix == two.outside_prefix == 4
    graph = resolve_reference(tmp_path / "g").load_native(one)
    assert graph.outside_prefix == 4
    x = _x()
    want_one = _out(graph, x)
    np.testing.assert_array_equal(want_one, _out(resolve_reference(tmp_path / "f").load_native(REFERENCE_WEIGHTS), x))
    graph.rebind(two)
    assert not np.allclose(_out(graph, x), want_one)
    graph.rebind(one)
    np.testing.assert_array_equal(_out(graph, x), want_one)
    # Prefixes belong to the set, not the load.
    refused_binding("run.weights_invalid", resolve_reference(tmp_path / "h").load_native, one, strip_prefix="x.")


def test_graphs_of_one_native_set_load_and_run_concurrently(tmp_path: Path) -> None:
    """A worker starting its buckets on threads of their own (the cold start of several
    buckets overlaps that way): eight graphs loaded from one set at once, each called
    at once, five rounds; every output that of a graph bound from the files."""
    from concurrent.futures import ThreadPoolExecutor

    from torch_compiled_graphs import NativeWeightsSet

    stored = [resolve_reference(tmp_path / f"g{i}") for i in range(8)]
    weights = NativeWeightsSet(REFERENCE_WEIGHTS)
    x = _x()
    want = _out(resolve_reference(tmp_path / "files").load_native(REFERENCE_WEIGHTS), x)

    def bucket(graph: Any) -> Any:
        return _out(graph.load_native(weights), x)

    for _ in range(5):
        with ThreadPoolExecutor(len(stored)) as pool:
            outs = list(pool.map(bucket, stored))
        for out in outs:
            np.testing.assert_array_equal(out, want)


def test_a_native_set_that_does_not_fit_is_refused_with_the_codes_of_files(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    from torch_compiled_graphs import NativeWeightsSet

    stored = resolve_reference(tmp_path / "g")
    graph = stored.load_native(REFERENCE_WEIGHTS)
    x = _x()
    want = _out(graph, x)
    tensors = _reference_tensors()
    cases = {
        "run.constant_mismatch": {**tensors, "l2.weight": tensors["l2.weight"].T.copy()},
        "run.constant_missing": {k: v for k, v in tensors.items() if k != "l2.bias"},
        "run.constant_unexpected": {**tensors, "extra.weight": np.zeros(2, np.float32)},
    }
    for code, case in cases.items():
        path = tmp_path / f"{code}.safetensors"
        save_file(case, path)
        refused_binding(code, stored.load_native, path)
        refused_binding(code, stored.load_native, NativeWeightsSet(path))
        refused_binding(code, graph.rebind, NativeWeightsSet(path))
        # A refused rebind leaves the bound weights in place.
        np.testing.assert_array_equal(_out(graph, x), want)
    cpu_set = NativeWeightsSet(REFERENCE_WEIGHTS)
    refused_binding("run.device_mismatch", stored.load_native, cpu_set, device="cuda:0")
    refused_binding("run.weights_invalid", NativeWeightsSet, [])


# -- two shape buckets of one large model, memory measured --------------------------------

WIDTH = 4096
LAYERS = 3


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def buckets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One model (3 x 4096 x 4096 float32: 192 MiB) minted for batch 1 and batch 4; its
    ``scale`` is used by the batch-4 graph only, so the batch-1 graph drops it."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from torch_compiled_graphs import Engine, GraphClassSpec, RuntimeCompatibility, record_toolchain

    class Wide(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.w = torch.nn.ParameterList(
                torch.nn.Parameter(torch.randn(WIDTH, WIDTH, generator=g) / WIDTH**0.5) for _ in range(LAYERS)
            )
            self.scale = torch.nn.Parameter(torch.rand(WIDTH, generator=g) + 0.5)

        def forward(self, x: Any) -> Any:
            for w in self.w:
                x = torch.tanh(x @ w)  # the weight as is: nothing for the compiler to fold
            if x.shape[0] > 1:
                x = x * self.scale
            return x

    root = tmp_path_factory.mktemp("native-set-buckets")
    model = Wide().eval()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(root / "wide.safetensors"))
    engine = Engine(root / "store")
    toolchain = record_toolchain()
    out: dict[str, Any] = {"root": root, "weights": root / "wide.safetensors"}
    for batch in (1, 4):
        x = torch.randn(batch, WIDTH, generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            y = model(x)
        spec = GraphClassSpec(f"tests/native-set-wide-b{batch}", "serve", torch.export.export(model, (x,)))
        key = RuntimeCompatibility("cpu", toolchain=toolchain).key(spec.declare())
        result = engine.ensure(
            key, root / f"graph-b{batch}", target="cpu", toolchain=toolchain, recipe=lambda s=spec: s
        )
        out[batch] = {"graph": result.compiled_graph, "x": x.numpy(), "y": y.numpy()}
    del model
    gc.collect()
    return out


@pytest.mark.real_aoti
def test_two_shape_buckets_of_one_model_bind_one_native_set_once(buckets: dict[str, Any]) -> None:
    from torch_compiled_graphs import NativeWeightsSet

    size = LAYERS * WIDTH * WIDTH * 4 + WIDTH * 4
    one, four = buckets[1]["graph"], buckets[4]["graph"]
    for stored in (one, four):
        assert not any(row["source"] == "computed" for row in stored.constants), stored.constants
    # The batch-1 graph drops `scale`, the batch-4 graph binds it.
    assert "scale" in one.weights_contract["dropped"]
    assert "scale" not in four.weights_contract["dropped"]

    # Separate loads from the files: the reference outputs.
    separate = {b: buckets[b]["graph"].load_native(buckets["weights"]) for b in (1, 4)}
    want = {b: np.asarray(separate[b](buckets[b]["x"])).copy() for b in (1, 4)}
    for b in (1, 4):
        np.testing.assert_allclose(want[b], buckets[b]["y"], rtol=1e-4, atol=1e-4)
    assert separate[1].ignored_constants == ["scale"] and separate[4].ignored_constants == []
    del separate
    gc.collect()

    before = _rss()
    weights = NativeWeightsSet(buckets["weights"])
    opened = _rss() - before
    assert weights.nbytes == size
    assert 0.9 * size <= opened <= 1.1 * size, (opened, size)
    graphs = {}
    grown = {}
    for b in (1, 4):
        start = _rss()
        graphs[b] = buckets[b]["graph"].load_native(weights)
        np.testing.assert_array_equal(np.asarray(graphs[b](buckets[b]["x"])), want[b])
        grown[b] = _rss() - start
        assert graphs[b].added_nbytes == 0
    assert graphs[1].ignored_constants == ["scale"] and graphs[4].ignored_constants == []
    # Binding reads nothing and copies nothing: each graph adds its code and the
    # runtime's own state, far below the weights (a copy would add all 192 MiB).
    assert grown[4] < 0.1 * size, (grown, size)
    assert grown[1] < 0.1 * size, (grown, size)

    # Release order: the set first, then a graph; the other still runs and rebinds.
    del weights
    gc.collect()
    for b in (1, 4):
        np.testing.assert_array_equal(np.asarray(graphs[b](buckets[b]["x"])), want[b])
    del graphs[1]
    gc.collect()
    again = NativeWeightsSet(buckets["weights"])
    graphs[4].rebind(again)
    np.testing.assert_array_equal(np.asarray(graphs[4](buckets[4]["x"])), want[4])
