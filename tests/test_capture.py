"""CUDA-graph capture and replay of ``load()``, driven on the CPU.

The capture logic (shape sets, warm-up, LRU eviction, binding generations,
fallbacks, output copies, the lock) runs with :class:`RecordingBackend`, which
emulates a capture by running the container once and a replay by running it
into the static outputs, and records both. The CUDA backend itself is covered
by tests/test_cuda_graphs.py on a GPU.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from torch_compiled_graphs import StoredCompiledGraph
from torch_compiled_graphs.capture import ENV_CUDA_GRAPHS, ENV_MAX_CAPTURES, WARMUP_RUNS, RecordingBackend
from torch_compiled_graphs.engine import StoredCompiledGraph as _Stored

from .conftest import REFERENCE, refused_binding, resolve_reference


@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory) -> StoredCompiledGraph:
    found: StoredCompiledGraph = resolve_reference(tmp_path_factory.mktemp("capture"))
    return found


@pytest.fixture(scope="module")
def weights() -> dict[str, Any]:
    return load_file(REFERENCE / "mlp-cpu.weights.safetensors")


@pytest.fixture(scope="module")
def plain(graph: StoredCompiledGraph, weights: dict[str, Any]) -> Any:
    """The same graph, never captured: the reference for every captured call."""
    return graph.load(weights, cuda_graphs=False)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_CUDA_GRAPHS, raising=False)
    monkeypatch.delenv(ENV_MAX_CAPTURES, raising=False)


def kinds(backend: RecordingBackend) -> list[str]:
    return [e[0] for e in backend.events]


def x_of(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 16, generator=torch.Generator().manual_seed(seed * 100 + batch))


def test_a_shape_set_is_captured_after_its_warm_up_and_replayed_after(
    graph: StoredCompiledGraph, weights: dict[str, Any], plain: Any
) -> None:
    backend = RecordingBackend()
    loaded = graph.load(weights, capture_backend=backend)
    assert loaded.cuda_graphs and loaded.cuda_graphs_reason is None
    assert WARMUP_RUNS == 2
    for i in range(WARMUP_RUNS):
        assert torch.equal(loaded(x_of(4, i)), plain(x_of(4, i)))
        assert kinds(backend) == []
    assert torch.equal(loaded(x_of(4, 2)), plain(x_of(4, 2)))
    assert kinds(backend) == ["pool", "capture", "replay"]
    assert backend.events[1] == ("capture", [(4, 8)])
    for i in range(3, 6):
        assert torch.equal(loaded(x_of(4, i)), plain(x_of(4, i)))
    assert kinds(backend) == ["pool", "capture", "replay", "replay", "replay", "replay"]
    stats = loaded.stats
    assert stats["captures"] == 1 and stats["replays"] == 4 and stats["uncaptured_runs"] == 2
    assert stats["evictions"] == stats["fallbacks"] == stats["invalidated"] == 0
    assert stats["capture_seconds"] > 0 and loaded.timings["capture"] == stats["capture_seconds"]


def test_each_shape_set_warms_and_captures_on_its_own(
    graph: StoredCompiledGraph, weights: dict[str, Any], plain: Any
) -> None:
    backend = RecordingBackend()
    loaded = graph.load(weights, capture_backend=backend)
    for i in range(4):
        for batch in (1, 7):
            assert torch.equal(loaded(x_of(batch, i)), plain(x_of(batch, i)))
    captures = [e for e in backend.events if e[0] == "capture"]
    assert captures == [("capture", [(1, 8)]), ("capture", [(7, 8)])]
    assert loaded.stats["uncaptured_runs"] == 2 * WARMUP_RUNS and loaded.stats["replays"] == 4
    # Strides are part of the shape set: a transposed view is another set.
    t = x_of(16, 9).t().contiguous().t()
    assert t.stride() != x_of(16).stride()
    assert torch.equal(loaded(t), plain(t))
    assert loaded.stats["uncaptured_runs"] == 2 * WARMUP_RUNS + 1


def test_the_least_recently_used_capture_is_evicted(
    graph: StoredCompiledGraph, weights: dict[str, Any], plain: Any
) -> None:
    backend = RecordingBackend()
    loaded = graph.load(weights, capture_backend=backend, max_captures=2)
    for batch in (1, 2):
        for i in range(3):
            loaded(x_of(batch, i))
    loaded(x_of(1, 5))  # batch 1 is now the most recently used
    for i in range(3):
        assert torch.equal(loaded(x_of(3, i)), plain(x_of(3, i)))
    assert loaded.stats["evictions"] == 1 and loaded.stats["captures"] == 3
    replays = loaded.stats["replays"]
    assert torch.equal(loaded(x_of(1, 6)), plain(x_of(1, 6)))  # still captured
    assert loaded.stats["replays"] == replays + 1
    # batch 2 was evicted: it warms up again before it is captured again.
    uncaptured = loaded.stats["uncaptured_runs"]
    assert torch.equal(loaded(x_of(2, 7)), plain(x_of(2, 7)))
    assert loaded.stats["uncaptured_runs"] == uncaptured + 1 and loaded.stats["captures"] == 3
    assert ("drain",) in backend.events  # the evicted capture's last replay was waited for


def test_cuda_graphs_false_turns_capture_off(graph: StoredCompiledGraph, weights: dict[str, Any]) -> None:
    backend = RecordingBackend()
    loaded = graph.load(weights, capture_backend=backend, cuda_graphs=False)
    for _ in range(5):
        loaded(x_of(4))
    assert backend.events == [] and not loaded.cuda_graphs
    assert loaded.cuda_graphs_reason == "cuda_graphs=False"
    assert loaded.stats["uncaptured_runs"] == 5 and loaded.stats["fallbacks"] == 0


def test_the_environment_turns_capture_off_unless_the_argument_says_otherwise(
    graph: StoredCompiledGraph, weights: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_CUDA_GRAPHS, "0")
    backend = RecordingBackend()
    loaded = graph.load(weights, capture_backend=backend)
    for _ in range(4):
        loaded(x_of(4))
    assert backend.events == [] and loaded.cuda_graphs_reason == f"{ENV_CUDA_GRAPHS} is off"
    assert graph.load(weights, capture_backend=backend, cuda_graphs=True).cuda_graphs
    monkeypatch.setenv(ENV_CUDA_GRAPHS, "maybe")
    refused_binding("run.option_invalid", graph.load, weights, capture_backend=backend)


def test_the_environment_sets_max_captures_unless_the_argument_says_otherwise(
    graph: StoredCompiledGraph, weights: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_MAX_CAPTURES, "1")
    loaded = graph.load(weights, capture_backend=RecordingBackend())
    for batch in (1, 2):
        for i in range(3):
            loaded(x_of(batch, i))
    assert loaded.stats["evictions"] == 1
    loaded = graph.load(weights, capture_backend=RecordingBackend(), max_captures=2)
    for batch in (1, 2):
        for i in range(3):
            loaded(x_of(batch, i))
    assert loaded.stats["evictions"] == 0 and loaded.stats["captures"] == 2
    for bad in ("-1", "many"):
        monkeypatch.setenv(ENV_MAX_CAPTURES, bad)
        refused_binding("run.option_invalid", graph.load, weights, capture_backend=RecordingBackend())


def test_max_captures_zero_never_captures(graph: StoredCompiledGraph, weights: dict[str, Any]) -> None:
    backend = RecordingBackend()
    loaded = graph.load(weights, capture_backend=backend, max_captures=0)
    for _ in range(4):
        loaded(x_of(4))
    assert backend.events == [] and not loaded.cuda_graphs and loaded.cuda_graphs_reason == "max_captures is 0"


@pytest.mark.parametrize(
    "options",
    [
        {"max_captures": -1},
        {"max_captures": True},
        {"max_captures": 2.0},
        {"cuda_graph_outputs": "borrowed"},
        {"cuda_graphs": "yes"},
    ],
)
def test_invalid_options_are_refused(
    graph: StoredCompiledGraph, weights: dict[str, Any], options: dict[str, Any]
) -> None:
    refused_binding("run.option_invalid", graph.load, weights, **options)


def test_a_graph_that_calls_the_proxy_executor_runs_uncaptured(
    graph: StoredCompiledGraph,
    weights: dict[str, Any],
    plain: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = [{"call": "aoti_torch_proxy_executor_call_function", "count": 1, "target": "mylib::op"}]
    monkeypatch.setattr(_Stored, "native_unsupported_calls", property(lambda self: calls))
    backend = RecordingBackend()
    with caplog.at_level(logging.DEBUG, logger="torch_compiled_graphs"):
        loaded = graph.load(weights, capture_backend=backend)
    for i in range(4):
        assert torch.equal(loaded(x_of(4, i)), plain(x_of(4, i)))
    assert backend.events == [] and not loaded.cuda_graphs
    assert "proxy executor" in str(loaded.cuda_graphs_reason)
    assert loaded.stats["fallbacks"] == 1 and loaded.stats["uncaptured_runs"] == 4
    assert any("CUDA graphs off" in r.getMessage() and "proxy executor" in r.getMessage() for r in caplog.records)


def test_a_failing_capture_falls_back_to_uncaptured_runs(
    graph: StoredCompiledGraph, weights: dict[str, Any], plain: Any, caplog: pytest.LogCaptureFixture
) -> None:
    backend = RecordingBackend(fail=RuntimeError("operation not permitted when stream is capturing"))
    loaded = graph.load(weights, capture_backend=backend)
    with caplog.at_level(logging.DEBUG, logger="torch_compiled_graphs"):
        for i in range(6):
            assert torch.equal(loaded(x_of(4, i)), plain(x_of(4, i)))
    assert kinds(backend) == ["pool", "capture failed"]  # tried once, then never again
    assert not loaded.cuda_graphs and "not permitted when stream is capturing" in str(loaded.cuda_graphs_reason)
    assert loaded.stats["fallbacks"] == 1 and loaded.stats["captures"] == 0 and loaded.stats["uncaptured_runs"] == 6
    assert any("capture of shape set [float32[4, 16]] failed" in r.getMessage() for r in caplog.records)


def test_after_a_fallback_calls_still_run_one_at_a_time(graph: StoredCompiledGraph, weights: dict[str, Any]) -> None:
    # The container was made single-threaded for capture: giving up capture must
    # not let calls from several threads into it at once.
    loaded = graph.load(weights, capture_backend=RecordingBackend(fail=RuntimeError("capture failed")))
    for i in range(3):
        loaded(x_of(4, i))
    assert not loaded.cuda_graphs
    run = loaded._capture._run
    state = {"inside": 0, "most": 0}
    guard = threading.Lock()

    def watched(tensors: list[torch.Tensor]) -> Any:
        with guard:
            state["inside"] += 1
            state["most"] = max(state["most"], state["inside"])
        time.sleep(0.002)
        try:
            return run(tensors)
        finally:
            with guard:
                state["inside"] -= 1

    loaded._capture._run = watched
    threads = [threading.Thread(target=lambda: [loaded(x_of(4, i)) for i in range(5)]) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert state["most"] == 1


class _Loader:
    """torch's package loader with its change of constants watched."""

    def __init__(self, loader: Any, log: list[tuple[str, float, float]]) -> None:
        self._loader, self._log = loader, log

    def load_constants(self, *args: Any) -> Any:
        start = time.perf_counter()
        time.sleep(0.003)
        try:
            return self._loader.load_constants(*args)
        finally:
            self._log.append(("bind", start, time.perf_counter()))


