"""Artifacts this project writes, from a real AOTInductor compile: the closed
schema, canonical bytes, full verification and moving between stores; and the
artifact functions for tools."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from torch_compiled_graphs import ArtifactError, Engine, StoreOutcome
from torch_compiled_graphs import artifact as art
from torch_compiled_graphs.identity import canonical_json

from .conftest import TESTDATA

TOP = {
    "compiled_graph_format",
    "compiled_graph_key",
    "constant_folding_fenced",
    "graph_class",
    "host_isa",
    "kind",
    "package_constants_in_so",
    "sm",
    "toolchain",
}
GRAPH_CLASS = {
    "class_dims",
    "class_hash",
    "constants",
    "fork",
    "graph",
    "graph_witness",
    "literal_values",
    "lora_bucket",
    "name",
    "placement",
    "range_digest",
    "strict",
    "target",
}


@pytest.fixture(scope="module")
def exported(demo_minted: tuple[Path, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    workdir, result = demo_minted
    key = result["mint"]["key"]
    out = tmp_path_factory.mktemp("export") / "compiled_graph.tar.gz"
    Engine(workdir / "store").export_artifact(key, out)
    return key, out


def members(envelope: Path) -> dict[str, bytes]:
    with tarfile.open(envelope) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]


@pytest.mark.real_aoti
def test_our_artifact_follows_the_closed_schema_with_canonical_bytes(exported: tuple[str, Path]) -> None:
    key, envelope = exported
    found = members(envelope)
    assert list(found) == ["metadata.json", "model.pt2"]
    raw = found["metadata.json"]
    metadata = json.loads(raw)
    assert canonical_json(metadata) == raw
    assert set(metadata) == TOP
    assert set(metadata["graph_class"]) == GRAPH_CLASS
    assert metadata["compiled_graph_key"] == key
    assert metadata["package_constants_in_so"] is False and metadata["constant_folding_fenced"] is True
    for row in metadata["graph_class"]["constants"]:
        assert set(row) == {"dtype", "fqn", "shape", "source"}
        assert row["source"] == "state_dict"
    assert metadata["host_isa"]["host_isa_level"] in {"x86-64", "x86-64-v2", "x86-64-v3", "native"}
    assert metadata["sm"] == "cpu-" + metadata["host_isa"]["host_isa_level"] or metadata["sm"].endswith("-native")
    # The envelope's fixed framing: the gzip header and the tar record size.
    head = envelope.read_bytes()[:10]
    assert head == bytes.fromhex("1f8b08000000000002ff")
    assert len(gzip.decompress(envelope.read_bytes())) % 10240 == 0


@pytest.mark.real_aoti
def test_our_artifact_verifies_and_moves_between_stores(exported: tuple[str, Path], tmp_path: Path) -> None:
    key, envelope = exported
    report = art.verify(envelope, host=True)
    assert report["key"] == key and report["host_admitted"] is True
    assert art.read_metadata(envelope)["compiled_graph_key"] == key
    other = Engine(tmp_path / "other")
    assert other.import_artifact(key, envelope).outcome is StoreOutcome.STORED
    again = other.export_artifact(key, tmp_path / "again.tar.gz")
    assert again.read_bytes() == envelope.read_bytes()
    cli = [sys.executable, "-m", "torch_compiled_graphs.cli"]
    out = subprocess.run([*cli, "inspect", "--json", str(envelope)], capture_output=True, text=True)
    assert out.returncode == 0 and json.loads(out.stdout)["metadata"]["compiled_graph_key"] == key


@pytest.mark.real_aoti
def test_repacking_our_members_is_deterministic(exported: tuple[str, Path], tmp_path: Path) -> None:
    _key, envelope = exported
    unpacked = tmp_path / "members"
    metadata = art.unpack(envelope, unpacked)
    first = art.pack(unpacked / "model.pt2", metadata, tmp_path / "a.tar.gz")
    (unpacked / "model.pt2").touch()
    second = art.pack(unpacked / "model.pt2", metadata, tmp_path / "b.tar.gz")
    assert first.read_bytes() == second.read_bytes() == envelope.read_bytes()
    with pytest.raises(FileExistsError):
        art.pack(unpacked / "model.pt2", metadata, tmp_path / "a.tar.gz")
    assert [r["fqn"] for r in art.constant_table(unpacked / "model.pt2")] == [
        r["fqn"] for r in metadata["graph_class"]["constants"]
    ]


def test_unpack_refuses_a_bare_package_and_publishes_nothing(tmp_path: Path) -> None:
    unpacked = tmp_path / "ref"
    art.unpack(TESTDATA / "reference-0.2.0" / "mlp-cpu.tar.gz", unpacked)
    with pytest.raises(ArtifactError) as e:
        art.unpack(unpacked / "model.pt2", tmp_path / "never")
    assert e.value.code == "artifact.bare_pt2"
    assert not (tmp_path / "never").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ref"]
