"""LocalCAS through the bindings: real files, refs, GC, fsck, and the GIL released."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from torch_compiled_graphs import StorageError
from torch_compiled_graphs.store import GRAPH_REF_PREFIX, QUARANTINE_REF_PREFIX, LocalCAS


def test_frozen_ref_prefixes() -> None:
    assert GRAPH_REF_PREFIX == "torch-compiled-graphs/v1/graphs/"
    assert QUARANTINE_REF_PREFIX == "torch-compiled-graphs/v1/quarantine/"


def test_ingest_with_a_ref_survives_gc_and_materializes_the_same_bytes(tmp_path: Path) -> None:
    cas = LocalCAS(tmp_path / "store")
    src = tmp_path / "blob"
    src.write_bytes(os.urandom(300_000))
    kept = cas.ingest(src, ref="tools/blob")
    lost = tmp_path / "other"
    lost.write_bytes(b"unreferenced")
    cas.ingest(lost)
    assert cas.read_ref("tools/blob") == {"kind": "manifest", "target": kept["manifest"]}
    assert cas.read_ref("tools/absent") is None
    report = cas.gc()
    assert report["freed_objects"] >= 2  # the unreferenced chunk and its manifest
    out = cas.materialize(kept["manifest"], tmp_path / "copy")
    assert out.read_bytes() == src.read_bytes()
    assert os.stat(out).st_ino != os.stat(src).st_ino
    with pytest.raises(FileExistsError):
        cas.materialize(kept["manifest"], tmp_path / "copy")
    assert cas.refs("tools/") == ["tools/blob"]
    assert cas.stats()["refs"] == 1


def test_compare_and_swap_distinguishes_already_equal(tmp_path: Path) -> None:
    cas = LocalCAS(tmp_path / "store")
    (tmp_path / "a").write_bytes(b"a")
    a = cas.ingest(tmp_path / "a", ref="x/a")["manifest"]
    assert cas.compare_and_swap("x/b", None, a) == "MATCHED"
    assert cas.compare_and_swap("x/b", None, a) == "ALREADY_EQUAL"
    assert cas.compare_and_swap("x/b", "0" * 64, None) == "CONFLICT"
    assert cas.compare_and_swap("x/b", a, None) == "MATCHED"


def test_fsck_reports_a_bit_flipped_object_by_digest(tmp_path: Path) -> None:
    cas = LocalCAS(tmp_path / "store")
    src = tmp_path / "blob"
    src.write_bytes(os.urandom(10_000))
    info = cas.ingest(src, ref="tools/blob")
    assert cas.fsck()["clean"]
    obj = next(p for p in (tmp_path / "store" / "objects").rglob("*") if p.is_file() and p.stat().st_size == 10_000)
    obj.chmod(0o644)
    data = bytearray(obj.read_bytes())
    data[17] ^= 1
    obj.write_bytes(bytes(data))
    report = cas.fsck()
    assert not report["clean"]
    assert report["corrupt"][0]["code"] == "store.digest_mismatch"
    assert report["corrupt"][0]["digest"] == obj.name
    with pytest.raises(StorageError) as e:
        cas.materialize(info["manifest"], tmp_path / "never")
    assert e.value.code == "store.digest_mismatch"
    assert not (tmp_path / "never").exists()


def test_a_store_of_another_format_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    (root / "FORMAT").write_text("torch-compiled-graphs-store 2\n")
    with pytest.raises(StorageError) as e:
        LocalCAS(root)
    assert e.value.code == "store.format_unsupported"


def test_ingest_releases_the_gil(tmp_path: Path) -> None:
    cas = LocalCAS(tmp_path / "store")
    big = tmp_path / "big"
    with big.open("wb") as f:
        f.write(os.urandom(1 << 20) * 160)
    started = threading.Event()

    def work() -> None:
        started.set()
        cas.ingest(big, ref="tools/big")

    worker = threading.Thread(target=work)
    worker.start()
    started.wait()
    spins = 0
    while worker.is_alive():
        spins += 1
    worker.join()
    # With the GIL held for the whole native call this loop could not run meanwhile.
    assert spins > 100
    assert cas.read_ref("tools/big") is not None
