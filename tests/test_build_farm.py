"""The build farm end to end: a real two-node Ray cluster on 127.0.0.1, the S3 test server and
real AOTInductor compiles of tiny CPU cells (three through Ray, one through the local
executor). One built matrix is shared by the module's tests."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.build_support import ROOT, RayCluster, one_json_line, ray_cluster, record_lock, run_cli
from tests.fleet_support import Moto, moto_server

pytestmark = [
    pytest.mark.real_aoti,
    pytest.mark.skipif(sys.version_info < (3, 11), reason="the build matrix needs tomllib (Python 3.11)"),
]


def _matrix(remote: str, lock: str, marker: Path) -> str:
    return f"""\
remote = "{remote}"
toolchain = "{lock}"
targets = ["cpu"]

[[recipes]]
callable = "tests.build_recipes:mlp"
[recipes.grid]
width = [8, 16]

[[recipes]]
name = "killed-once"
callable = "tests.build_recipes:killer"
params = {{width = 24, marker = "{marker}"}}

[[recipes]]
name = "gpu"
callable = "tests.build_recipes:mlp"
targets = ["sm_90"]
params = {{width = 8}}

[ray]
retries = 2
"""


class Farm:
    def __init__(self, root: Path, moto: Moto, cluster: RayCluster, env: dict[str, str]) -> None:
        self.root, self.moto, self.cluster, self.env = root, moto, cluster, env
        self.remote = f"s3://{moto.create_bucket()}/fleet"
        self.lock = record_lock(root / "lock.json")
        self.marker = root / "killed.marker"
        self.matrix = root / "matrix.toml"
        self.matrix.write_text(_matrix(self.remote, "lock.json", self.marker))

    def build(self, matrix: Path, *args: str) -> tuple[int, dict[str, Any]]:
        out = run_cli("build", str(matrix), "--json", *args, env=self.env)
        assert out.stdout.strip(), out.stderr
        return out.returncode, json.loads(out.stdout)

    def remote_refs(self) -> list[str]:
        out = subprocess.run(
            [sys.executable, "-m", "torch_compiled_graphs.cli", "fleet", "ls", "--remote", self.remote, "--json"],
            capture_output=True,
            text=True,
            env={**_environ(), **self.env},
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        return sorted(json.dumps(row, sort_keys=True) for row in _rows(out.stdout))


def _rows(stdout: str) -> list[Any]:
    data = json.loads(stdout)
    rows = data.get("keys", data) if isinstance(data, dict) else data
    return list(rows)


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)


@pytest.fixture(scope="module")
def farm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Farm]:
    root = tmp_path_factory.mktemp("farm")
    with moto_server() as moto:
        env = {
            **moto.env(),
            "XDG_CACHE_HOME": str(root / "cache"),
            "TORCH_COMPILED_GRAPHS_REMOTE_TIMEOUT_S": "10",
            "TORCH_COMPILED_GRAPHS_REMOTE_LEASE_TTL_S": "5",
        }
        with ray_cluster(env) as cluster:
            yield Farm(root, moto, cluster, {**env, "RAY_ADDRESS": cluster.address})


@pytest.fixture(scope="module")
def first(farm: Farm) -> tuple[int, dict[str, Any]]:
    """The first build of the matrix through Ray (three compiles)."""
    return farm.build(farm.matrix, "--executor", "ray")


def _by_cell(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["cell"]: row for row in report["cells"]}


def test_ray_places_each_cell_on_a_node_that_carries_its_target(farm: Farm, first: tuple[int, dict[str, Any]]) -> None:
    rc, report = first
    cells = _by_cell(report)
    assert rc == 1, report  # the sm_90 cell is refused: this cluster has no GPU
    killed = f'killed-once[width=24,marker="{farm.marker}"]@cpu'
    assert set(cells) == {"mlp[width=8]@cpu", "mlp[width=16]@cpu", killed, "gpu[width=8]@sm_90"}
    for name in ("mlp[width=8]@cpu", "mlp[width=16]@cpu", killed):
        assert cells[name]["node"] == farm.cluster.head_node, cells[name]
    gpu = cells["gpu[width=8]@sm_90"]
    assert gpu["node"] == farm.cluster.gpu_node, gpu
    assert report["executor"] == "ray" and report["summary"]["cells"] == 4


def test_each_key_is_minted_once_and_published(farm: Farm, first: tuple[int, dict[str, Any]]) -> None:
    _, report = first
    minted = [row for row in report["cells"] if row["outcome"] == "minted"]
    assert len(minted) == 3 and report["summary"]["minted"] == 3
    keys = {row["key"] for row in minted}
    assert len(keys) == 3
    published = farm.remote_refs()
    assert sum(any(k in row for row in published) for k in keys) == 3, published
    assert len(published) == 3


def test_a_killed_cell_is_retried_and_completes(farm: Farm, first: tuple[int, dict[str, Any]]) -> None:
    _, report = first
    (killed,) = [row for row in report["cells"] if row["cell"].startswith("killed-once")]
    assert farm.marker.exists()  # the first attempt did kill itself
    assert killed["outcome"] == "minted" and killed["attempts"] == 2, killed


def test_a_refused_gpu_cell_is_explained_and_not_retried(first: tuple[int, dict[str, Any]]) -> None:
    _, report = first
    gpu = _by_cell(report)["gpu[width=8]@sm_90"]
    assert gpu["outcome"] == "refused" and gpu["code"] == "build.device_mismatch"
    assert gpu["attempts"] == 1 and "sees none" in gpu["message"]


def test_a_second_run_builds_nothing(farm: Farm, first: tuple[int, dict[str, Any]]) -> None:
    before = farm.remote_refs()
    matrix = farm.root / "cpu-only.toml"
    # The same cells without the one this cluster cannot build.
    text = farm.matrix.read_text()
    matrix.write_text(text[: text.index('[[recipes]]\nname = "gpu"')] + "[ray]\nretries = 2\n")
    rc, report = farm.build(matrix, "--executor", "ray")
    assert rc == 0, report
    assert [row["outcome"] for row in report["cells"]] == ["present"] * 3
    assert all(row["attempts"] == 0 and row["node"] == "plan" for row in report["cells"])
    assert {row["key"] for row in report["cells"]} == {
        row["key"] for row in first[1]["cells"] if row["outcome"] == "minted"
    }
    assert farm.remote_refs() == before


def test_a_node_with_another_toolchain_refuses_with_the_differing_fact(farm: Farm) -> None:
    other = {**farm.lock, "cxx": "f" * 16}
    (farm.root / "other-lock.json").write_text(json.dumps(other))
    matrix = farm.root / "other.toml"
    text = _matrix(farm.remote, "other-lock.json", farm.marker)
    matrix.write_text(text[: text.index("[[recipes]]\nname = ")] + "[ray]\nretries = 2\n")
    rc, report = farm.build(matrix, "--executor", "ray")
    assert rc == 1, report
    for row in report["cells"]:
        assert row["outcome"] == "refused" and row["code"] == "build.toolchain_mismatch", row
        assert row["fact"]["member"] == "cxx" and row["fact"]["lock"] == "f" * 16
        assert row["fact"]["here"] == farm.lock["cxx"]
        assert row["attempts"] == 1 and row["node"] == farm.cluster.head_node
        assert "'cxx'" in row["message"]


def test_the_local_executor_mints_a_new_cell_once(farm: Farm) -> None:
    matrix = farm.root / "local.toml"
    matrix.write_text(
        f'remote = "{farm.remote}"\ntoolchain = "lock.json"\ntargets = ["cpu"]\n'
        '[[recipes]]\ncallable = "tests.build_recipes:mlp"\ngrid = {width = [8, 32]}\n'
        '[k8s]\nimage = "registry.example/fleet:1"\n'
    )
    rc, report = farm.build(matrix, "--executor", "local", "--parallelism", "2")
    assert rc == 0, report
    cells = _by_cell(report)
    assert cells["mlp[width=8]@cpu"]["outcome"] == "present"  # Ray built it
    new = cells["mlp[width=32]@cpu"]
    assert new["outcome"] == "minted" and new["attempts"] == 1 and new["node"], new
    assert any(new["key"] in row for row in farm.remote_refs())


def test_the_job_command_runs_with_job_completion_index(farm: Farm, tmp_path: Path) -> None:
    rendered = run_cli("build", str(farm.root / "local.toml"), "--executor", "k8s", "--dry-run", env=farm.env)
    assert rendered.returncode == 0, rendered.stderr
    assert json.loads(rendered.stdout)["items"] == []  # nothing needs work: no Job at all
    # Render the Job for every cell (as a first run would) and run index 1 as its pod would.
    from torch_compiled_graphs.build import load_matrix
    from torch_compiled_graphs.build.k8s import render

    matrix = load_matrix(farm.root / "local.toml")
    manifest = json.loads(json.dumps(render(matrix, list(matrix.cells))))
    for name, text in manifest["items"][0]["data"].items():
        (tmp_path / name).write_text(text)
    (job,) = manifest["items"][1:]
    container = job["spec"]["template"]["spec"]["containers"][0]
    argv = [sys.executable, *(a.replace("/etc/tcg-build", str(tmp_path)) for a in container["command"][1:])]
    env = {**_environ(), **farm.env, "PYTHONPATH": str(ROOT), "JOB_COMPLETION_INDEX": "1"}
    env.update({e["name"]: e["value"] for e in container["env"]})
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    row = one_json_line(proc.stdout)
    assert row["index"] == 1 and row["outcome"] == "present" and row["cell"] == "mlp[width=32]@cpu"
