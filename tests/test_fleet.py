"""The fleet tier (docs/fleet.md) against a real S3 server (moto, started here on loopback),
with a fault proxy between the engine and moto and a deliberately broken stub for
``fleet doctor``."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REFERENCE, REFERENCE_KEY
from tests.fleet_support import (
    CREDENTIALS,
    Fault,
    FaultProxy,
    Moto,
    broken_s3,
    cli,
    free_port,
    moto_server,
    point_at,
    wait_port,
)

OTHER_KEY = REFERENCE_KEY[:-1] + ("0" if REFERENCE_KEY[-1] != "0" else "1")


@pytest.fixture(scope="module")
def moto() -> Iterator[Moto]:
    with moto_server() as m:
        yield m


@pytest.fixture
def fleet(moto: Moto, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """A fresh bucket; the AWS_* variables point at moto; the doctor's cache is private."""
    return point_at(moto, monkeypatch, tmp_path, "2")


def engine(root: Path, remote: str | None) -> Any:
    from torch_compiled_graphs import Engine

    return Engine(root, remote=remote or "")


def push_reference(tmp_path: Path, url: str) -> Any:
    a = engine(tmp_path / "a", url)
    a.import_artifact(REFERENCE_KEY, REFERENCE / "mlp-cpu.tar.gz")
    out = cli("push", "--cas-root", str(tmp_path / "a"), "--remote", url, "--json", REFERENCE_KEY, env={})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)[0]["outcome"] == "STORED"
    return a