def test_rebind_never_changes_constants_while_a_call_runs(graph: StoredCompiledGraph, weights: dict[str, Any]) -> None:
    loaded = graph.load(weights, capture_backend=RecordingBackend())
    log: list[tuple[str, float, float]] = []
    run = loaded._capture._run

    def watched(tensors: list[torch.Tensor]) -> Any:
        start = time.perf_counter()
        time.sleep(0.003)
        try:
            return run(tensors)
        finally:
            log.append(("run", start, time.perf_counter()))

    loaded._capture._run = watched
    loaded._loader = _Loader(loaded._loader, log)
    halves = {k: v * 0.5 for k, v in weights.items()}
    caller = threading.Thread(target=lambda: [loaded(x_of(1 + i % 2, i)) for i in range(30)])
    caller.start()
    for i in range(10):
        loaded.rebind(halves if i % 2 else weights)
    caller.join()
    binds = [(a, b) for kind, a, b in log if kind == "bind"]
    runs = [(a, b) for kind, a, b in log if kind == "run"]
    assert len(binds) == 10 and len(runs) >= 30
    assert [(r, b) for r in runs for b in binds if r[0] < b[1] and b[0] < r[1]] == []


def test_calls_inside_a_capture_of_the_callers_own_run_uncaptured(
    graph: StoredCompiledGraph, weights: dict[str, Any], plain: Any
) -> None:
    backend = RecordingBackend()
    loaded = graph.load(weights, capture_backend=backend)
    for i in range(3):
        loaded(x_of(4, i))
    events = list(backend.events)
    backend.outer = True
    for i in range(4):
        assert torch.equal(loaded(x_of(4, 10 + i)), plain(x_of(4, 10 + i)))
    assert backend.events == events and loaded.stats["uncaptured_runs"] == WARMUP_RUNS + 4
    backend.outer = False
    loaded(x_of(4, 20))
    assert kinds(backend)[-1] == "replay"


