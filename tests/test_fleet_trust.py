"""The trust policy on the fleet tier (docs/fleet.md "Trust", docs/trust.md "The fleet"),
against the moto server the fleet tests use, with keys from the real ``ssh-keygen``.

An untrusted writer publishes first and owns ``refs/<key>``; trusting workers ignore its
artifact, one compiles and writes a signature record, and the others find and reuse the
signed artifact through the record, while a worker without a policy keeps following the ref.
The cheap cases use the reference artifact (import, ``sign``, ``push``); one test runs real
AOTInductor compiles in separate processes on separate stores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REFERENCE, REFERENCE_KEY
from tests.fleet_support import Moto, cli, moto_server, point_at
from tests.test_trust import keygen

TRUST_ENV = (
    "TORCH_COMPILED_GRAPHS_SIGNING_KEY",
    "TORCH_COMPILED_GRAPHS_TRUST",
    "TORCH_COMPILED_GRAPHS_REVOKED_KEYS",
    "TORCH_COMPILED_GRAPHS_PRODUCER",
)


@pytest.fixture(scope="module")
def moto() -> Iterator[Moto]:
    with moto_server() as m:
        yield m


@pytest.fixture
def fleet(moto: Moto, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    url = point_at(moto, monkeypatch, tmp_path, "5")
    for name in TRUST_ENV:
        monkeypatch.delenv(name, raising=False)
    return url


def s3_names(moto: Moto, url: str, folder: str) -> list[str]:
    import boto3

    bucket, prefix = url[len("s3://") :].split("/", 1)
    client = boto3.client(
        "s3",
        endpoint_url=moto.endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    found = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/tcg/v1/{folder}/")
    return [o["Key"][len(f"{prefix}/tcg/v1/") :] for o in found.get("Contents", [])]


def fingerprint_hex(public_key_file: Path) -> str:
    """The hex SHA-256 fingerprint, from ``ssh-keygen -l`` (base64 without padding)."""
    import base64

    out = subprocess.run(
        ["ssh-keygen", "-l", "-E", "sha256", "-f", str(public_key_file)], capture_output=True, text=True, check=True
    )
    b64 = out.stdout.split()[1].removeprefix("SHA256:")
    return base64.b64decode(b64 + "=" * (-len(b64) % 4)).hex()


def test_signed_records_on_the_remote_admit_and_unsigned_refs_are_refused(
    fleet: str, moto: Moto, tmp_path: Path
) -> None:
    from torch_compiled_graphs import Engine

    key, public = keygen(tmp_path, "k", "ci@fleet")
    allowed = tmp_path / "allowed_signers"
    allowed.write_text(f"ci@fleet {public}\n")
    # An untrusted writer publishes the reference unsigned.
    untrusted = tmp_path / "untrusted"
    Engine(untrusted, remote="").import_artifact(REFERENCE_KEY, REFERENCE / "mlp-cpu.tar.gz")
    out = cli("push", "--cas-root", str(untrusted), "--remote", fleet, "--json", REFERENCE_KEY, env={})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)[0]["signatures"] == 0
    # A trusting worker does not take it: a miss, counted, no evidence of bad bytes.
    t = Engine(tmp_path / "t", remote=fleet, trust=allowed)
    assert t.resolve(REFERENCE_KEY, tmp_path / "g-t") is None
    stats = t.stats()
    assert stats["remote_trust_refused"] == 1 and stats["remote_reports"] == 0 and stats["remote_hits"] == 0
    # pull under the policy says why (exit 1, the code on stderr).
    pull = ("pull", "--cas-root", str(tmp_path / "p"), "--remote", fleet, "--trust", str(allowed))
    out = cli(*pull, REFERENCE_KEY, env={})
    assert out.returncode == 1 and "trust.unsigned" in out.stderr, out.stderr
    [row] = Engine(tmp_path / "p2", remote=fleet, trust=allowed).pull([REFERENCE_KEY])
    assert (row["source"], row["refused"], row["signatures"]) == (None, "trust.unsigned", 0), row
    # An operator signs the same artifact and pushes its record beside the ref.
    signer = tmp_path / "signer"
    Engine(signer, remote="").import_artifact(REFERENCE_KEY, REFERENCE / "mlp-cpu.tar.gz")
    out = cli("sign", "--cas-root", str(signer), "--key", str(key), REFERENCE_KEY, env={})
    assert out.returncode == 0, out.stderr
    out = cli("push", "--cas-root", str(signer), "--remote", fleet, "--json", REFERENCE_KEY, env={})
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)[0]
    assert row["outcome"] == "PRESENT" and row["signatures"] == 1, row
    names = s3_names(moto, fleet, "signatures")
    assert len(names) == 1
    _, k, fp, manifest, digest = names[0].split("/")
    assert (k, fp, manifest) == (REFERENCE_KEY, fingerprint_hex(Path(f"{key}.pub")), row["manifest"])
    assert len(digest) == 64
    # Now the trusting worker admits it, with its signature.
    found = t.resolve(REFERENCE_KEY, tmp_path / "g-t2")
    assert found is not None and found.source == "remote" and found.manifest == row["manifest"]
    assert [s["producer"] for s in t.signers(REFERENCE_KEY)] == ["ci@fleet"]
    # pull under the policy stores it and its record.
    out = cli(*pull, "--json", REFERENCE_KEY, env={})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [{"key": REFERENCE_KEY, "signatures": 1, "source": "remote"}]
    # fsck checks the record; gc keeps what it names.
    out = cli("fleet", "fsck", "--remote", fleet, "--json", env={})
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["signatures_checked"] == 1 and report["bad_signatures"] == []


WORKER = """
import json, os, sys
sys.path.insert(0, {root!r})
import torch
from torch_compiled_graphs import Engine, GraphClassSpec, RuntimeCompatibility, record_toolchain
from tests.models import MLP