def s3(moto: Moto) -> Any:
    """A boto3 client on moto (moto depends on boto3): the tests' raw view of the bucket."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=moto.endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )


def split(url: str) -> tuple[str, str]:
    bucket, prefix = url[len("s3://") :].split("/", 1)
    return bucket, f"{prefix}/tcg/v1"


def raw_get(moto: Moto, url: str, rest: str) -> bytes:
    bucket, root = split(url)
    body: bytes = s3(moto).get_object(Bucket=bucket, Key=f"{root}/{rest}")["Body"].read()
    return body


def raw_put(moto: Moto, url: str, rest: str, body: bytes) -> None:
    bucket, root = split(url)
    s3(moto).put_object(Bucket=bucket, Key=f"{root}/{rest}", Body=body)


def list_names(moto: Moto, url: str, folder: str) -> list[str]:
    bucket, root = split(url)
    found = s3(moto).list_objects_v2(Bucket=bucket, Prefix=f"{root}/{folder}/")
    return [o["Key"] for o in found.get("Contents", [])]


def test_push_then_resolve_from_another_store_says_remote_then_local(fleet: str, moto: Moto, tmp_path: Path) -> None:
    push_reference(tmp_path, fleet)
    ref = raw_get(moto, fleet, f"refs/{REFERENCE_KEY}")
    record = json.loads(ref)
    assert sorted(record) == ["created", "format", "key", "manifest", "producer"]
    assert record["key"] == REFERENCE_KEY and record["format"] == 1
    b = engine(tmp_path / "b", fleet)
    assert b.remote == fleet
    first = b.resolve(REFERENCE_KEY, tmp_path / "g1")
    assert first is not None and first.source == "remote"
    assert f"sha256:{first.manifest}" == record["manifest"]
    second = b.resolve(REFERENCE_KEY, tmp_path / "g2")
    assert second is not None and second.source == "local"
    stats = b.stats()
    assert stats["remote_hits"] == 1 and stats["remote_errors"] == 0


def test_resolve_cli_with_remote_and_pull_prefetch(fleet: str, tmp_path: Path) -> None:
    push_reference(tmp_path, fleet)
    keys = tmp_path / "keys.txt"
    keys.write_text(f"# warm-up list\n{REFERENCE_KEY}\n")
    store = str(tmp_path / "c")
    out = cli("pull", "--cas-root", store, "--remote", fleet, "--from", str(keys), "--json", env={})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [{"key": REFERENCE_KEY, "signatures": 0, "source": "remote"}]
    # The record only: its first resolve reads the envelope and records the admitted copy.
    from torch_compiled_graphs import LocalCAS

    admitted = f"torch-compiled-graphs/v1/admitted/{REFERENCE_KEY}/"
    assert LocalCAS(store).refs(admitted) == []
    # Offline now: the pulled record serves without any remote.
    assert engine(tmp_path / "c", None).resolve(REFERENCE_KEY, tmp_path / "g") is not None
    assert len(LocalCAS(store).refs(admitted)) == 3
    # --admitted-copy stores it with the record.
    out = cli("pull", "--cas-root", str(tmp_path / "c2"), "--remote", fleet, "--admitted-copy", REFERENCE_KEY, env={})
    assert out.returncode == 0, out.stderr
    assert len(LocalCAS(tmp_path / "c2").refs(admitted)) == 3
    assert engine(tmp_path / "c2", None).resolve(REFERENCE_KEY, tmp_path / "g2") is not None
    miss = cli("pull", "--cas-root", store, "--remote", fleet, OTHER_KEY, env={})
    assert miss.returncode == 1
    out = cli(
        "resolve",
        "--cas-root",
        str(tmp_path / "d"),
        "--remote",
        fleet,
        "--json",
        REFERENCE_KEY,
        str(tmp_path / "gd"),
        env={},
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["source"] == "remote"
    # With a remote, resolve creates the missing local store (a fetch writes);
    # without one it is read-only: a missing store is store.not_found and
    # nothing is created. push only reads the local store, so it needs it too.
    assert (tmp_path / "d" / "FORMAT").exists()
    for args in (
        ("resolve", "--cas-root", str(tmp_path / "e"), REFERENCE_KEY, str(tmp_path / "ge")),
        ("push", "--cas-root", str(tmp_path / "e"), "--remote", fleet, REFERENCE_KEY),
    ):
        refused = cli(*args, env={"TORCH_COMPILED_GRAPHS_REMOTE": ""})
        assert refused.returncode == 2, refused.stderr
        assert "code: store.not_found" in refused.stderr, refused.stderr
        assert not (tmp_path / "e").exists()


def test_the_environment_names_the_remote(fleet: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_compiled_graphs import Engine

    push_reference(tmp_path, fleet)
    monkeypatch.setenv("TORCH_COMPILED_GRAPHS_REMOTE", fleet)
    e = Engine(tmp_path / "env")
    assert e.remote == fleet
    found = e.resolve(REFERENCE_KEY, tmp_path / "g")
    assert found is not None and found.source == "remote"
    assert Engine(tmp_path / "none", remote="").remote is None


def test_the_remote_verdict_uses_store_outcome_values() -> None:
    from torch_compiled_graphs import StoreOutcome
    from torch_compiled_graphs.engine import _remote_publication

    for native, value in [("STORED", "stored"), ("PRESENT", "present"), ("DIVERGENT", "divergent")]:
        got = _remote_publication({"outcome": native, "manifest": "ab" * 32})
        assert got is not None and got["outcome"] == value and got["manifest"] == "ab" * 32
        assert got["outcome"] is StoreOutcome(value)
    assert _remote_publication(None) is None


def test_explain_says_whether_the_remote_has_the_key(
    fleet: str, moto: Moto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_explain_reference import declaration, reference_metadata

    md = reference_metadata()
    sm, toolchain = md["sm"], md["toolchain"]
    # Not yet on the remote; a store with no remote says nothing (None).
    b = engine(tmp_path / "b", fleet)
    assert b.explain(declaration(), target=sm, toolchain=toolchain).remote == {"state": "absent"}
    assert engine(tmp_path / "n", None).explain(declaration(), target=sm, toolchain=toolchain).remote is None
    push_reference(tmp_path, fleet)
    e = b.explain(declaration(), target=sm, toolchain=toolchain)
    record = json.loads(raw_get(moto, fleet, f"refs/{REFERENCE_KEY}"))
    assert not e.present and e.remote == {"state": "present", "manifest": record["manifest"][len("sha256:") :]}
    assert e.report["remote"] == e.remote
    assert f"on the remote: manifest {e.remote['manifest']}" in str(e)
    # Explaining fetched nothing.
    assert b.stats()["remote_hits"] == 0 and not b.explain(declaration(), target=sm, toolchain=toolchain).present
    # The CLI's `explain KEY_A KEY_B` says the same for each key when a remote is configured.
    out = cli(
        "explain", "--cas-root", str(tmp_path / "a"), "--remote", fleet, "--json", REFERENCE_KEY, REFERENCE_KEY, env={}
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["remote"] == {"a": e.remote, "b": e.remote}
    text = cli("explain", "--cas-root", str(tmp_path / "a"), "--remote", fleet, REFERENCE_KEY, REFERENCE_KEY, env={})
    assert f"{REFERENCE_KEY}: on the remote (manifest {e.remote['manifest']})" in text.stdout
    plain = cli("explain", "--cas-root", str(tmp_path / "a"), "--json", REFERENCE_KEY, REFERENCE_KEY, env={})
    assert plain.returncode == 0 and "remote" not in json.loads(plain.stdout)
    # A remote that fails reads as unknown, with the reason, never an error.
    proxy = FaultProxy(moto.port)
    try:
        proxy.fault = Fault("status", "/refs/", status=503)
        monkeypatch.setenv("AWS_ENDPOINT", proxy.endpoint)
        u = engine(tmp_path / "u", fleet).explain(declaration(), target=sm, toolchain=toolchain)
        assert u.remote is not None and u.remote["state"] == "unknown" and u.remote["reason"]
        assert "remote: unknown (" in str(u)
    finally:
        proxy.close()


def test_a_bad_remote_url_is_a_typed_error(tmp_path: Path) -> None:
    from torch_compiled_graphs import Engine
    from torch_compiled_graphs.errors import StorageError

    with pytest.raises(StorageError) as e:
        Engine(tmp_path / "s", remote="http://not-a-bucket")
    assert e.value.code == "remote.config_invalid"


# Every fault of the degrade-never-break list, injected between the engine and moto.
FAULTS = [
    pytest.param(Fault("status", "/chunks/", status=500), False, id="chunk-500"),
    pytest.param(Fault("status", "/refs/", status=503), False, id="ref-503"),
    pytest.param(Fault("status", "/manifests/", status=403), False, id="manifest-403"),
    pytest.param(Fault("delay", "/chunks/", delay=8.0), False, id="chunk-slow"),
    pytest.param(Fault("truncate", "/chunks/"), False, id="chunk-truncated"),
    pytest.param(Fault("reset", "/chunks/"), False, id="chunk-reset"),
    pytest.param(Fault("corrupt", "/chunks/"), True, id="chunk-corrupted"),
    pytest.param(Fault("corrupt", "/manifests/"), True, id="manifest-corrupted"),
]


@pytest.mark.parametrize(("fault", "evidence"), FAULTS)
def test_faults_are_misses_never_served_never_errors(
    fault: Fault, evidence: bool, fleet: str, moto: Moto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    push_reference(tmp_path, fleet)
    proxy = FaultProxy(moto.port)
    try:
        proxy.fault = fault
        monkeypatch.setenv("AWS_ENDPOINT", proxy.endpoint)
        b = engine(tmp_path / "b", fleet)
        assert b.resolve(REFERENCE_KEY, tmp_path / "g") is None
        assert not (tmp_path / "g").exists()
        assert proxy.fault.hits >= 1
        stats = b.stats()
        assert stats["remote_errors"] >= 1 and stats["remote_hits"] == 0
        assert stats["remote_reports"] == (1 if evidence else 0)
        assert len(list_names(moto, fleet, "reports")) == (1 if evidence else 0)
        # Healthy again: the same store fetches and serves.
        proxy.fault = Fault()
        found = b.resolve(REFERENCE_KEY, tmp_path / "g2")
        assert found is not None and found.source == "remote"
    finally:
        proxy.close()


def big_envelope(tmp_path: Path, mib: int) -> Path:
    """The reference package plus `mib` MiB of random bytes in one entry, packed anew (so the
    envelope spans several 64 MiB chunks)."""
    import tarfile
    import zipfile

    from torch_compiled_graphs import artifact

    members = tmp_path / "members"
    members.mkdir()
    with tarfile.open(REFERENCE / "mlp-cpu.tar.gz") as tar:
        tar.extractall(members, filter="data")
    pkg = members / "model.pt2"
    with zipfile.ZipFile(pkg, "a", compression=zipfile.ZIP_STORED) as z:
        with z.open("model/data/aotinductor/model/mlp/filler.bin", "w", force_zip64=True) as f:
            for _ in range(mib):
                f.write(os.urandom(1 << 20))
    out = tmp_path / "big.tar.gz"
    artifact.pack(pkg, artifact.read_metadata(REFERENCE / "mlp-cpu.tar.gz"), out)
    return out


def test_a_record_of_several_chunks_is_served_a_missing_chunk_is_a_miss_and_a_false_file_digest_is_reported(
    fleet: str, moto: Moto, tmp_path: Path
) -> None:
    a = engine(tmp_path / "a", fleet)
    a.import_artifact(REFERENCE_KEY, big_envelope(tmp_path, 70))
    out = cli("push", "--cas-root", str(tmp_path / "a"), "--remote", fleet, REFERENCE_KEY, env={})
    assert out.returncode == 0, out.stderr
    record = json.loads(raw_get(moto, fleet, f"refs/{REFERENCE_KEY}"))
    manifest = json.loads(raw_get(moto, fleet, f"manifests/sha256/{record['manifest'][7:]}"))
    assert len(manifest["chunks"]) == 2

    # Whole: fetched chunk by chunk (the whole-file hash continues from the first chunk's
    # check), the same manifest as the remote's, the members as the publisher's.
    b = engine(tmp_path / "b", fleet)
    got = b.resolve(REFERENCE_KEY, tmp_path / "g0")
    assert got is not None and got.source == "remote"
    assert f"sha256:{got.manifest}" == record["manifest"]
    mine = a.resolve(REFERENCE_KEY, tmp_path / "mine")
    assert mine is not None and mine.manifest == got.manifest
    for member in ("model.pt2", "metadata.json"):
        assert (tmp_path / "g0" / member).read_bytes() == (tmp_path / "mine" / member).read_bytes()

    # The second chunk missing: a miss (no report, no error), the first chunk's bytes unused.
    bucket, root = split(fleet)
    digest = manifest["chunks"][1]["digest"][7:]
    second = f"{root}/chunks/sha256/{digest[:2]}/{digest}"
    kept = s3(moto).get_object(Bucket=bucket, Key=second)["Body"].read()
    s3(moto).delete_object(Bucket=bucket, Key=second)
    c = engine(tmp_path / "c", fleet)
    assert c.resolve(REFERENCE_KEY, tmp_path / "g1") is None
    stats = c.stats()
    assert (stats["remote_misses"], stats["remote_errors"], stats["remote_reports"]) == (1, 0, 0)
    assert not (tmp_path / "g1").exists()
    s3(moto).put_object(Bucket=bucket, Key=second, Body=kept)

    # Every chunk intact and matching its digest, but the manifest states another whole-file
    # SHA-256: proof that the record is bad, reported, never served.
    manifest["digest"] = "sha256:" + hashlib.sha256(b"not the file").hexdigest()
    lie = json.dumps(manifest, separators=(",", ":"), sort_keys=True).encode()
    lie_name = hashlib.sha256(lie).hexdigest()
    raw_put(moto, fleet, f"manifests/sha256/{lie_name}", lie)
    record["manifest"] = f"sha256:{lie_name}"
    raw_put(moto, fleet, f"refs/{REFERENCE_KEY}", json.dumps(record, separators=(",", ":"), sort_keys=True).encode())
    d = engine(tmp_path / "d", fleet)
    assert d.resolve(REFERENCE_KEY, tmp_path / "g") is None
    assert not (tmp_path / "g").exists()
    stats = d.stats()
    assert stats["remote_hits"] == 0 and stats["remote_reports"] == 1
    assert len(list_names(moto, fleet, "reports")) == 1


def test_an_unreachable_remote_is_a_miss_and_a_local_hit_never_contacts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    dead = free_port()
    monkeypatch.setenv("AWS_ENDPOINT", f"http://127.0.0.1:{dead}")
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("TORCH_COMPILED_GRAPHS_REMOTE_TIMEOUT_S", "1")
    e = engine(tmp_path / "s", "s3://nowhere/p")
    e.import_artifact(REFERENCE_KEY, REFERENCE / "mlp-cpu.tar.gz")
    assert e.resolve(REFERENCE_KEY, tmp_path / "g") is not None
    assert e.stats()["remote_errors"] == 0
    with caplog.at_level(logging.WARNING, logger="torch_compiled_graphs"):
        assert e.resolve(OTHER_KEY, tmp_path / "g2") is None
    assert e.stats()["remote_errors"] == 1
    # The warning went to the package's logger (not raw stderr).
    warned = [r for r in caplog.records if r.name == "torch_compiled_graphs"]
    assert len(warned) == 1 and warned[0].getMessage().startswith(f"remote tier: {OTHER_KEY}: ")
    assert "remote tier" not in capfd.readouterr().err


def test_fleet_doctor_qualifies_moto(fleet: str, tmp_path: Path) -> None:
    out = cli("fleet", "doctor", "--remote", fleet, "--json", env={})
    assert out.returncode == 0, out.stderr
    v = json.loads(out.stdout)
    assert v["qualified"] is True and v["race_winners"] == 1 and v["racers"] == 16
    assert v["second_create_refused"] and v["stale_update_refused"] and v["race_body_intact"]
    # moto does not validate upload checksums: the altered upload is accepted, and reported.
    assert v["checksum_refused"] is False
    text = cli("fleet", "doctor", "--remote", fleet, env={})
    assert "wrong upload checksum refused: false (accepted; reported, not required)" in text.stdout
    cached = list((tmp_path / "cache" / "torch-compiled-graphs-fleet-doctor").iterdir())
    assert len(cached) == 1 and json.loads(cached[0].read_text())["qualified"] is True
    # The verdict lives beside the default store root, never inside it: Engine() on the
    # default root still opens (it refuses a root holding anything but a store).
    assert not (tmp_path / "cache" / "torch-compiled-graphs").exists()
    from torch_compiled_graphs import Engine

    Engine()
    assert cli("ls", "--json", env={}).returncode == 0


def test_fleet_doctor_reports_a_server_that_refuses_a_wrong_checksum(tmp_path: Path) -> None:
    """ministack==1.5.33 validates upload checksums (moto does not, FLEET.md §8): installed
    by this test into its own venv under the test's tmp dir, then qualified by the doctor."""
    import http.client
    import shutil
    import subprocess
    import sys

    # uv as the Makefile runs it (`python3 -m uv`, installed into the base
    # interpreter), or from PATH.
    found = shutil.which("uv")
    uv = [found] if found else [os.path.join(sys.base_prefix, "bin", "python3"), "-m", "uv"]
    venv = tmp_path / "ministack-venv"
    subprocess.run([*uv, "venv", "-q", str(venv), "-p", sys.executable], check=True, timeout=300)
    install = [*uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python"), "ministack==1.5.33"]
    subprocess.run(install, check=True, timeout=600)
    port = free_port()
    server = subprocess.Popen(
        [str(venv / "bin" / "ministack")],
        env={**os.environ, "GATEWAY_PORT": str(port), "MINISTACK_HOST": "127.0.0.1", "SERVICES": "s3"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_port(port)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("PUT", "/doctor")
        assert conn.getresponse().status == 200
        env = {
            **CREDENTIALS,
            "AWS_ENDPOINT": f"http://127.0.0.1:{port}",
            "XDG_CACHE_HOME": str(tmp_path / "cache"),
        }
        out = cli("fleet", "doctor", "--remote", "s3://doctor/p", "--json", env=env)
        assert out.returncode == 0, out.stderr
        v = json.loads(out.stdout)
        assert v["checksum_refused"] is True and v["qualified"] is True
        text = cli("fleet", "doctor", "--remote", "s3://doctor/p", env=env)
        assert "wrong upload checksum refused: true\n" in text.stdout
    finally:
        server.kill()
        server.wait(timeout=30)


def test_fleet_doctor_flags_a_store_that_lets_two_racers_win(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with broken_s3() as endpoint:
        env = {
            "AWS_ENDPOINT": endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": "x",
            "AWS_SECRET_ACCESS_KEY": "x",
            "AWS_REGION": "us-east-1",
        }
        out = cli("fleet", "doctor", "--remote", "s3://broken/p", "--json", env=env)
    assert out.returncode == 1, out.stderr
    v = json.loads(out.stdout)
    assert v["qualified"] is False and v["race_winners"] > 1
    # The other checks pass on this stub: only the race gives it away.
    assert v["second_create_refused"] and v["stale_update_refused"]


def test_fleet_ls_fsck_gc_repair_and_prometheus_stats(fleet: str, moto: Moto, tmp_path: Path) -> None:
    push_reference(tmp_path, fleet)
    ls = cli("fleet", "ls", "--remote", fleet, "--json", env={})
    assert ls.returncode == 0 and [r["key"] for r in json.loads(ls.stdout)] == [REFERENCE_KEY]
    fsck = cli("fleet", "fsck", "--remote", fleet, "--deep", "--json", env={})
    assert fsck.returncode == 0, fsck.stdout
    gc = cli("fleet", "gc", "--remote", fleet, "--grace", "0", "--json", env={})
    assert gc.returncode == 0 and json.loads(gc.stdout)["freed_objects"] == 0
    # A ref pointing elsewhere: fetch refuses and reports; fsck flags it; repair (by the
    # operator, from a verified local record) replaces it with Update(etag).
    record = json.loads(raw_get(moto, fleet, f"refs/{REFERENCE_KEY}"))
    record["manifest"] = "sha256:" + "ab" * 32
    forged = json.dumps(record, separators=(",", ":"), sort_keys=True).encode()
    raw_put(moto, fleet, f"refs/{REFERENCE_KEY}", forged)
    assert engine(tmp_path / "b", fleet).resolve(REFERENCE_KEY, tmp_path / "g") is None
    fsck = cli("fleet", "fsck", "--remote", fleet, "--json", env={})
    assert fsck.returncode == 1 and json.loads(fsck.stdout)["bad"]
    repair = cli(
        "fleet", "repair", "--cas-root", str(tmp_path / "a"), "--remote", fleet, "--json", REFERENCE_KEY, env={}
    )
    assert repair.returncode == 0, repair.stderr
    assert json.loads(repair.stdout)["outcome"] == "REPAIRED"
    found = engine(tmp_path / "c", fleet).resolve(REFERENCE_KEY, tmp_path / "g3")
    assert found is not None and found.source == "remote"
    prom = cli("stats", "--cas-root", str(tmp_path / "c"), "--prometheus", env={})
    assert prom.returncode == 0
    assert "# TYPE torch_compiled_graphs_remote_hits_total counter" in prom.stdout
    assert "torch_compiled_graphs_remote_hits_total 1" in prom.stdout.splitlines()
    assert "torch_compiled_graphs_store_bytes " in prom.stdout


def test_fleet_commands_skip_unparseable_names_and_gc_refuses_an_incomplete_listing(
    fleet: str, moto: Moto, tmp_path: Path
) -> None:
    """Issue 25: one hostile name fails no listing (ls, fsck, gc, pull keep working; fsck
    names it), and gc never sweeps on a listing it could not complete."""
    push_reference(tmp_path, fleet)
    _, root = split(fleet)
    junk = ["refs//junk", "refs/not-a-key", f"refs/x/../{REFERENCE_KEY}", "chunks//junk", "manifests/./junk"]
    for rest in junk:
        raw_put(moto, fleet, rest, b"{}")
    ls = cli("fleet", "ls", "--remote", fleet, "--json", env={})
    assert ls.returncode == 0, ls.stderr
    assert [r["key"] for r in json.loads(ls.stdout)] == [REFERENCE_KEY]
    fsck = cli("fleet", "fsck", "--remote", fleet, "--json", env={})
    assert fsck.returncode == 1, fsck.stderr
    report = json.loads(fsck.stdout)
    assert report["bad"] == [] and report["clean"] is False
    named = {row["name"] for row in report["unparseable"]}
    assert {f"{root}/{rest}" for rest in junk} <= named, named
    before = sorted(list_names(moto, fleet, "chunks") + list_names(moto, fleet, "manifests"))
    # A cap the bucket does not fit in: gc refuses with its code and deletes nothing.
    refused = cli("fleet", "gc", "--remote", fleet, "--grace", "0", env={"TORCH_COMPILED_GRAPHS_REMOTE_LIST_CAP": "1"})
    assert refused.returncode == 2, refused.stderr
    assert "code: remote.listing_incomplete" in refused.stderr
    assert "nothing was changed" in refused.stderr
    assert sorted(list_names(moto, fleet, "chunks") + list_names(moto, fleet, "manifests")) == before
    gc = cli("fleet", "gc", "--remote", fleet, "--grace", "0", "--json", env={})
    assert gc.returncode == 0, gc.stderr
    assert json.loads(gc.stdout)["freed_objects"] == 0 and json.loads(gc.stdout)["unparseable"] >= 2
    pulled = cli("pull", "--cas-root", str(tmp_path / "p"), "--remote", fleet, "--json", env={})
    assert pulled.returncode == 0, pulled.stderr
    assert [(r["key"], r["source"]) for r in json.loads(pulled.stdout)] == [(REFERENCE_KEY, "remote")]


WORKER = r"""
import json, sys, time
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
sys.stdout.write("ready\n"); sys.stdout.flush()
sys.stdin.readline()  # the start signal: every worker starts together
start = time.perf_counter()
compiled = []
def recipe():
    compiled.append(1)
    return spec
r = Engine(sys.argv[1], remote=sys.argv[2]).ensure(key, sys.argv[3], target="cpu", toolchain=toolchain, recipe=recipe)
outcome = getattr(r.outcome, "name", str(r.outcome))
rp = r.remote_publication
elapsed = time.perf_counter() - start
out = {{"key": key, "outcome": outcome, "source": r.source, "compiled": len(compiled), "remote": rp}}
out["elapsed_s"] = elapsed
print(json.dumps(out))
"""


@pytest.mark.real_aoti
def test_eight_workers_on_eight_stores_compile_once(fleet: str, tmp_path: Path) -> None:
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parent.parent)
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(root=root))
    env = {**os.environ, "TORCH_COMPILED_GRAPHS_REMOTE_WAIT_S": "600"}
    workers = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / f"store{i}"), fleet, str(tmp_path / f"graph{i}")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(8)
    ]
    for w in workers:
        assert w.stdout is not None and w.stdout.readline().strip() == "ready"
    for w in workers:
        assert w.stdin is not None
        w.stdin.write("go\n")
        w.stdin.flush()
    results = []
    for w in workers:
        out, err = w.communicate(timeout=900)
        assert w.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(r["compiled"] for r in results) == 1, results
    assert sorted(r["source"] for r in results) == ["compiled"] + ["remote"] * 7, results
    assert {r["outcome"] for r in results if r["source"] == "remote"} == {"REUSED"}
    # The winner's remote verdict speaks StoreOutcome's lowercase values.
    assert [r["remote"]["outcome"] for r in results if r["source"] == "compiled"] == ["stored"]
    assert len({r["key"] for r in results}) == 1