def test_rebind_drops_the_captures_and_warms_up_again(
    graph: StoredCompiledGraph, weights: dict[str, Any], plain: Any
) -> None:
    backend = RecordingBackend()
    loaded = graph.load(weights, capture_backend=backend)
    generation = loaded.binding_generation
    for i in range(3):
        loaded(x_of(4, i))
    assert loaded.stats["captures"] == 1
    other = {k: v * 0.5 for k, v in weights.items()}
    loaded.rebind(other)
    assert loaded.binding_generation == generation + 1
    assert ("drain",) in backend.events  # the last replay was waited for before the constants changed
    reference = graph.load(other, cuda_graphs=False)
    for i in range(WARMUP_RUNS):
        assert torch.equal(loaded(x_of(4, i)), reference(x_of(4, i)))
    stats = loaded.stats
    assert stats["invalidated"] == 1 and stats["captures"] == 1 and stats["uncaptured_runs"] == 2 * WARMUP_RUNS
    assert torch.equal(loaded(x_of(4, 7)), reference(x_of(4, 7)))
    assert loaded.stats["captures"] == 2
    assert not torch.equal(reference(x_of(4, 7)), plain(x_of(4, 7)))


def test_outputs_are_the_callers_own_by_default(
    graph: StoredCompiledGraph, weights: dict[str, Any], plain: Any
) -> None:
    loaded = graph.load(weights, capture_backend=RecordingBackend())
    for i in range(3):
        loaded(x_of(4, i))
    first = loaded(x_of(4, 10))
    second = loaded(x_of(4, 11))
    assert first.data_ptr() != second.data_ptr()
    assert torch.equal(first, plain(x_of(4, 10))) and torch.equal(second, plain(x_of(4, 11)))


