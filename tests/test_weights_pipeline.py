"""The weights pipeline on the CPU, on the 0.2.0 reference artifact (no compile):
what ``load_native`` and ``load(path)`` read, the phases they report, and the
refusals of files that are truncated, changed, of the wrong dtype or shape,
each in a fresh process where a crash would show."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .conftest import REFERENCE_WEIGHTS, refused_binding

PHASES = {
    "open_libraries",
    "extract_package",
    "open_model",
    "create_container",
    "plan_weights",
    "allocate_weights",
    "read_weights",
    "copy_weights",
    "bind_weights",
}


@pytest.fixture(scope="module")
def tensors() -> dict[str, Any]:
    from safetensors.numpy import load_file

    return dict(load_file(REFERENCE_WEIGHTS))


def test_load_native_reports_every_phase_and_logs_them(
    graph: Any, io: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="torch_compiled_graphs"):
        native = graph.load_native(REFERENCE_WEIGHTS)
        assert PHASES | {"load_total"} <= set(native.timings)
        assert "first_call" not in native.timings
        out = np.asarray(native(io["x"]))
    np.testing.assert_array_equal(out, np.asarray(graph.load_native(REFERENCE_WEIGHTS)(io["x"])))
    assert all(v >= 0 for v in native.timings.values())
    assert native.timings["first_call"] > 0
    # The phases overlap (weights beside libraries), so the wall time is at most their sum.
    assert native.timings["load_total"] <= sum(native.timings[k] for k in PHASES) + 0.05
    messages = [r.getMessage() for r in caplog.records if r.name == "torch_compiled_graphs"]
    assert any(m.startswith(f"load_native {graph.key}: ") and "read_weights" in m for m in messages), messages
    assert any(m.startswith(f"first call of {graph.key}") for m in messages), messages


def test_load_from_a_path_reads_through_the_pipeline_and_matches_load_native(
    graph: Any, io: dict[str, Any], tensors: dict[str, Any], tmp_path: Path
) -> None:
    import torch
    from safetensors.numpy import save_file

    # Unaligned neighbours (an odd-sized extra tensor between them) and a prefix.
    shuffled = {"unet." + k: v for k, v in tensors.items()}
    shuffled["other.odd"] = np.arange(3, dtype=np.int8)
    save_file(shuffled, str(tmp_path / "pipe.safetensors"))
    loaded = graph.load(tmp_path / "pipe.safetensors", strip_prefix="unet.")
    assert {"create_container", "read_weights", "bind_weights"} <= set(loaded.timings)
    assert loaded.outside_prefix == 1
    want = np.asarray(graph.load_native(REFERENCE_WEIGHTS)(io["x"]))
    got = loaded(torch.from_numpy(io["x"])).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert "first_call" in loaded.timings
    # Every bound constant is a view of one allocation the graph keeps.
    storages = {t.untyped_storage().data_ptr() for t in loaded._bound.values()}
    assert len(storages) == 1


def _rewrite_header(path: Path, edit: Any) -> None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])


@pytest.mark.parametrize("path", ["load_native", "load"])
def test_truncated_and_mistyped_files_are_refused_with_a_code(
    graph: Any, tensors: dict[str, Any], tmp_path: Path, path: str
) -> None:
    from safetensors.numpy import save_file

    load = graph.load_native if path == "load_native" else graph.load
    good = tmp_path / "good.safetensors"
    save_file(tensors, str(good))
    # Truncated: the last tensor's bytes are cut short.
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-5])
    err = refused_binding("run.weights_invalid", load, cut)
    assert "truncated" in str(err)
    # Longer than its header says.
    long = tmp_path / "long.safetensors"
    long.write_bytes(good.read_bytes() + b"\0" * 16)
    refused_binding("run.weights_invalid", load, long)
    # A header that lies about a dtype (same byte count: int32 for float32).
    first = sorted(tensors)[0]
    lied = tmp_path / "dtype.safetensors"
    lied.write_bytes(good.read_bytes())
    _rewrite_header(lied, lambda h: h[first].update(dtype="I32"))
    err = refused_binding("run.constant_mismatch", load, lied)
    assert first in str(err)
    # Same bytes, another shape.
    matrix = next(k for k in sorted(tensors) if tensors[k].ndim >= 2)
    reshaped = dict(tensors)
    reshaped[matrix] = tensors[matrix].reshape(-1)
    save_file(reshaped, str(tmp_path / "shape.safetensors"))
    refused_binding("run.constant_mismatch", load, tmp_path / "shape.safetensors")


CHANGED = r"""
import ctypes
import os
import sys

from torch_compiled_graphs import _native
from torch_compiled_graphs.errors import BindingError

