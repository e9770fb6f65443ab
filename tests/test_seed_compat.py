"""Seed compatibility with torch-compiled-graphs 0.2.0 (issue 12).

The 0.2.0 example runs unchanged (only the ``LocalCAS`` import line names this
package's module), its CLI output parses as it did, its outcome values and
error classes are the same, and a 0.2.0 store is adopted.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import pytest

from torch_compiled_graphs import (
    AdmissionError,
    ArtifactError,
    Engine,
    EnsureOutcome,
    EnsureResult,
    LocalCAS,
    QuarantinedArtifact,
    StorageError,
    StoredCompiledGraph,
    StoreOutcome,
)

from .conftest import REFERENCE, REFERENCE_KEY, ROOT

ENVELOPE = REFERENCE / "mlp-cpu.tar.gz"
HASHREPO = REFERENCE / "hashrepo-store.tar.gz"
CLI = [sys.executable, "-m", "torch_compiled_graphs"]

# The example of the 0.2.0 package page, as a user would copy it into a script.
# Only the `from torch_compiled_graphs import LocalCAS` line is this package's.
EXAMPLE = """
import sys

import torch
from torch_compiled_graphs import Engine, GraphClassSpec, RuntimeCompatibility, record_toolchain
from torch_compiled_graphs import LocalCAS

root, dest, again = sys.argv[1], sys.argv[2], sys.argv[3]


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


torch.manual_seed(0)
model = MLP().eval()
x = torch.randn(4, 16)
program = torch.export.export(model, (x,))
spec = GraphClassSpec("model/mlp", "serve", program)
toolchain = record_toolchain()
key = RuntimeCompatibility("cpu", toolchain=toolchain).key(spec.declare())

engine = Engine(LocalCAS(root))
result = engine.ensure(key, dest, target="cpu", toolchain=toolchain, recipe=lambda: spec)
assert result.outcome == "minted", result.outcome
print("package", result.compiled_graph.package)
print("directory", result.compiled_graph.directory)
print("literals", result.compiled_graph.literals)
print("key", result.compiled_graph.key)
print("manifest", result.compiled_graph.manifest)
print("first", result.outcome)

second = engine.ensure(key, again, target="cpu", toolchain=toolchain, recipe=lambda: spec)
assert second.outcome == "reused", second.outcome
assert second.compiled_graph.metadata == result.compiled_graph.metadata