def test_a_replayed_output_keeps_the_layout_the_uncaptured_run_returns() -> None:
    """A graph returns views as eager does (a transposed view, a slice with gaps, an
    expanded column, a permuted reshape); the copy a replay hands back has the same
    strides and values in new memory (clone() would compact the last three)."""
    from torch_compiled_graphs.capture import _copy

    y = torch.randn(3, 48)
    views = [y.t(), y[:, ::2], y[:, :1].expand(-1, 5), y.view(-1, 6, 8).transpose(1, 2), y[1:, 3:], y]
    for view in views:
        copied = _copy(view)
        assert copied.stride() == view.stride() and torch.equal(copied, view)
        assert copied.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
    empty = _copy(torch.empty(0, 4))
    assert empty.shape == (0, 4)


def test_static_outputs_are_the_graphs_buffers_until_its_next_call(
    graph: StoredCompiledGraph, weights: dict[str, Any], plain: Any
) -> None:
    loaded = graph.load(weights, capture_backend=RecordingBackend(), cuda_graph_outputs="static")
    for i in range(3):
        loaded(x_of(4, i))
    first = loaded(x_of(4, 10))
    assert torch.equal(first, plain(x_of(4, 10)))
    second = loaded(x_of(4, 11))
    assert first.data_ptr() == second.data_ptr()
    assert torch.equal(first, plain(x_of(4, 11)))  # overwritten by the next call, as documented


