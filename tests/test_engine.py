"""The engine through Python: processes, error classes and the torch-free hit path.

These use the reference artifact minted by the original implementation (a real
AOTInductor CPU package); the real-compile tests live in test_mint_*.py.
"""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from torch_compiled_graphs import (
    Engine,
    EnsureOutcome,
    QuarantinedArtifact,
    StorageError,
    StoreOutcome,
)

from .conftest import TESTDATA

REFERENCE = TESTDATA / "reference-0.2.0" / "mlp-cpu.tar.gz"
KEY = "cg-key-v1-ddd506362c49696787e3eb3d0e44c08b00a6358015d9004ba1cd363a"


def reference_toolchain() -> dict[str, str]:
    with tarfile.open(REFERENCE) as tar:
        member = tar.extractfile("metadata.json")
        assert member is not None
        toolchain: dict[str, str] = json.loads(member.read())["toolchain"]
    return toolchain


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)


@pytest.fixture()
def engine(tmp_path: Path) -> Engine:
    e = Engine(tmp_path / "store")
    assert e.import_artifact(KEY, REFERENCE).outcome is StoreOutcome.STORED
    return e


def test_restart_reuse_in_a_fresh_process_never_imports_torch(engine: Engine, tmp_path: Path) -> None:
    out = run_python(
        f"""
        import sys
        from torch_compiled_graphs import Engine
        g = Engine({str(engine.root)!r}).resolve({KEY!r}, {str(tmp_path / "out")!r})
        assert g is not None and g.graph_class == "model/mlp", g
        assert "torch" not in sys.modules, "resolve imported torch"
        print(g.package_path)
        """
    )
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).stat().st_size > 0


def test_an_ensure_hit_in_a_cold_process_calls_no_recipe_and_imports_no_torch(engine: Engine, tmp_path: Path) -> None:
    out = run_python(
        f"""
        import sys
        from torch_compiled_graphs import Engine, EnsureOutcome
        def recipe():
            raise AssertionError("the recipe must not run on a hit")
        r = Engine({str(engine.root)!r}).ensure(
            {KEY!r}, {str(tmp_path / "out")!r}, target="cpu", toolchain={reference_toolchain()!r}, recipe=recipe
        )
        assert r.outcome is EnsureOutcome.REUSED and r.publication is None
        assert "torch" not in sys.modules
        """
    )
    assert out.returncode == 0, out.stderr


def test_a_hit_for_another_runtime_is_refused_without_calling_the_recipe(engine: Engine, tmp_path: Path) -> None:
    from torch_compiled_graphs import AdmissionError

    def recipe() -> None:
        raise AssertionError("the recipe must not run")

    with pytest.raises(AdmissionError) as e:
        engine.ensure(KEY, tmp_path / "o", target="sm_90", toolchain=reference_toolchain(), recipe=recipe)  # type: ignore[arg-type]
    assert e.value.code == "admission.target_mismatch"
    with pytest.raises(AdmissionError) as e:
        engine.ensure(KEY, tmp_path / "o", target="cpu", toolchain={"torch": "other"}, recipe=recipe)  # type: ignore[arg-type]
    assert e.value.code == "admission.toolchain_mismatch"
    assert not (tmp_path / "o").exists()


def test_two_processes_resolving_onto_one_destination_both_succeed(engine: Engine, tmp_path: Path) -> None:
    dest = tmp_path / "shared"
    code = f"""
        from torch_compiled_graphs import Engine
        assert Engine({str(engine.root)!r}).resolve({KEY!r}, {str(dest)!r}) is not None
        """
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)]) for _ in range(2)]
    assert [p.wait() for p in procs] == [0, 0]
    assert sorted(p.name for p in dest.iterdir()) == ["metadata.json", "model.pt2"]


def test_error_classes_and_codes(engine: Engine, tmp_path: Path) -> None:
    with pytest.raises(StorageError) as e:
        engine.resolve(b"not-a-str", tmp_path / "x")  # type: ignore[arg-type]
    assert e.value.code == "store.key_invalid" and "compiled-graph key" in str(e.value)
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "other").write_text("x")
    with pytest.raises(FileExistsError) as fe:
        engine.resolve(KEY, occupied)
    assert fe.value.errno == errno.EEXIST
    assert getattr(fe.value, "code", None) == "io.destination_occupied"
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError) as nd:
        engine.resolve(KEY, tmp_path / "file")
    assert getattr(nd.value, "code", None) == "io.destination_not_directory"


