"""Signed provenance through Python and the CLI (docs/trust.md).

Keys come from the real ``ssh-keygen``, which also verifies what we sign. The
engine and CLI tests use the reference artifact; one real AOTInductor mint
checks that a configured signing key signs what ``ensure`` compiles.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from torch_compiled_graphs import AdmissionError, Engine, StoreOutcome, TrustError

from .conftest import REFERENCE, REFERENCE_KEY

ENVELOPE = REFERENCE / "mlp-cpu.tar.gz"
TRUST_ENV = (
    "TORCH_COMPILED_GRAPHS_SIGNING_KEY",
    "TORCH_COMPILED_GRAPHS_TRUST",
    "TORCH_COMPILED_GRAPHS_REVOKED_KEYS",
    "TORCH_COMPILED_GRAPHS_PRODUCER",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TRUST_ENV:
        monkeypatch.delenv(name, raising=False)


def keygen(directory: Path, name: str, comment: str) -> tuple[Path, str]:
    assert shutil.which("ssh-keygen"), "ssh-keygen is required (apt-get install openssh-client)"
    private = directory / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(private)], check=True)
    return private, Path(f"{private}.pub").read_text().strip()


def sig(path: Path) -> Path:
    return Path(f"{path}.sig")


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in TRUST_ENV}
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "torch_compiled_graphs.cli", *args], capture_output=True, text=True, env=full
    )


def ssh_keygen_verifies(entry: dict[str, str], allowed: Path, principal: str, work: Path) -> bool:
    (work / "entry.sig").write_text(entry["sshsig"])
    args = ["-Y", "verify", "-n", "torch-compiled-graphs", "-I", principal, "-f", str(allowed)]
    out = subprocess.run(
        ["ssh-keygen", *args, "-s", str(work / "entry.sig")],
        input=entry["statement"].encode(),
        capture_output=True,
    )
    return out.returncode == 0


def test_trust_error_is_an_admission_error_with_a_code(tmp_path: Path) -> None:
    assert issubclass(TrustError, AdmissionError)
    _, public = keygen(tmp_path, "k", "k@x")
    allowed = tmp_path / "allowed_signers"
    allowed.write_text(f"k@x {public}\n")
    engine = Engine(tmp_path / "store", trust=allowed)
    assert engine.trusting and not engine.signing
    with pytest.raises(TrustError) as e:
        engine.import_artifact(REFERENCE_KEY, ENVELOPE)
    assert e.value.code == "trust.unsigned"
    assert engine.resolve(REFERENCE_KEY, tmp_path / "out") is None, "a refusal publishes nothing"


def test_sign_export_import_round_trip_and_ssh_keygen_agrees(tmp_path: Path) -> None:
    key, public = keygen(tmp_path, "ops", "ops@a.example")
    producer = Engine(tmp_path / "producer")
    producer.import_artifact(REFERENCE_KEY, ENVELOPE)
    signed = producer.sign(REFERENCE_KEY, key)
    assert signed["producer"] == "ops@a.example" and signed["fingerprint"].startswith("SHA256:")
    out = tmp_path / "graph.tar.gz"
    producer.export_artifact(REFERENCE_KEY, out)
    doc = json.loads(sig(out).read_bytes())
    assert doc["type"] == "torch-compiled-graphs.signatures" and len(doc["signatures"]) == 1
    allowed = tmp_path / "allowed_signers"
    allowed.write_text(f"ops@a.example {public}\n")
    assert ssh_keygen_verifies(doc["signatures"][0], allowed, "ops@a.example", tmp_path)

    worker = Engine(tmp_path / "worker", trust=allowed)
    assert worker.import_artifact(REFERENCE_KEY, out).outcome is StoreOutcome.STORED
    assert [s["producer"] for s in worker.signers(REFERENCE_KEY)] == ["ops@a.example"]
    assert worker.resolve(REFERENCE_KEY, tmp_path / "resolved") is not None


def test_the_trust_policy_comes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, public = keygen(tmp_path, "k", "k@x")
    allowed = tmp_path / "allowed_signers"
    allowed.write_text(f"k@x {public}\n")
    revoked = tmp_path / "revoked"
    revoked.write_text(f"{public}\n")
    monkeypatch.setenv("TORCH_COMPILED_GRAPHS_TRUST", str(allowed))
    assert Engine(tmp_path / "a").trusting
    monkeypatch.setenv("TORCH_COMPILED_GRAPHS_TRUST", str(tmp_path / "missing"))
    with pytest.raises(OSError):
        Engine(tmp_path / "b")
    monkeypatch.delenv("TORCH_COMPILED_GRAPHS_TRUST")
    monkeypatch.setenv("TORCH_COMPILED_GRAPHS_REVOKED_KEYS", str(revoked))
    with pytest.raises(TrustError) as e:
        Engine(tmp_path / "c")
    assert e.value.code == "trust.allowed_signers_invalid"


def test_cli_sign_export_verify_inspect_and_import(tmp_path: Path) -> None:
    key, public = keygen(tmp_path, "ci", "ci@a.example")
    _, stranger = keygen(tmp_path, "stranger", "s@x")
    store = str(tmp_path / "store")
    assert cli("import", "--cas-root", store, REFERENCE_KEY, str(ENVELOPE)).returncode == 0
    signed = cli("sign", "--cas-root", store, "--key", str(key), REFERENCE_KEY, "--json")
    assert signed.returncode == 0, signed.stderr
    assert json.loads(signed.stdout)["producer"] == "ci@a.example"
    out = tmp_path / "graph.tar.gz"
    assert cli("export", "--cas-root", store, REFERENCE_KEY, str(out)).returncode == 0
    assert sig(out).is_file()

    allowed = tmp_path / "allowed_signers"
    allowed.write_text(f"ci@a.example {public}\n")
    ok = cli("verify", "--trust", str(allowed), str(out), "--json")
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout)
    assert report["trusted"] is True and report["trusted_by"]["producer"] == "ci@a.example"
    # Trust was decided on the bytes verified: their digest is the one the signature states.
    statement = json.loads(json.loads(sig(out).read_text())["signatures"][0]["statement"])
    assert report["envelope_sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    assert report["envelope_sha256"] == statement["envelope_sha256"]

    inspected = json.loads(cli("inspect", str(out), "--json").stdout)
    assert [(s["producer"], s["valid"]) for s in inspected["signatures"]] == [("ci@a.example", True)]
    text = cli("inspect", str(out))
    assert json.loads(text.stdout)["compiled_graph_key"] == REFERENCE_KEY, "stdout stays the metadata JSON"
    assert "signature SHA256:" in text.stderr

    untrusted = tmp_path / "untrusted_signers"
    untrusted.write_text(f"ci@a.example {stranger}\n")
    refused = cli("verify", "--trust", str(untrusted), str(out))
    assert refused.returncode == 1
    assert "code: trust.untrusted_signer" in refused.stderr and "hint:" in refused.stderr

    # import honours --trust and the environment alike.
    bare = tmp_path / "bare.tar.gz"
    shutil.copy(ENVELOPE, bare)
    env = {"TORCH_COMPILED_GRAPHS_TRUST": str(allowed)}
    refused = cli("import", "--cas-root", str(tmp_path / "w1"), REFERENCE_KEY, str(bare), env=env)
    assert refused.returncode == 1 and "code: trust.unsigned" in refused.stderr
    done = cli("import", "--cas-root", str(tmp_path / "w2"), "--trust", str(allowed), REFERENCE_KEY, str(out))
    assert done.returncode == 0, done.stderr

    # A broken policy file is a usage error (exit 2), not a verdict.
    ca = tmp_path / "ca_signers"
    ca.write_text(f"* cert-authority {public}\n")
    broken = cli("verify", "--trust", str(ca), str(out))
    assert broken.returncode == 2 and "code: trust.cert_authority_unsupported" in broken.stderr


def test_cli_verify_accepts_a_signature_made_by_ssh_keygen(tmp_path: Path) -> None:
    key, public = keygen(tmp_path, "ext", "ext@a.example")
    # The statement is made by our signer (any key) and re-signed by OpenSSH's own tool.
    store = str(tmp_path / "store")
    cli("import", "--cas-root", store, REFERENCE_KEY, str(ENVELOPE))
    assert cli("sign", "--cas-root", store, "--key", str(key), REFERENCE_KEY).returncode == 0
    out = tmp_path / "graph.tar.gz"
    cli("export", "--cas-root", store, REFERENCE_KEY, str(out))
    entry = json.loads(sig(out).read_bytes())["signatures"][0]
    statement = tmp_path / "statement.json"
    statement.write_text(entry["statement"])
    subprocess.run(
        ["ssh-keygen", "-q", "-Y", "sign", "-n", "torch-compiled-graphs", "-f", str(key), str(statement)], check=True
    )
    entry["sshsig"] = Path(f"{statement}.sig").read_text()
    doc = {"format": 1, "signatures": [entry], "type": "torch-compiled-graphs.signatures"}
    sig(out).write_text(json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n")
    allowed = tmp_path / "allowed_signers"
    allowed.write_text(f"ext@a.example {public}\n")
    ok = cli("verify", "--trust", str(allowed), str(out))
    assert ok.returncode == 0, ok.stderr


@pytest.mark.real_aoti
def test_a_real_mint_is_signed_by_the_configured_key(tmp_path: Path) -> None:
    import torch

    from torch_compiled_graphs import EnsureOutcome, GraphClassSpec, RuntimeCompatibility, record_toolchain

    class Small(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).relu()

    program = torch.export.export(Small().eval(), (torch.randn(2, 4),))
    spec = GraphClassSpec("trust/small", "trust", program)
    toolchain = record_toolchain()
    key = str(RuntimeCompatibility("cpu", toolchain=toolchain).key(spec.declare()))
    private, public = keygen(tmp_path, "node_key", "node@fleet")
    node = Engine(tmp_path / "node", signing_key=private)
    assert node.signing
    r = node.ensure(key, tmp_path / "out", target="cpu", toolchain=toolchain, recipe=lambda: spec)
    assert r.outcome is EnsureOutcome.MINTED
    assert [s["producer"] for s in node.signers(key)] == ["node@fleet"]
    out = tmp_path / "graph.tar.gz"
    node.export_artifact(key, out)
    allowed = tmp_path / "allowed_signers"
    allowed.write_text(f"node@fleet {public}\n")
    entry = json.loads(sig(out).read_bytes())["signatures"][0]
    assert ssh_keygen_verifies(entry, allowed, "node@fleet", tmp_path)
    worker = Engine(tmp_path / "worker", trust=allowed)
    assert worker.import_artifact(key, out).outcome is StoreOutcome.STORED