graph = second.compiled_graph.load(model)
y = graph(x)
torch.testing.assert_close(y, model(x), rtol=1e-5, atol=1e-6)
print("second", second.outcome)
print("matches_eager", True)
"""


def run_cli(*args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *map(os.fspath, args)], capture_output=True, text=True)


def python_dumps(metadata: dict[str, Any]) -> str:
    """What the 0.2.0 CLI printed: ``json.dumps(metadata, sort_keys=True, indent=2)`` and a newline."""
    return json.dumps(metadata, sort_keys=True, indent=2) + "\n"


@pytest.mark.real_aoti
def test_the_0_2_0_example_runs_verbatim_and_its_cli_output_parses(tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(EXAMPLE)
    root, dest, again = tmp_path / "graphs", tmp_path / "dest", tmp_path / "again"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    out = subprocess.run(
        [sys.executable, str(script), str(root), str(dest), str(again)], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr[-4000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["package"] == str(dest / "model.pt2") and (dest / "model.pt2").is_file()
    assert lines["directory"] == str(dest)
    assert lines["literals"] == "None"
    assert (lines["first"], lines["second"], lines["matches_eager"]) == ("minted", "reused", "True")
    key = lines["key"]
    metadata = json.loads((dest / "metadata.json").read_text())
    assert metadata["compiled_graph_key"] == key

    # The CLI as 0.2.0 scripts used it: metadata JSON on stdout, through `python -m`.
    resolved = run_cli("resolve", "--cas-root", root, key, tmp_path / "cli-dest")
    assert resolved.returncode == 0, resolved.stderr
    assert resolved.stdout == python_dumps(metadata)
    assert json.loads(resolved.stdout) == metadata
    exported = tmp_path / "graph.tar.gz"
    assert run_cli("export", "--cas-root", root, key, exported).returncode == 0
    for command in (["inspect"], ["verify"], ["verify", "--host"]):
        shown = run_cli(*command, exported)
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout == python_dumps(metadata), command
        assert json.loads(shown.stdout) == metadata
    # The console script and `python -m` are the same command line.
    script_cli = shutil.which("torch-compiled-graphs", path=os.path.dirname(sys.executable))
    assert script_cli is not None
    same = subprocess.run([script_cli, "inspect", str(exported)], capture_output=True, text=True)
    assert same.stdout == python_dumps(metadata)


def test_cli_prints_the_metadata_json_exactly_as_0_2_0_did(tmp_path: Path) -> None:
    metadata = json.loads(subprocess.run([*CLI, "inspect", "--json", str(ENVELOPE)], capture_output=True).stdout)[
        "metadata"
    ]
    for command in (["inspect"], ["verify"]):
        shown = run_cli(*command, ENVELOPE)
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout == python_dumps(metadata)
    assert "verified " + REFERENCE_KEY in run_cli("verify", ENVELOPE).stderr
    Engine(tmp_path / "s").import_artifact(REFERENCE_KEY, ENVELOPE)
    resolved = run_cli("resolve", "--cas-root", tmp_path / "s", REFERENCE_KEY, tmp_path / "d")
    assert resolved.returncode == 0, resolved.stderr
    assert resolved.stdout == python_dumps(json.loads((tmp_path / "d" / "metadata.json").read_text()))
    # Exit codes are unchanged: 1 for a miss and a refusal, 2 for usage.
    miss = run_cli("resolve", "--cas-root", tmp_path / "s", "cg-key-v1-" + "0" * 56, tmp_path / "e")
    assert (miss.returncode, miss.stdout) == (1, "")
    bare = tmp_path / "model.pt2"
    shutil.copy(tmp_path / "d" / "model.pt2", bare)
    refused = run_cli("verify", bare)
    assert (refused.returncode, refused.stdout) == (1, "") and "artifact.bare_pt2" in refused.stderr
    assert run_cli("verify").returncode == 2
    help_text = run_cli("--help")
    assert help_text.returncode == 0 and "adopt" in help_text.stdout


def test_engine_takes_a_local_cas_a_path_or_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cas = LocalCAS(tmp_path / "cas")
    assert Engine(cas).root == cas.root
    assert Engine(tmp_path / "p").root == tmp_path / "p"
    assert Engine(str(tmp_path / "s")).root == tmp_path / "s"
    assert Engine(root=tmp_path / "r", lock_timeout=1.0).root == tmp_path / "r"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert Engine().root == tmp_path / "cache" / "torch-compiled-graphs"
    with pytest.raises(TypeError, match="LocalCAS"):
        Engine(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Engine(cas, root=tmp_path / "x")
    # One store seen through both handles.
    Engine(cas).import_artifact(REFERENCE_KEY, ENVELOPE)
    assert cas.refs("torch-compiled-graphs/v1/graphs/") == [f"torch-compiled-graphs/v1/graphs/{REFERENCE_KEY}"]


def test_stored_compiled_graph_has_the_0_2_0_names(tmp_path: Path) -> None:
    engine = Engine(LocalCAS(tmp_path / "s"))
    engine.import_artifact(REFERENCE_KEY, ENVELOPE)
    g = engine.resolve(REFERENCE_KEY, tmp_path / "d")
    assert isinstance(g, StoredCompiledGraph)
    assert g.directory == tmp_path / "d" and g.package == tmp_path / "d" / "model.pt2" and g.package.is_file()
    assert g.literals is None
    assert g.key == REFERENCE_KEY and g.metadata["compiled_graph_key"] == REFERENCE_KEY
    assert len(g.manifest) == 64
    # Today's names are documented aliases.
    assert g.path == g.directory and g.package_path == g.package
    with_literals = copy.deepcopy(g.metadata)
    with_literals["graph_class"]["constants"][0]["source"] = "literal"
    lit = StoredCompiledGraph(g.key, g.directory, with_literals, g.manifest)
    assert lit.literals == tmp_path / "d" / "constants.safetensors"
    result = EnsureResult(EnsureOutcome("reused"), g, None)
    assert result.compiled_graph is g and result.graph is g and result.outcome == "reused"


def test_outcomes_are_the_0_2_0_string_values() -> None:
    values = {
        EnsureOutcome: ["reused", "minted"],
        StoreOutcome: ["stored", "present", "repaired", "divergent"],
    }
    for cls, strings in values.items():
        assert [str(m) for m in cls] == strings
        for member, s in zip(cls, strings, strict=True):
            assert member == s and s == member and not (member != s)
            assert cls(s) is member and cls(member) is member
            assert getattr(cls, s.upper()) is member and member.name == s.upper() and member.value == s
            assert hash(member) == hash(s) and {s: 1}[member] == 1
            assert isinstance(member, str) and f"{member}" == s and f"{member:>9}" == f"{s:>9}"
            assert repr(member) == f"<{cls.__name__}.{s.upper()}: {s!r}>"
            assert pickle.loads(pickle.dumps(member)) is member
            assert copy.deepcopy(member) is member
            assert json.dumps({"outcome": member}) == json.dumps({"outcome": s})
        with pytest.raises(ValueError, match="not a valid"):
            cls("REUSED" if cls is EnsureOutcome else "STORED")
    assert EnsureOutcome.REUSED != StoreOutcome.STORED and "reused" in {EnsureOutcome.REUSED}


def test_import_cost_is_unchanged_by_the_str_outcomes() -> None:
    # The hit path must not pull in enum or typing (engine.py's design).
    code = "import sys, torch_compiled_graphs; print([m for m in ('enum', 'typing', 'torch') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "[]\n", out.stdout


def test_error_classes_match_0_2_0_for_the_same_input(tmp_path: Path) -> None:
    engine = Engine(tmp_path / "s")
    for call in (
        lambda: engine.resolve("not-a-key", tmp_path / "d"),
        lambda: engine.import_artifact("not-a-key", ENVELOPE),
        lambda: engine.export_artifact("not-a-key", tmp_path / "x"),
        lambda: engine.resolve(42, tmp_path / "d"),  # type: ignore[arg-type]
    ):
        with pytest.raises(StorageError, match="compiled-graph key") as e:
            call()
        assert e.value.code == "store.key_invalid" and isinstance(e.value, RuntimeError)
    with pytest.raises(StorageError) as absent:
        engine.export_artifact(REFERENCE_KEY, tmp_path / "x")
    assert absent.value.code == "store.absent"
    other = "cg-key-v1-" + "1" * 56
    with pytest.raises(StorageError) as mismatch:
        engine.import_artifact(other, ENVELOPE)
    assert mismatch.value.code == "store.key_mismatch"
    bare = tmp_path / "model.pt2"
    with tarfile.open(ENVELOPE) as t:
        member = t.extractfile("model.pt2")
        assert member is not None
        bare.write_bytes(member.read())
    with pytest.raises(ArtifactError) as bare_err:
        engine.import_artifact(REFERENCE_KEY, bare)
    assert bare_err.value.code == "artifact.bare_pt2" and isinstance(bare_err.value, ValueError)
    assert engine.resolve("cg-key-v1-" + "0" * 56, tmp_path / "d") is None
    engine.import_artifact(REFERENCE_KEY, ENVELOPE)
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "x").write_text("x")
    with pytest.raises(FileExistsError) as occupied:
        engine.resolve(REFERENCE_KEY, tmp_path / "occupied")
    assert occupied.value.code == "io.destination_occupied"
    assert issubclass(QuarantinedArtifact, StorageError) and issubclass(AdmissionError, StorageError)


def divergent_envelope(tmp_path: Path) -> Path:
    """The reference package with one extra, ignored zip member, packed anew: valid, other bytes."""
    from torch_compiled_graphs import artifact

    members = tmp_path / "members"
    members.mkdir()
    with tarfile.open(ENVELOPE) as t:
        t.extractall(members, filter="data")
    with zipfile.ZipFile(members / "model.pt2", "a") as z:
        z.writestr("model/extra-note.txt", "a second mint of the same graph\n")
    out = tmp_path / "divergent.tar.gz"
    artifact.pack(members / "model.pt2", json.loads((members / "metadata.json").read_text()), out)
    return out


def test_a_divergent_import_says_it_was_set_aside_and_the_record_is_unchanged(tmp_path: Path) -> None:
    divergent = divergent_envelope(tmp_path)
    store = tmp_path / "s"
    assert run_cli("import", "--cas-root", store, REFERENCE_KEY, ENVELOPE).returncode == 0
    out = run_cli("import", "--cas-root", store, REFERENCE_KEY, divergent, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["outcome"] == "DIVERGENT"
    assert "set aside" in out.stderr and "unchanged" in out.stderr, out.stderr
    assert "artifact_verification" not in out.stderr and "quarantined" not in out.stderr, out.stderr
    # Python: the outcome, and the stored record still serves the first artifact.
    engine = Engine(LocalCAS(store))
    result = engine.import_artifact(REFERENCE_KEY, divergent)
    assert result.outcome == "divergent" and result.outcome is StoreOutcome.DIVERGENT
    exported = engine.export_artifact(REFERENCE_KEY, tmp_path / "exported.tar.gz")
    assert exported.read_bytes() == ENVELOPE.read_bytes()


def unpack_hashrepo(where: Path) -> Path:
    where.mkdir()
    with tarfile.open(HASHREPO) as t:
        t.extractall(where, filter="fully_trusted")
    return where


def test_a_0_2_0_store_is_refused_with_the_way_forward_and_adopted(tmp_path: Path) -> None:
    old = unpack_hashrepo(tmp_path / "old")
    before = sorted((p.relative_to(old), p.read_bytes() if p.is_file() else b"") for p in old.rglob("*"))
    for opener in (Engine, LocalCAS):
        with pytest.raises(StorageError) as e:
            opener(old)
        assert e.value.code == "store.hashrepo_root"
        assert "adopt --from-hashrepo" in str(e.value) and "--cas-root" in str(e.value)
    refused = run_cli("resolve", "--cas-root", old, REFERENCE_KEY, tmp_path / "d")
    assert refused.returncode == 2 and "code: store.hashrepo_root" in refused.stderr

    new = tmp_path / "new"
    adopted = run_cli("adopt", "--from-hashrepo", old, "--cas-root", new, "--json")
    assert adopted.returncode == 0, adopted.stderr
    report = json.loads(adopted.stdout)
    assert report["counts"] == {"divergent": 0, "imported": 1, "present": 0, "quarantined": 0, "refused": 0}
    assert [(g["key"], g["status"], g["outcome"]) for g in report["graphs"]] == [(REFERENCE_KEY, "imported", "stored")]
    again = run_cli("adopt", "--from-hashrepo", old, "--cas-root", new)
    assert again.returncode == 0 and again.stdout.split() == ["present", REFERENCE_KEY]
    rows = Engine(new).adopt_hashrepo(old)
    assert [(r["key"], r["status"], r["code"]) for r in rows] == [(REFERENCE_KEY, "present", None)]
    g = Engine(LocalCAS(new)).resolve(REFERENCE_KEY, tmp_path / "d")
    assert g is not None and g.package.is_file()
    after = sorted((p.relative_to(old), p.read_bytes() if p.is_file() else b"") for p in old.rglob("*"))
    assert after == before


def test_adopt_refuses_a_cas_root_inside_the_old_root_before_writing(tmp_path: Path) -> None:
    old = unpack_hashrepo(tmp_path / "old")
    before = sorted((p.relative_to(old), p.read_bytes() if p.is_file() else b"") for p in old.rglob("*"))
    for new in (old / "cas", old, tmp_path):
        refused = run_cli("adopt", "--from-hashrepo", old, "--cas-root", new)
        assert refused.returncode == 2, refused.stderr
        assert "code: store.adopt_overlap" in refused.stderr and "hint:" in refused.stderr, refused.stderr
    after = sorted((p.relative_to(old), p.read_bytes() if p.is_file() else b"") for p in old.rglob("*"))
    assert after == before and not (old / "cas").exists()


def test_adopt_refuses_a_corrupt_graph_with_its_code_and_exit_1(tmp_path: Path) -> None:
    old = unpack_hashrepo(tmp_path / "old")
    envelope = next(p for p in (old / "objects").rglob("*") if p.is_file() and p.stat().st_size > 1000)
    envelope.chmod(0o644)
    data = bytearray(envelope.read_bytes())
    data[len(data) // 2] ^= 0x01
    envelope.write_bytes(bytes(data))
    out = run_cli("adopt", "--from-hashrepo", old, "--cas-root", tmp_path / "new")
    assert out.returncode == 1, out.stderr
    assert out.stdout.split()[:3] == ["refused", REFERENCE_KEY, "store.digest_mismatch:"]
    rows = Engine(tmp_path / "new").adopt_hashrepo(old)
    assert [(r["status"], r["code"]) for r in rows] == [("refused", "store.digest_mismatch")]
    assert Engine(tmp_path / "new").resolve(REFERENCE_KEY, tmp_path / "d") is None


def test_python_dash_m_is_the_cli() -> None:
    main = ROOT / "python" / "torch_compiled_graphs" / "__main__.py"
    assert main.is_file()
    out = run_cli("check-key", REFERENCE_KEY)
    assert (out.returncode, out.stdout) == (0, "valid\n")
    code = textwrap.dedent(
        """
        import runpy, sys
        sys.argv = ["torch_compiled_graphs", "check-key", "nope"]
        runpy.run_module("torch_compiled_graphs", run_name="__main__")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (out.returncode, out.stdout) == (1, "invalid\n")
