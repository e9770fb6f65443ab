"""CUDA-graph capture and replay of ``load()`` on a GPU (docs/run.md, "CUDA graphs").

Every captured call is compared bit for bit with the same graph loaded with
``cuda_graphs=False``: over dynamic batch sizes, across a rebind, with two graphs
and two threads, under eviction, with static outputs fed back in, on a caller
stream of its own, and after a capture that fails. One mint for the module.

Needs a CUDA device; skipped without one. ``scripts/cuda_e2e.py`` runs it.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_compiled_graphs import Engine, GraphClassSpec, RuntimeCompatibility, record_toolchain
from torch_compiled_graphs.capture import ENV_CUDA_GRAPHS, WARMUP_RUNS

# The suite's small graph (64 -> 64, so outputs feed back as inputs) and its target.
from .test_cuda import Net, device_sm

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


# The store each minted key lives in (for the torch-free child processes).
_STORES: dict[str, Path] = {}


def weights_of(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in Net().cuda().eval().state_dict().items()}


@pytest.fixture(scope="module")
def minted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One real CUDA mint for the module: the resolved graph."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("cuda-graphs")
    net = Net().cuda().eval()
    x = torch.randn(8, 64, device="cuda")
    program = torch.export.export(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},))
    spec = GraphClassSpec("cuda/net-graphs", "cuda-tests", program)
    toolchain = record_toolchain()
    key = RuntimeCompatibility(device_sm(), toolchain=toolchain).key(spec.declare())
    result = Engine(root / "store").ensure(
        key, root / "graph", target=device_sm(), toolchain=toolchain, recipe=lambda: spec
    )
    _STORES[result.compiled_graph.key] = root / "store"
    return result.compiled_graph


def x_of(batch: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed * 1000 + batch)
    return torch.randn(batch, 64, device="cuda", generator=g)


def captured(loaded: Any, x: torch.Tensor) -> None:
    """Call until the shape set of ``x`` is captured."""
    for _ in range(WARMUP_RUNS + 1):
        loaded(x)


@pytest.mark.real_aoti
def test_captured_calls_equal_uncaptured_runs_bit_for_bit_over_dynamic_batches(minted: Any) -> None:
    w = weights_of(1)
    plain = minted.load(w, cuda_graphs=False)
    loaded = minted.load(w)
    assert loaded.cuda_graphs and not plain.cuda_graphs
    for batch in range(1, 9):
        for i in range(WARMUP_RUNS + 3):
            x = x_of(batch, i)
            assert torch.equal(loaded(x), plain(x)), (batch, i)
    stats = loaded.stats
    assert stats["captures"] == 8 and stats["evictions"] == 0 and stats["fallbacks"] == 0
    assert stats["replays"] == 8 * 3 and stats["uncaptured_runs"] == 8 * WARMUP_RUNS


@pytest.mark.real_aoti
def test_capture_takes_a_bounded_time(minted: Any) -> None:
    loaded = minted.load(weights_of(1))
    captured(loaded, x_of(4))
    # A capture is one uncaptured run on the capture stream and the capture itself:
    # milliseconds for this graph; seconds would mean it waits on something.
    assert 0 < loaded.timings["capture"] < 2.0
    assert loaded.stats["capture_seconds"] == loaded.timings["capture"]


@pytest.mark.real_aoti
def test_rebind_drops_the_captures_and_replays_read_the_new_weights(minted: Any) -> None:
    w1, w2 = weights_of(1), weights_of(2)
    loaded = minted.load(w1)
    x = x_of(5)
    captured(loaded, x)
    generation = loaded.binding_generation
    loaded.rebind(w2)
    assert loaded.binding_generation == generation + 1
    plain2 = minted.load(w2, cuda_graphs=False)
    for i in range(WARMUP_RUNS + 3):
        assert torch.equal(loaded(x_of(5, i)), plain2(x_of(5, i)))
    assert loaded.stats["invalidated"] == 1 and loaded.stats["captures"] == 2
    del w1  # the first weights are gone: no capture may still read them
    torch.cuda.empty_cache()
    assert torch.equal(loaded(x), plain2(x))


@pytest.mark.real_aoti
def test_replays_read_weights_changed_in_place(minted: Any, tmp_path: Path) -> None:
    # Bound from a checkpoint, the container reads the graph's own allocation in
    # place: a change of values there keeps the generation, and replays see it.
    from safetensors.torch import save_file

    w = weights_of(1)
    path = tmp_path / "w.safetensors"
    save_file({k: v.cpu() for k, v in w.items()}, str(path))
    loaded = minted.load(path)
    x = x_of(4)
    captured(loaded, x)
    generation = loaded.binding_generation
    with torch.no_grad():
        loaded._bound["l1.weight"].mul_(0.5)
    changed = dict(w, **{"l1.weight": w["l1.weight"] * 0.5})
    y = loaded(x)
    assert loaded.binding_generation == generation and loaded.stats["invalidated"] == 0
    assert torch.equal(y, minted.load(changed, cuda_graphs=False)(x))
    assert loaded.stats["replays"] == 2


@pytest.mark.real_aoti
def test_two_graphs_in_one_process_keep_their_own_captures(minted: Any) -> None:
    a, b = minted.load(weights_of(1)), minted.load(weights_of(2))
    plain_a, plain_b = minted.load(weights_of(1), cuda_graphs=False), minted.load(weights_of(2), cuda_graphs=False)
    for i in range(WARMUP_RUNS + 4):
        x = x_of(3, i)
        assert torch.equal(a(x), plain_a(x)) and torch.equal(b(x), plain_b(x))
    assert a.stats["captures"] == b.stats["captures"] == 1


@pytest.mark.real_aoti
def test_callers_on_two_threads_with_their_own_streams_get_their_own_results(minted: Any) -> None:
    w = weights_of(1)
    loaded, plain = minted.load(w), minted.load(w, cuda_graphs=False)
    inputs = {(t, i): x_of(1 + (t + i) % 3, 10 * t + i) for t in range(2) for i in range(40)}
    expected = {k: plain(x) for k, x in inputs.items()}
    torch.cuda.synchronize()
    wrong: list[tuple[int, int]] = []
    start = threading.Barrier(2)

    def worker(t: int) -> None:
        stream = torch.cuda.Stream()
        start.wait()
        with torch.cuda.stream(stream):
            for i in range(40):
                y = loaded(inputs[(t, i)])
                stream.synchronize()
                if not torch.equal(y, expected[(t, i)]):
                    wrong.append((t, i))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert wrong == []
    assert loaded.stats["captures"] == 3 and loaded.stats["fallbacks"] == 0


@pytest.mark.real_aoti
def test_eviction_keeps_results_exact(minted: Any) -> None:
    w = weights_of(1)
    loaded, plain = minted.load(w, max_captures=2), minted.load(w, cuda_graphs=False)
    for i in range(6):
        for batch in (1, 2, 3):
            x = x_of(batch, i)
            assert torch.equal(loaded(x), plain(x)), (batch, i)
    assert loaded.stats["evictions"] >= 1 and loaded.stats["captures"] >= 3


@pytest.mark.real_aoti
def test_static_outputs_fed_back_as_inputs(minted: Any) -> None:
    w = weights_of(1)
    loaded, plain = minted.load(w, cuda_graph_outputs="static"), minted.load(w, cuda_graphs=False)
    x = x_of(6)
    captured(loaded, x)
    y = loaded(x)
    z = loaded(y)  # y is the graph's output buffer, which this replay overwrites
    assert torch.equal(z, plain(plain(x)))
    assert z.data_ptr() == y.data_ptr()


@pytest.mark.real_aoti
def test_default_outputs_survive_the_next_call(minted: Any) -> None:
    w = weights_of(1)
    loaded, plain = minted.load(w), minted.load(w, cuda_graphs=False)
    captured(loaded, x_of(6))
    first = loaded(x_of(6, 1))
    second = loaded(x_of(6, 2))
    assert torch.equal(first, plain(x_of(6, 1))) and torch.equal(second, plain(x_of(6, 2)))


@pytest.mark.real_aoti
def test_a_caller_stream_other_than_the_default(minted: Any) -> None:
    w = weights_of(1)
    loaded, plain = minted.load(w), minted.load(w, cuda_graphs=False)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x = x_of(7)
        ys = [loaded(x) for _ in range(WARMUP_RUNS + 3)]
    stream.synchronize()
    assert all(torch.equal(y, plain(x)) for y in ys)
    assert loaded.stats["replays"] == 3


@pytest.mark.real_aoti
def test_a_failing_capture_falls_back_and_leaves_the_device_usable(minted: Any) -> None:
    w = weights_of(1)
    loaded, plain = minted.load(w), minted.load(w, cuda_graphs=False)
    run = loaded._capture._run

    def syncing_run(tensors: list[torch.Tensor]) -> Any:
        out = run(tensors)
        torch.cuda.synchronize()  # not permitted while the stream is captured
        return out

    loaded._capture._run = syncing_run
    x = x_of(4)
    for _ in range(WARMUP_RUNS + 3):
        assert torch.equal(loaded(x), plain(x))
    assert not loaded.cuda_graphs and loaded.stats["fallbacks"] == 1 and loaded.stats["captures"] == 0
    assert "capture" in str(loaded.cuda_graphs_reason)
    # The stream, the allocator and capture itself still work.
    assert float(torch.ones(1000, device="cuda").sum().item()) == 1000.0
    other = minted.load(w)
    captured(other, x)
    assert other.stats["captures"] == 1 and torch.equal(other(x), plain(x))


@pytest.mark.real_aoti
def test_a_call_inside_the_callers_own_capture_is_captured_by_it(minted: Any) -> None:
    w = weights_of(1)
    loaded, plain = minted.load(w), minted.load(w, cuda_graphs=False)
    static_x = x_of(4).clone()
    captured(loaded, static_x)
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        y = loaded(static_x)  # runs the container into the caller's capture
    for i in range(3):
        static_x.copy_(x_of(4, 10 + i))
        outer.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, plain(x_of(4, 10 + i)))
    assert loaded.cuda_graphs and loaded.stats["fallbacks"] == 0


@pytest.mark.real_aoti
def test_the_environment_turns_capture_off_on_a_gpu(minted: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_CUDA_GRAPHS, "0")
    loaded = minted.load(weights_of(1))
    captured(loaded, x_of(2))
    assert not loaded.cuda_graphs and loaded.stats["captures"] == 0


# -- load_native: captures through tcg_run::capture, in a process without torch --------
# The pytest process has torch (and its CUDA allocator) loaded already, so the native
# path is exercised where it is used: a fresh process that never imports torch before
# load_native, so that the stream-ordered allocator captures need is chosen for it.

NATIVE_CHILD = r"""
import json, sys, threading
import numpy as np
from torch_compiled_graphs import Engine

