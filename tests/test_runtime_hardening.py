"""The native runtime against a changing world and corrupted inputs: weights
truncated while they are bound, a .so with corrupted program headers, a null
input pointer, absurd lock timeouts, arguments that are not UTF-8, and the
private directories of killed loads. Every hazard ends in success or a typed
error, never in a signal."""

from __future__ import annotations

import io
import json
import os
import random
import signal
import struct
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest

from torch_compiled_graphs import Engine, StoredCompiledGraph
from torch_compiled_graphs.errors import BindingError
from torch_compiled_graphs.native import find_torch_lib

from .conftest import REFERENCE, resolve_reference

WEIGHTS = REFERENCE / "mlp-cpu.weights.safetensors"


@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory) -> StoredCompiledGraph:
    found: StoredCompiledGraph = resolve_reference(tmp_path_factory.mktemp("hardening"))
    return found


def rebuilt(graph: StoredCompiledGraph) -> str:
    """Child-process code that rebuilds ``graph`` as ``g``."""
    return (
        "import json\n"
        "from torch_compiled_graphs import StoredCompiledGraph\n"
        f"g = StoredCompiledGraph({graph.key!r}, {str(graph.path)!r}, "
        f"json.loads({json.dumps(graph.metadata)!r}), {graph.manifest!r})\n"
    )