def test_static_outputs_for_the_calls_of_a_block(
    graph: StoredCompiledGraph, weights: dict[str, Any], plain: Any
) -> None:
    loaded = graph.load(weights, capture_backend=RecordingBackend())
    for i in range(3):
        loaded(x_of(4, i))
    with loaded.static_outputs():
        first = loaded(x_of(4, 10))
        second = loaded(x_of(4, 11))
    assert first.data_ptr() == second.data_ptr() and torch.equal(first, plain(x_of(4, 11)))
    third = loaded(x_of(4, 12))
    assert third.data_ptr() != second.data_ptr() and torch.equal(third, plain(x_of(4, 12)))


def test_a_cpu_graph_never_captures_by_default(
    graph: StoredCompiledGraph, weights: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_CUDA_GRAPHS, "1")
    loaded = graph.load(weights)
    for _ in range(4):
        loaded(x_of(4))
    assert not loaded.cuda_graphs and loaded.cuda_graphs_reason == "a cpu graph has no CUDA graphs"
    assert loaded.stats == {
        "captures": 0,
        "replays": 0,
        "evictions": 0,
        "invalidated": 0,
        "fallbacks": 0,
        "capture_seconds": 0.0,
        "uncaptured_runs": 4,
    }


def test_callers_on_several_threads_each_get_their_own_results(
    graph: StoredCompiledGraph, weights: dict[str, Any], plain: Any
) -> None:
    loaded = graph.load(weights, capture_backend=RecordingBackend())
    inputs = {(t, i): x_of(1 + (t + i) % 3, 10 * t + i) for t in range(4) for i in range(25)}
    expected = {k: plain(x) for k, x in inputs.items()}
    wrong: list[tuple[int, int]] = []
    start = threading.Barrier(4)

    def worker(t: int) -> None:
        start.wait()
        for i in range(25):
            if not torch.equal(loaded(inputs[(t, i)]), expected[(t, i)]):
                wrong.append((t, i))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert wrong == []
    assert loaded.stats["captures"] == 3 and loaded.stats["replays"] + loaded.stats["uncaptured_runs"] == 100