store, key, dest, w1, w2 = sys.argv[1:6]
g = Engine(store).resolve(key, dest)
on = g.load_native(w1, device="cuda:0")
off = g.load_native(w1, device="cuda:0", cuda_graphs=False)
out = {"on": on.cuda_graphs, "reason": on.cuda_graphs_reason, "off_reason": off.cuda_graphs_reason}
WARM = 2

def x_of(batch, seed=0):
    return np.random.default_rng(seed * 1000 + batch).standard_normal((batch, 64), dtype=np.float32)

def host(t):
    return np.asarray(t.cpu())

def same(a, b):
    return bool(np.array_equal(host(a), host(b)))

# 1. dynamic batches: every call equal to the uncaptured graph's, bit for bit.
out["batches_equal"] = all(same(on(x_of(b, i)), off(x_of(b, i))) for b in range(1, 9) for i in range(WARM + 3))
out["stats_batches"] = on.stats
out["capture_s"] = on.timings.get("capture")
# 2. device inputs (DLPack of our own outputs) after capture, fed back in.
y_on, y_off = on(x_of(3)), off(x_of(3))
out["device_inputs_equal"] = all(same(on(y_on), off(y_off)) for _ in range(WARM + 2))
# 3. a call's outputs survive the next call.
a = on(x_of(4, 7))
b = on(x_of(4, 8))
out["outputs_survive"] = same(a, off(x_of(4, 7))) and same(b, off(x_of(4, 8)))
# 4. rebind: captures dropped, replays read the new weights.
before = on.stats["captured"]
on.rebind(w2)
off.rebind(w2)
out["rebind_equal"] = all(same(on(x_of(5, i)), off(x_of(5, i))) for i in range(WARM + 3))
out["invalidated"] = on.stats["invalidated"] - 0
out["captured_before_rebind"] = before
# 5. two threads, interleaved shape sets.
inputs = {(t, i): x_of(1 + (t + i) % 3, 10 * t + i) for t in range(2) for i in range(30)}
expected = {k: host(off(x)) for k, x in inputs.items()}
wrong = []
start = threading.Barrier(2)
def worker(t):
    start.wait()
    for i in range(30):
        if not np.array_equal(host(on(inputs[(t, i)])), expected[(t, i)]):
            wrong.append((t, i))
threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
for th in threads: th.start()
for th in threads: th.join()
out["threads_wrong"] = wrong
# 5b. static outputs: a replay hands back the capture's buffers (no copy), equal to
# the uncaptured run and overwritten by the next call; copies are never overwritten.
xa, xb = x_of(6, 1), x_of(6, 2)
for _ in range(WARM + 1):
    on(xa)
kept = on(xa)
with on.static_outputs():
    s1 = on(xa)
    s1_values = host(s1)
    s2 = on(xb)
out["static_equal"] = bool(np.array_equal(s1_values, host(off(xa)))) and same(s2, off(xb))
out["static_overwritten"] = bool(np.array_equal(host(s1), host(off(xb))))
out["copy_kept"] = same(kept, off(xa)) and same(on(xa), off(xa))
static = g.load_native(w2, device="cuda:0", cuda_graph_outputs="static")
for _ in range(WARM + 1):
    static(xa)
t1 = static(xa)
t1_values = host(t1)
static(xb)
out["static_option"] = bool(np.array_equal(t1_values, host(off(xa)))) and same(t1, off(xb))
# 6. eviction under a bound of 2.
small = g.load_native(w2, device="cuda:0", max_captures=2)
out["evict_equal"] = all(same(small(x_of(b, i)), off(x_of(b, i))) for i in range(6) for b in (1, 2, 3))
out["stats_evict"] = small.stats
# 7. torch imported afterwards shares the allocator the native path chose.
import torch
out["torch_backend"] = torch.cuda.get_allocator_backend()
print(json.dumps(out))
"""


@pytest.mark.real_aoti
def test_load_native_replays_captures_equal_to_uncaptured_runs(minted: Any, tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    import sys

    from safetensors.torch import save_file

    w1, w2 = tmp_path / "w1.safetensors", tmp_path / "w2.safetensors"
    save_file(weights_of(1), str(w1))
    save_file(weights_of(2), str(w2))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    env.pop(ENV_CUDA_GRAPHS, None)
    argv = [sys.executable, "-c", NATIVE_CHILD, str(_STORES[minted.key]), minted.key, str(tmp_path / "g")]
    proc = subprocess.run([*argv, str(w1), str(w2)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["on"] is True and got["reason"] is None, got
    assert got["off_reason"] == "cuda_graphs=False"
    assert got["batches_equal"] is True
    stats = got["stats_batches"]
    assert stats["captures"] == 8 and stats["replays"] == 8 * 3 and stats["uncaptured_runs"] == 8 * WARMUP_RUNS
    assert stats["fallbacks"] == 0 and stats["captured"] == 8
    assert 0 < got["capture_s"] < 2.0
    assert got["device_inputs_equal"] is True and got["outputs_survive"] is True
    assert got["rebind_equal"] is True and got["invalidated"] == got["captured_before_rebind"] > 0
    assert got["threads_wrong"] == []
    assert got["static_equal"] is True and got["static_overwritten"] is True and got["copy_kept"] is True
    assert got["static_option"] is True
    assert got["evict_equal"] is True and got["stats_evict"]["evictions"] > 0
    assert got["stats_evict"]["captured"] == 2
    assert got["torch_backend"] == "cudaMallocAsync"