def test_a_corrupt_record_raises_quarantined_and_is_repaired_by_reimport(engine: Engine, tmp_path: Path) -> None:
    for obj in (engine.root / "objects").rglob("*"):
        if obj.is_file() and obj.stat().st_size > 4096:
            obj.chmod(0o644)
            data = bytearray(obj.read_bytes())
            data[len(data) // 2] ^= 0xFF
            obj.write_bytes(bytes(data))
    with pytest.raises(QuarantinedArtifact) as e:
        engine.resolve(KEY, tmp_path / "a")
    assert e.value.code == "quarantine.store_verification"
    with pytest.raises(QuarantinedArtifact) as e:
        engine.export_artifact(KEY, tmp_path / "x.tar.gz")
    assert e.value.code == "quarantine.present"
    assert engine.import_artifact(KEY, REFERENCE).outcome is StoreOutcome.REPAIRED
    assert engine.resolve(KEY, tmp_path / "a") is not None
    assert engine.stats()["quarantines"] >= 1


def test_export_then_import_into_another_store(engine: Engine, tmp_path: Path) -> None:
    exported = engine.export_artifact(KEY, tmp_path / "moved.tar.gz")
    assert exported.read_bytes() == REFERENCE.read_bytes()
    other = Engine(tmp_path / "other")
    assert other.import_artifact(KEY, exported).outcome is StoreOutcome.STORED
    rows = other.list()
    assert [r["key"] for r in rows] == [KEY]
    assert rows[0]["graph_class"] == "model/mlp"


def test_read_only_cli_commands_never_create_a_store(tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "torch_compiled_graphs.cli"]
    typo = tmp_path / "stroe"
    for args in (["ls"], ["stats"], ["fsck"], ["resolve", KEY, str(tmp_path / "out")]):
        out = subprocess.run([*cli, args[0], "--cas-root", str(typo), *args[1:]], capture_output=True, text=True)
        assert out.returncode == 2, (args, out.stderr)
        assert "code: store.not_found" in out.stderr, out.stderr
        assert "hint:" in out.stderr and str(typo) in out.stderr
        assert not typo.exists(), args
        assert not (tmp_path / "out").exists()


def test_a_store_another_user_can_write_is_refused_with_its_code(engine: Engine, tmp_path: Path) -> None:
    import os

    refs = Path(engine.root) / "refs"
    os.chmod(refs, 0o777)
    try:
        with pytest.raises(StorageError) as e:
            Engine(engine.root).resolve(KEY, tmp_path / "out")
        assert e.value.code == "store.insecure_permissions"
        assert "chmod go-w" in str(e.value)
    finally:
        os.chmod(refs, 0o700)


def test_cli_resolve_exit_codes(engine: Engine, tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "torch_compiled_graphs.cli"]
    hit = subprocess.run(
        [*cli, "resolve", "--cas-root", str(engine.root), KEY, str(tmp_path / "d")],
        capture_output=True,
        text=True,
    )
    assert hit.returncode == 0, hit.stderr
    # stdout is the metadata as 0.2.0 printed it; the destination goes to stderr.
    metadata = json.loads((tmp_path / "d" / "metadata.json").read_text())
    assert hit.stdout == json.dumps(metadata, sort_keys=True, indent=2) + "\n"
    assert str(tmp_path / "d") in hit.stderr
    other = "cg-key-v1-" + "0" * 56
    miss = subprocess.run(
        [*cli, "resolve", "--cas-root", str(engine.root), other, str(tmp_path / "e")],
        capture_output=True,
        text=True,
    )
    assert miss.returncode == 1 and "miss" in miss.stderr
    bare = tmp_path / "model.pt2"
    shutil.copy(tmp_path / "d" / "model.pt2", bare)
    refused = subprocess.run([*cli, "verify", str(bare)], capture_output=True, text=True)
    assert refused.returncode == 1
    assert "artifact.bare_pt2" in refused.stderr and "re-publish" in refused.stderr
    ok = subprocess.run([*cli, "verify", "--json", str(REFERENCE)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["verified"] is True
    from torch_compiled_graphs import _native

    host = subprocess.run([*cli, "verify", "--host", "--json", str(REFERENCE)], capture_output=True, text=True)
    if _native.host_requirement()["host_isa_level"] == "x86-64-v3":
        assert host.returncode == 0, host.stderr
        assert json.loads(host.stdout)["host_admitted"] is True
    else:
        assert host.returncode == 1 and "admission.host_" in host.stderr


def test_ensure_outcome_values() -> None:
    assert [o.value for o in EnsureOutcome] == ["reused", "minted"]
    assert [o.name for o in EnsureOutcome] == ["REUSED", "MINTED"]
    assert [o.value for o in StoreOutcome] == ["stored", "present", "repaired", "divergent"]
    assert [o.name for o in StoreOutcome] == ["STORED", "PRESENT", "REPAIRED", "DIVERGENT"]