def test_captures_are_logged(
    graph: StoredCompiledGraph, weights: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    loaded = graph.load(weights, capture_backend=RecordingBackend(), max_captures=1)
    with caplog.at_level(logging.DEBUG, logger="torch_compiled_graphs"):
        for batch in (1, 2):
            for i in range(3):
                loaded(x_of(batch, i))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "captured shape set [float32[1, 16]]" in text and "(1 of at most 1 captured)" in text
    assert "evicted the capture of shape set [float32[1, 16]] (max_captures 1)" in text


def test_the_cuda_backend_allocates_nothing_until_its_first_capture() -> None:
    """Loading must not fail for capture's sake: on a device too full for a stream
    (the filled-device test on the GPU machine) load() refuses or binds with its own
    typed errors, and a capture that cannot start falls back. Here, without CUDA,
    making the backend touches no device at all."""
    import torch

    from torch_compiled_graphs.capture import CudaGraphBackend

    backend = CudaGraphBackend(torch.device("cuda", 0))
    assert backend._stream is None


# -- load_native: CUDA graphs through tcg_run::capture ---------------------------------
# The capture itself needs a GPU (tests/test_cuda_graphs.py); what does not is here:
# the options, their refusals, a CPU graph, and the allocator choice made before libtorch
# opens, each in a fresh process where it matters.


def test_load_native_cpu_graph_never_captures(graph: StoredCompiledGraph, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_CUDA_GRAPHS, "1")
    native = graph.load_native(REFERENCE / "mlp-cpu.weights.safetensors")
    for _ in range(4):
        native(x_of(4).numpy())
    assert not native.cuda_graphs and native.cuda_graphs_reason == "a cpu graph has no CUDA graphs"
    assert native.stats == {
        "captures": 0,
        "replays": 0,
        "evictions": 0,
        "invalidated": 0,
        "fallbacks": 0,
        "capture_seconds": 0.0,
        "uncaptured_runs": 0,
        "captured": 0,
    }


@pytest.mark.parametrize(
    ("options", "env"),
    [
        ({"cuda_graphs": "yes"}, {}),
        ({"cuda_graphs": 1}, {}),
        ({"max_captures": -1}, {}),
        ({"max_captures": True}, {}),
        ({}, {ENV_CUDA_GRAPHS: "maybe"}),
        ({}, {ENV_MAX_CAPTURES: "eight"}),
        ({"cuda_graph_outputs": "borrowed"}, {}),
        ({"cuda_graph_outputs": None}, {}),
    ],
)
def test_load_native_refuses_invalid_options(
    graph: StoredCompiledGraph, monkeypatch: pytest.MonkeyPatch, options: dict[str, Any], env: dict[str, str]
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    refused_binding("run.option_invalid", graph.load_native, REFERENCE / "mlp-cpu.weights.safetensors", **options)


def test_load_native_options_win_over_the_environment(
    graph: StoredCompiledGraph, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch_compiled_graphs.native import _capture_options

    monkeypatch.setenv(ENV_CUDA_GRAPHS, "0")
    monkeypatch.setenv(ENV_MAX_CAPTURES, "3")
    assert _capture_options(None, None) == (False, 3, f"{ENV_CUDA_GRAPHS} is off")
    assert _capture_options(True, 5) == (True, 5, None)
    assert _capture_options(False, None) == (False, 3, "cuda_graphs=False")
    monkeypatch.delenv(ENV_CUDA_GRAPHS)
    assert _capture_options(None, 0) == (False, 0, "max_captures is 0")
    assert _capture_options(None, None) == (True, 3, None)


def test_static_outputs_of_an_uncaptured_graph_are_new_tensors(graph: StoredCompiledGraph) -> None:
    """Static outputs change only what a replay hands back: a CPU graph (never
    captured) returns new tensors under either mode, equal to each other and kept
    across calls; the block's thread-local request is undone on exit."""
    import numpy as np

    weights = REFERENCE / "mlp-cpu.weights.safetensors"
    native = graph.load_native(weights, cuda_graph_outputs="static")
    copying = graph.load_native(weights)
    xa = x_of(4).numpy()
    xb = xa * 2
    a = np.asarray(native(xa)).copy()
    held = native(xa)
    native(xb)
    assert np.array_equal(np.asarray(held), a)
    with copying.static_outputs():
        assert getattr(copying._local, "static", None) is True
        assert np.array_equal(np.asarray(copying(xa)), a)
    assert not hasattr(copying._local, "static")
    assert np.array_equal(np.asarray(copying(xa)), a)


ALLOCATOR_CHILD = """
import ctypes, json, sys
if sys.argv[1] == "torch-first":
    import torch  # loads libtorch's CUDA allocator with its default configuration
from torch_compiled_graphs import _native
got = _native.prepare_capture_allocator(sys.argv[2] == "on", 8)
# The process's environment as libtorch reads it (C getenv, not Python's snapshot).
libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p
value = libc.getenv(b"PYTORCH_CUDA_ALLOC_CONF")
print(json.dumps({"got": got, "env": value.decode() if value is not None else None}))
"""


def _allocator_child(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    import json
    import os
    import subprocess
    import sys

    child_env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    child_env.update(env or {})
    out = subprocess.run(
        [sys.executable, "-c", ALLOCATOR_CHILD, *args], capture_output=True, text=True, env=child_env, check=True
    )
    got: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return got


def test_captures_choose_the_stream_ordered_allocator_before_libtorch_loads() -> None:
    # Nothing chose an allocator and libtorch's CUDA library is not loaded: chosen.
    assert _allocator_child("fresh", "on") == {"got": [True, None], "env": "backend:cudaMallocAsync"}
    # Captures off: the process keeps libtorch's default.
    off = _allocator_child("fresh", "off")
    assert off["got"][0] is False and off["env"] is None


def test_an_allocator_someone_chose_is_kept() -> None:
    mine = _allocator_child("fresh", "on", env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert mine["got"][0] is False and "without a backend" in mine["got"][1]
    assert mine["env"] == "expandable_segments:True"
    generic = _allocator_child("fresh", "on", env={"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"})
    assert generic["got"] == [True, None] and generic["env"] is None


def test_libtorch_loaded_first_keeps_its_allocator() -> None:
    # torch imported first loaded libtorch's CUDA allocator with the default: too late
    # to choose, and captures on the native path report why instead.
    late = _allocator_child("torch-first", "on")
    assert late["got"][0] is False and late["env"] is None
