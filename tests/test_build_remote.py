"""The build farm's view of the remote, against the moto server the fleet tests use: a cell
is present only when a fresh worker can take its key (fetched, verified, and under a trust
policy signed by an allowed signer), never because a ref exists; ``signed`` says whether the
artifact is signed, not whether the builder holds a key. No compile: the artifacts are the
reference artifact (import, ``sign``, ``push``), and the cell that must build has its
compile refused."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.build_support import record_lock, write_matrix
from tests.conftest import REFERENCE, REFERENCE_KEY
from tests.fleet_support import Moto, cli, moto_server, point_at
from tests.test_fleet_trust import TRUST_ENV
from tests.test_trust import keygen

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="the build matrix needs tomllib (Python 3.11)")


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


@pytest.fixture(scope="module")
def lock(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    path = tmp_path_factory.mktemp("lock") / "lock.json"
    return path, record_lock(path)


def hostile_ref(moto: Moto, url: str, key: str) -> None:
    """What a writer the fleet does not trust can do: create ``refs/<key>`` first, naming a
    manifest that does not exist."""
    import boto3

    bucket, prefix = url[len("s3://") :].split("/", 1)
    record = {"created": int(time.time()), "format": 1, "key": key, "manifest": "sha256:" + "ab" * 32, "producer": "x"}
    body = json.dumps(record, separators=(",", ":"), sort_keys=True).encode()
    client = boto3.client(
        "s3",
        endpoint_url=moto.endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    client.put_object(Bucket=bucket, Key=f"{prefix}/tcg/v1/refs/{key}", Body=body)


def push_reference(tmp_path: Path, url: str, name: str, *, sign_with: Path | None = None) -> None:
    from torch_compiled_graphs import Engine

    store = tmp_path / name
    with pytest.MonkeyPatch.context() as mp:
        for variable in TRUST_ENV:  # the publisher is not the trusting fleet
            mp.delenv(variable, raising=False)
        Engine(store, remote="").import_artifact(REFERENCE_KEY, REFERENCE / "mlp-cpu.tar.gz")
        if sign_with is not None:
            out = cli("sign", "--cas-root", str(store), "--key", str(sign_with), REFERENCE_KEY, env={})
            assert out.returncode == 0, out.stderr
        out = cli("push", "--cas-root", str(store), "--remote", url, "--json", REFERENCE_KEY, env={})
        assert out.returncode == 0, out.stderr


def test_a_ref_naming_a_missing_manifest_is_not_present(fleet: str, moto: Moto) -> None:
    from torch_compiled_graphs.build.verdict import remote_verdict

    hostile_ref(moto, fleet, REFERENCE_KEY)
    verdict = remote_verdict(fleet, REFERENCE_KEY)
    assert not verdict.present and not verdict.signed and not verdict.trusting
    assert verdict.reason and "does not hold in full" in verdict.reason, verdict.reason


def test_an_unsigned_artifact_is_present_without_a_policy_and_refused_under_one(
    fleet: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch_compiled_graphs.build.verdict import remote_verdict

    push_reference(tmp_path, fleet, "untrusted")
    plain = remote_verdict(fleet, REFERENCE_KEY)
    assert (plain.present, plain.signed, plain.reason) == (True, False, None)
    _, public = keygen(tmp_path, "k", "ci@fleet")
    (tmp_path / "allowed").write_text(f"ci@fleet {public}\n")
    monkeypatch.setenv("TORCH_COMPILED_GRAPHS_TRUST", str(tmp_path / "allowed"))
    trusting = remote_verdict(fleet, REFERENCE_KEY)
    assert not trusting.present and not trusting.signed and trusting.trusting
    assert trusting.reason is not None and "trust.unsigned" in trusting.reason, trusting.reason


def test_an_artifact_signed_by_an_allowed_signer_is_present_and_signed(
    fleet: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch_compiled_graphs.build.verdict import remote_verdict

    key, public = keygen(tmp_path, "k", "ci@fleet")
    other, other_public = keygen(tmp_path, "o", "someone@else")
    push_reference(tmp_path, fleet, "signer", sign_with=other)
    (tmp_path / "allowed").write_text(f"ci@fleet {public}\n")
    monkeypatch.setenv("TORCH_COMPILED_GRAPHS_TRUST", str(tmp_path / "allowed"))
    # Signed, but by a key the policy does not allow: not present, not signed.
    refused = remote_verdict(fleet, REFERENCE_KEY)
    assert not refused.present and not refused.signed and refused.reason
    push_reference(tmp_path, fleet, "allowed-signer", sign_with=key)
    verdict = remote_verdict(fleet, REFERENCE_KEY)
    assert (verdict.present, verdict.signed, verdict.trusting, verdict.reason) == (True, True, True, None)
    assert other_public  # the other signer's record stays on the remote, ignored


MATRIX = """\
toolchain = "lock.json"
targets = ["cpu"]
remote = "{remote}"