def child(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_truncating_the_weights_while_they_are_bound_never_kills_the_process(
    graph: StoredCompiledGraph, tmp_path: Path
) -> None:
    # A big weights file (the reference's tensors plus a large extra one the
    # graph refuses only after reading the file) rewritten and truncated by
    # another process while this one rebinds it again and again.
    from safetensors.numpy import load_file, save_file

    tensors = load_file(WEIGHTS)
    good = tmp_path / "good.safetensors"
    save_file(tensors, good)
    big = dict(tensors)
    big["padding"] = np.zeros(8 << 20, dtype=np.float32)
    bigfile = tmp_path / "big.safetensors"
    save_file(big, bigfile)
    target = tmp_path / "weights.safetensors"
    target.write_bytes(bigfile.read_bytes())
    code = rebuilt(graph) + textwrap.dedent(f"""
        from torch_compiled_graphs.errors import BindingError
        native = g.load_native({str(good)!r})
        outcomes = set()
        for _ in range(300):
            try:
                native.rebind({str(target)!r})
                outcomes.add("bound")
            except BindingError as e:
                outcomes.add(e.code)
        print(sorted(outcomes))
    """)
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                import os, time
                data = open({str(bigfile)!r}, "rb").read()
                end = time.monotonic() + 60
                while time.monotonic() < end:
                    with open({str(target)!r}, "r+b") as f:
                        f.truncate(4096)
                        f.seek(0)
                        f.write(data)
            """),
        ]
    )
    try:
        done = child(code)
    finally:
        writer.kill()
        writer.wait()
    assert done.returncode == 0, f"rc {done.returncode}: {done.stderr[-2000:]}"
    assert "run." in done.stdout or "bound" in done.stdout, done.stdout


def _reference_package(tmp: Path) -> tuple[Path, bytes, str]:
    with tarfile.open(REFERENCE / "mlp-cpu.tar.gz") as t:
        member = t.extractfile("model.pt2")
        assert member is not None
        pkg = member.read()
    z = zipfile.ZipFile(io.BytesIO(pkg))
    so_name = next(n for n in z.namelist() if n.endswith(".so"))
    path = tmp / "model.pt2"
    path.write_bytes(pkg)
    return path, z.read(so_name), so_name


def _with_so(pkg: Path, so_name: str, so: bytes, out: Path) -> None:
    with zipfile.ZipFile(pkg) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, so if info.filename == so_name else src.read(info.filename))


def test_corrupted_program_headers_are_refused_or_load_without_a_crash(
    graph: StoredCompiledGraph, tmp_path: Path
) -> None:
    pkg, so, so_name = _reference_package(tmp_path)
    phoff = struct.unpack_from("<Q", so, 0x20)[0]
    phnum = struct.unpack_from("<H", so, 0x38)[0]
    rng = random.Random(13)
    lib = find_torch_lib()
    rows = [(r["fqn"], r["source"], r["dtype"], [int(d) for d in r["shape"]]) for r in graph.constants]
    mutants = []
    for i in range(40):
        b = bytearray(so)
        for _ in range(rng.choice([1, 1, 2, 4])):
            at = phoff + rng.randrange(phnum * 56)
            b[at] = rng.randrange(256)
        out = tmp_path / f"mutant-{i}.pt2"
        _with_so(pkg, so_name, bytes(b), out)
        mutants.append(out)
    code = """
        import sys
        from torch_compiled_graphs import _native
        from torch_compiled_graphs.errors import BindingError
        lib, entry, sm, rows = sys.argv[1], sys.argv[2], sys.argv[3], eval(sys.argv[4])
        for path in sys.argv[5:]:
            try:
                _native.NativeModel(lib, path, entry, "cpu", sm, rows)
                print(path, "loaded", flush=True)
            except BindingError as e:
                print(path, e.code, flush=True)
    """
    # All mutants in one child: a crash of any load kills it and fails the test.
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), lib, graph.graph_class, graph.sm, repr(rows), *map(str, mutants)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"rc {done.returncode} after {done.stdout[-1000:]}"
    verdicts = [line.split()[-1] for line in done.stdout.splitlines()]
    assert len(verdicts) == len(mutants), done.stdout
    assert "run.package_invalid" in verdicts, verdicts


class _NullArray:
    def __init__(self, shape: tuple[int, ...]) -> None:
        self.__array_interface__ = {"version": 3, "typestr": "<f4", "shape": shape, "data": (0, False)}


def test_an_input_at_a_null_address_is_refused(graph: StoredCompiledGraph) -> None:
    native = graph.load_native(WEIGHTS)
    with pytest.raises(BindingError) as e:
        native(_NullArray((4, 16)))
    assert e.value.code == "run.input_layout", str(e.value)


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), float("-inf"), 1e300, 1e12])
def test_absurd_lock_timeouts_raise_value_error(tmp_path: Path, value: float) -> None:
    with pytest.raises(ValueError, match="lock_timeout"):
        Engine(tmp_path / "store", lock_timeout=value)


def test_reasonable_lock_timeouts_are_taken(tmp_path: Path) -> None:
    for value in (0.0, 0.5, 3600.0, None):
        Engine(tmp_path / "store", lock_timeout=value)


def test_non_utf8_arguments_through_the_console_script() -> None:
    script = Path(sys.executable).parent / "torch-compiled-graphs"
    bad_path = os.fsdecode(b"/nonexistent/\xff.tar.gz")
    out = subprocess.run([str(script), "inspect", bad_path], capture_output=True)
    assert out.returncode == 2, out
    assert b"Traceback" not in out.stderr and b"code: io." in out.stderr, out.stderr
    out = subprocess.run([str(script), "check-key", os.fsdecode(b"cg-key-\xff")], capture_output=True)
    assert out.returncode == 2, out
    assert b"Traceback" not in out.stderr and b"invalid UTF-8" in out.stderr, out.stderr


def test_a_killed_loads_directory_is_removed_by_the_next_load(graph: StoredCompiledGraph, tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    hold = rebuilt(graph) + textwrap.dedent(f"""
        import time
        native = g.load_native({str(WEIGHTS)!r})
        print("ready", flush=True)
        time.sleep(600)
    """)
    env = {**os.environ, "TMPDIR": str(tmp)}

    def holder() -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True, env=env)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        return p

    def dirs() -> set[str]:
        return {p.name for p in tmp.iterdir() if p.name.startswith("tcg-native-")}

    killed = holder()
    dead = dirs()
    assert len(dead) == 1
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert dirs() == dead, "the kill leaves the directory behind"
    alive = holder()
    try:
        live = dirs() - dead
        assert len(live) == 1
        assert not (dead & dirs()), "the next load removes the dead process's directory"
        # A third load removes nothing that is still in use.
        done = child(rebuilt(graph) + f"g.load_native({str(WEIGHTS)!r})\n", env={"TMPDIR": str(tmp)})
        assert done.returncode == 0, done.stderr
        assert live <= dirs()
    finally:
        alive.kill()
        alive.wait()