weights, mode = sys.argv[1:3]
# Opened (headers read) first, then changed before the tensors are read.
reader = _native.CheckpointReader([weights])
names = [e[0] for e in reader.entries]
size = reader.layout_bytes(names)
buf = bytearray(size)
address = ctypes.addressof((ctypes.c_char * size).from_buffer(buf))
if mode == "truncate":
    os.truncate(weights, os.path.getsize(weights) - 64)
else:
    os.utime(weights, ns=(1, 1))
try:
    reader.read_into(names, address, size, "cpu")
except BindingError as e:
    print("CODE", e.code)
    print(e)
    sys.exit(0)
print("NO ERROR")
sys.exit(1)
"""


@pytest.mark.parametrize("mode", ["truncate", "touch"])
def test_a_file_changed_after_it_was_opened_is_refused_in_a_fresh_process(
    tensors: dict[str, Any], tmp_path: Path, mode: str
) -> None:
    from safetensors.numpy import save_file

    weights = tmp_path / "w.safetensors"
    save_file(tensors, str(weights))
    script = tmp_path / "changed.py"
    script.write_text(CHANGED)
    done = subprocess.run(
        [sys.executable, str(script), str(weights), mode],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CODE run.weights_invalid" in done.stdout, done.stdout
    assert "changed" in done.stdout or "truncated" in done.stdout, done.stdout


def test_a_refused_rebind_leaves_the_bound_weights_in_place(
    graph: Any, io: dict[str, Any], tensors: dict[str, Any], tmp_path: Path
) -> None:
    native = graph.load_native(REFERENCE_WEIGHTS)
    want = np.asarray(native(io["x"])).copy()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(REFERENCE_WEIGHTS.read_bytes()[:-4])
    refused_binding("run.weights_invalid", native.rebind, cut)
    np.testing.assert_array_equal(np.asarray(native(io["x"])), want)
    # A good rebind from a copy: the new allocation replaces the old one.
    from safetensors.numpy import save_file

    doubled = {k: v * 2 for k, v in tensors.items()}
    save_file(doubled, str(tmp_path / "doubled.safetensors"))
    native.rebind(tmp_path / "doubled.safetensors")
    assert not np.array_equal(np.asarray(native(io["x"])), want)
    native.rebind(REFERENCE_WEIGHTS)
    np.testing.assert_array_equal(np.asarray(native(io["x"])), want)


def test_the_reader_thread_count_comes_from_the_environment(graph: Any, io: dict[str, Any]) -> None:
    want = np.asarray(graph.load_native(REFERENCE_WEIGHTS)(io["x"]))
    for threads in ("1", "3", "64", "junk"):
        os.environ["TORCH_COMPILED_GRAPHS_READ_THREADS"] = threads
        try:
            np.testing.assert_array_equal(np.asarray(graph.load_native(REFERENCE_WEIGHTS)(io["x"])), want)
        finally:
            del os.environ["TORCH_COMPILED_GRAPHS_READ_THREADS"]


def _rchar() -> int:
    """Bytes this process has read so far (every thread's ``read``/``pread``), from ``/proc/self/io``."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("/proc/self/io has no rchar")


@contextlib.contextmanager
def _fails_if_blocked(fifos: list[Path], seconds: float = 20.0) -> Iterator[None]:
    """Fails the test, rather than hanging the suite, when a FIFO of ``fifos`` is opened for
    reading and waits for a writer: past ``seconds``, a writer opens and closes each one (which
    releases a reader waiting in open or read) until the block returns."""
    done = threading.Event()
    fired: list[bool] = []

    def watchdog() -> None:
        if done.wait(seconds):
            return
        fired.append(True)
        while not done.is_set():
            for fifo in fifos:
                try:
                    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                except OSError:  # no reader has it open
                    continue
                os.close(fd)
            time.sleep(0.05)

    thread = threading.Thread(target=watchdog, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    assert not fired, f"blocked reading a FIFO for {seconds} s"


def _fifo_checkpoints(tmp_path: Path, tensors: dict[str, Any]) -> tuple[list[Path], list[Path]]:
    """Every place a FIFO can stand in a checkpoint: the file, a directory's one file, an index
    (named, and found in a directory), a shard an index names. Returns (weights paths, FIFOs)."""
    from safetensors.numpy import save_file

    fifos = [
        tmp_path / "w.safetensors",
        tmp_path / "dir" / "model.safetensors",
        tmp_path / "idx" / "model.safetensors.index.json",
        tmp_path / "shard" / "model-00001-of-00001.safetensors",
    ]
    for fifo in fifos:
        fifo.parent.mkdir(exist_ok=True)
        os.mkfifo(fifo)
    save_file(tensors, str(tmp_path / "shard" / "real.safetensors"))
    first = sorted(tensors)[0]
    weight_map = {name: "real.safetensors" for name in tensors if name != first}
    weight_map[first] = fifos[3].name
    (tmp_path / "shard" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    paths = [fifos[0], fifos[1].parent, fifos[2], fifos[2].parent, tmp_path / "shard"]
    return paths, fifos


@pytest.mark.parametrize("path", ["load_native", "load"])
def test_fifos_anywhere_in_a_checkpoint_are_refused_without_blocking(
    graph: Any, tensors: dict[str, Any], tmp_path: Path, path: str
) -> None:
    load = graph.load_native if path == "load_native" else graph.load
    paths, fifos = _fifo_checkpoints(tmp_path, tensors)
    with _fails_if_blocked(fifos):
        for weights in paths:
            err = refused_binding("run.weights_invalid", load, weights)
            assert "not a regular file" in str(err), str(err)


def _sparse(path: Path, tensors: dict[str, Any], big: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file of ``tensors`` plus, first, the ``big`` ones (name -> (dtype, shape)) as
    zeros that take no disk: the file is extended with ``truncate``, never written."""
    sizes = {"F32": 4, "F16": 2}
    header: dict[str, Any] = {}
    at = 0
    for name, (dtype, shape) in big.items():
        n = sizes[dtype] * int(np.prod(shape, dtype=object))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}
        at += n
    data = b""
    for name, value in sorted(tensors.items()):
        raw = np.ascontiguousarray(value).tobytes()
        header[name] = {"dtype": "F32", "shape": list(value.shape), "data_offsets": [at, at + len(raw)]}
        at += len(raw)
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with path.open("wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + at - len(data))
        f.seek(0, os.SEEK_END)
        f.write(data)


@pytest.mark.parametrize("path", ["load_native", "load"])
def test_a_header_of_the_wrong_shape_is_refused_before_any_data_is_read(
    graph: Any, tensors: dict[str, Any], tmp_path: Path, path: str
) -> None:
    """1 GiB and 1 TiB tensors (sparse) whose header already shows the wrong shape: refused
    with the code, with nothing allocated for them and not one of their bytes read."""
    load = graph.load_native if path == "load_native" else graph.load
    first = "l1.weight"
    rest = {k: v for k, v in tensors.items() if k != first}
    for elements in (1 << 28, 1 << 38):
        weights = tmp_path / f"wrong-{elements}.safetensors"
        _sparse(weights, rest, {first: ("F32", [elements])})
        before = _rchar()
        err = refused_binding("run.constant_mismatch", load, weights)
        assert first in str(err) and str(elements) in str(err), str(err)
        assert _rchar() - before < 64 << 20, "tensor data was read before the header was checked"


@pytest.mark.parametrize("path", ["load_native", "load"])
def test_weights_beyond_the_memory_are_refused_before_anything_is_allocated_or_read(
    graph: Any, tensors: dict[str, Any], tmp_path: Path, path: str
) -> None:
    """A graph whose constant is 1 TiB (its metadata row says so) given a 1 TiB (sparse) file of
    the right header: the capacity check refuses it, on both paths, before any allocation or read."""
    import copy

    from torch_compiled_graphs.engine import StoredCompiledGraph

    shape = [1 << 34, 16]
    metadata = copy.deepcopy(graph.metadata)
    for row in metadata["graph_class"]["constants"]:
        if row["fqn"] == "l1.weight":
            row["shape"] = shape
    huge = StoredCompiledGraph(graph.key, graph.path, metadata, graph.manifest)
    weights = tmp_path / "huge.safetensors"
    _sparse(weights, {k: v for k, v in tensors.items() if k != "l1.weight"}, {"l1.weight": ("F32", shape)})
    load = huge.load_native if path == "load_native" else huge.load
    before = _rchar()
    err = refused_binding("run.weights_too_large", load, weights)
    assert "the host" in str(err), str(err)
    assert _rchar() - before < 64 << 20


def test_the_reader_checks_capacity_and_counts_what_it_reads(tensors: dict[str, Any], tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    from torch_compiled_graphs import _native

    save_file(tensors, str(tmp_path / "w.safetensors"))
    reader = _native.CheckpointReader([str(tmp_path / "w.safetensors")])
    reader.check_capacity(1 << 20, "cpu")
    refused_binding("run.weights_too_large", reader.check_capacity, 1 << 50, "cpu")
    assert reader.bytes_read == 0
    names = sorted(tensors)
    assert reader.same_values(names[0], names[0])
    assert not reader.same_values("l1.bias", "l1.weight")  # different lengths: no read
    assert reader.bytes_read == 2 * tensors[names[0]].nbytes