[[recipes]]
callable = "tests.build_recipes:mlp"
params = {{seed = 7}}
[recipes.grid]
width = [8]
"""


def _matrix(tmp_path: Path, lock: tuple[Path, dict[str, str]], fleet: str) -> Any:
    from torch_compiled_graphs.build import load_matrix

    (tmp_path / "lock.json").write_text(json.dumps(lock[1]))
    return load_matrix(write_matrix(tmp_path / "matrix.toml", MATRIX.format(remote=fleet)))


def test_a_hostile_ref_does_not_make_a_cell_present_in_the_plan_or_the_cell_step(
    fleet: str, moto: Moto, tmp_path: Path, lock: tuple[Path, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regression: the plan and the cell step counted a cell as present when the remote had
    # any ref for its key, and reported signed: true when the builder had a signing key,
    # so nothing was ever built and every worker missed.
    import torch_compiled_graphs.compile as policy
    from torch_compiled_graphs import CompileError
    from torch_compiled_graphs.build import build_cell, plan
    from torch_compiled_graphs.build.cell import _call_recipe, cell_key

    matrix = _matrix(tmp_path, lock, fleet)
    key = cell_key(_call_recipe(matrix.cells[0]), matrix.cells[0], lock[1])
    hostile_ref(moto, fleet, key)
    signing, _ = keygen(tmp_path, "builder", "builder@fleet")
    monkeypatch.setenv("TORCH_COMPILED_GRAPHS_SIGNING_KEY", str(signing))

    (row,) = plan(matrix)
    assert row.key == key and row.state == "needs-mint" and not row.signed, row
    assert row.reason and "does not hold in full" in row.reason, row.reason

    # The cell step builds it: here the compile is refused, so the outcome is that refusal.
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise CompileError("compile refused by the test", "compile.failed")

    monkeypatch.setattr(policy, "compile_package", refused)
    result = build_cell(matrix, 0, here=lock[1])
    assert result.key == key
    assert result.outcome == "failed" and result.code == "compile.failed", result.to_json()
    assert result.signed is False
    assert result.fact is not None and result.fact["remote_before"]["present"] is False


def test_a_refused_cell_keeps_the_key_the_plan_derived(
    tmp_path: Path,
    lock: tuple[Path, dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Regression: `build` reported "key": null for a cell refused before its step derived
    # the key, although the plan had derived it.
    from tests.build_support import ROOT
    from torch_compiled_graphs.build.cli import main

    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the cell process imports tests.build_recipes
    monkeypatch.setenv("TORCH_COMPILED_GRAPHS_REMOTE", "")
    other = {**lock[1], "cxx": "0" * 16}
    (tmp_path / "lock.json").write_text(json.dumps(other))
    body = MATRIX.format(remote="").replace('remote = ""\n', "")
    path = write_matrix(tmp_path / "matrix.toml", f'store = "{tmp_path / "store"}"\n' + body)
    assert main(["build", str(path), "--json", "--parallelism", "1"]) == 1
    (cell,) = json.loads(capsys.readouterr().out)["cells"]
    assert cell["outcome"] == "refused" and cell["code"] == "build.toolchain_mismatch"
    assert cell["key"] is not None and cell["key"].startswith("cg-key-v1-"), cell