torch.manual_seed(0)
model = MLP().eval()
program = torch.export.export(model, (torch.randn(2, 16),))
spec = GraphClassSpec("fleet/mlp", "serve", program)
toolchain = record_toolchain()
key = RuntimeCompatibility("cpu", toolchain=toolchain).key(spec.declare())
sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.readline()  # the start signal
compiled = []
def recipe():
    compiled.append(1)
    return spec
engine = Engine(sys.argv[1], remote=sys.argv[2])
r = engine.ensure(key, sys.argv[3], target="cpu", toolchain=toolchain, recipe=recipe)
print(json.dumps({{
    "key": key,
    "outcome": getattr(r.outcome, "name", str(r.outcome)),
    "source": r.compiled_graph.source,
    "manifest": r.compiled_graph.manifest,
    "remote_outcome": (r.remote_publication or {{}}).get("outcome"),
    "compiled": len(compiled),
    "signers": len(engine.signers(key)),
    "refused": engine.stats()["remote_trust_refused"],
}}))
"""


def start(script: Path, store: Path, url: str, graph: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    w = subprocess.Popen(
        [sys.executable, str(script), str(store), url, str(graph)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert w.stdout is not None and w.stdout.readline().strip() == "ready"
    return w


def finish(workers: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    for w in workers:
        assert w.stdin is not None
        w.stdin.write("go\n")
        w.stdin.flush()
    results = []
    for w in workers:
        out, err = w.communicate(timeout=900)
        assert w.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.real_aoti
def test_trusting_workers_ignore_an_untrusted_first_writer_and_compile_once(fleet: str, tmp_path: Path) -> None:
    root = str(Path(__file__).resolve().parent.parent)
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(root=root))
    key, public = keygen(tmp_path, "k", "ci@fleet")
    allowed = tmp_path / "allowed_signers"
    allowed.write_text(f"ci@fleet {public}\n")
    base = {k: v for k, v in os.environ.items() if k not in TRUST_ENV}
    base["TORCH_COMPILED_GRAPHS_REMOTE_WAIT_S"] = "600"
    # An untrusted writer (no signing key, no policy) compiles and publishes first.
    [untrusted] = finish([start(script, tmp_path / "u", fleet, tmp_path / "gu", base)])
    assert (untrusted["source"], untrusted["remote_outcome"], untrusted["signers"]) == ("compiled", "stored", 0)
    # Three trusting workers start together: they sign with the key their policy lists.
    trusting = {
        **base,
        "TORCH_COMPILED_GRAPHS_TRUST": str(allowed),
        "TORCH_COMPILED_GRAPHS_SIGNING_KEY": str(key),
    }
    workers = [start(script, tmp_path / f"t{i}", fleet, tmp_path / f"gt{i}", trusting) for i in range(3)]
    results = finish(workers)
    assert sum(r["compiled"] for r in results) == 1, results
    assert sorted(r["source"] for r in results) == ["compiled", "remote", "remote"], results
    leader = next(r for r in results if r["source"] == "compiled")
    # It lost the ref to the untrusted writer, and its record makes it reachable.
    assert leader["remote_outcome"] == "divergent" and leader["manifest"] != untrusted["manifest"], results
    assert {r["manifest"] for r in results} == {leader["manifest"]}
    assert all(r["signers"] == 1 and r["refused"] >= 1 for r in results), results
    # A worker without a policy keeps following the ref.
    [plain] = finish([start(script, tmp_path / "n", fleet, tmp_path / "gn", base)])
    assert (plain["source"], plain["compiled"], plain["manifest"]) == ("remote", 0, untrusted["manifest"])


def test_resolve_applies_the_policy_from_the_environment_and_local_hits_need_an_admission(
    fleet: str, tmp_path: Path
) -> None:
    """Issue 25: with TORCH_COMPILED_GRAPHS_TRUST set, ``resolve --remote`` must not fetch and
    serve an unsigned artifact; and a record an untrusting engine fetched is never served as
    a local hit by a trusting engine over the same store, until a trusted signature admits it."""
    from torch_compiled_graphs import Engine

    key, public = keygen(tmp_path, "k", "ci@fleet")
    allowed = tmp_path / "allowed_signers"
    allowed.write_text(f"ci@fleet {public}\n")
    untrusted = tmp_path / "untrusted"
    Engine(untrusted, remote="").import_artifact(REFERENCE_KEY, REFERENCE / "mlp-cpu.tar.gz")
    out = cli("push", "--cas-root", str(untrusted), "--remote", fleet, REFERENCE_KEY, env={})
    assert out.returncode == 0, out.stderr

    # The CLI resolve reads the policy from the environment: a miss, nothing stored.
    worker = tmp_path / "worker"
    env = {"TORCH_COMPILED_GRAPHS_TRUST": str(allowed)}
    out = cli("resolve", "--cas-root", str(worker), "--remote", fleet, REFERENCE_KEY, str(tmp_path / "g1"), env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "trust.unsigned" in out.stderr and not (tmp_path / "g1").exists()
    assert Engine(worker, remote="").resolve(REFERENCE_KEY, tmp_path / "g1b") is None
    # The explicit flag too (and it wins over an empty variable).
    out = cli(
        "resolve", "--cas-root", str(worker), "--remote", fleet, "--trust", str(allowed), REFERENCE_KEY,
        str(tmp_path / "g2"), env={"TORCH_COMPILED_GRAPHS_TRUST": ""},
    )  # fmt: skip
    assert out.returncode == 1 and not (tmp_path / "g2").exists(), out.stderr

    # An untrusting fetch into the worker's store, then a trusting engine over it: no local hit.
    fetch = ("resolve", "--cas-root", str(worker), "--remote", fleet, "--json", REFERENCE_KEY, str(tmp_path / "g3"))
    out = cli(*fetch, env={})
    assert out.returncode == 0 and json.loads(out.stdout)["source"] == "remote", out.stderr
    t = Engine(worker, trust=allowed, remote="")
    assert t.resolve(REFERENCE_KEY, tmp_path / "g4") is None
    assert not (tmp_path / "g4").exists()
    out = cli("resolve", "--cas-root", str(worker), REFERENCE_KEY, str(tmp_path / "g5"), env=env)
    assert out.returncode == 1 and "not admitted by the trust policy" in out.stderr, out.stderr
    # A trusting engine with the remote still misses (the remote has nothing signed either).
    assert Engine(worker, trust=allowed, remote=fleet).resolve(REFERENCE_KEY, tmp_path / "g6") is None
    # An engine without a policy still serves it.
    assert Engine(worker, remote="").resolve(REFERENCE_KEY, tmp_path / "g7") is not None

    # Once a trusted signer signs the local record, the trusting engine re-checks and admits it.
    out = cli("sign", "--cas-root", str(worker), "--key", str(key), REFERENCE_KEY, env={})
    assert out.returncode == 0, out.stderr
    found = t.resolve(REFERENCE_KEY, tmp_path / "g8")
    assert found is not None and found.source == "local"
    out = cli("resolve", "--cas-root", str(worker), REFERENCE_KEY, str(tmp_path / "g9"), env=env)
    assert out.returncode == 0, out.stderr
