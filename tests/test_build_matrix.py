"""The build farm without a compile: the matrix file, the lock, the cell step's refusals and
exit codes, the planner, the k8s manifest (checked with the official client's models) and
the command-line routing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.build_support import ROOT, one_json_line, record_lock, run_cli, write_matrix
from tests.fleet_support import free_port
from torch_compiled_graphs.build import (
    CELL_ENV,
    EXIT_DETERMINISTIC,
    EXIT_TRANSIENT,
    BuildError,
    build_cell,
    load_lock,
    load_matrix,
    parse_matrix,
)
from torch_compiled_graphs.build.cell import device_refusal, toolchain_refusal

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="the build matrix needs tomllib (Python 3.11)")

MATRIX = """\
toolchain = "lock.json"
targets = ["cpu"]

[[recipes]]
callable = "tests.build_recipes:mlp"
params = {seed = 3}
[recipes.grid]
width = [8, 16]

[[recipes]]
name = "gpu"
callable = "tests.build_recipes:mlp"
targets = ["sm_90", "cpu"]
params = {width = 4}
"""


@pytest.fixture(scope="module")
def lock(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    path = tmp_path_factory.mktemp("lock") / "lock.json"
    return path, record_lock(path)


def matrix_in(tmp_path: Path, lock: tuple[Path, dict[str, str]], body: str = MATRIX, block: Any = None) -> Path:
    (tmp_path / "lock.json").write_text(json.dumps(block if block is not None else lock[1]))
    return write_matrix(tmp_path / "matrix.toml", body)


# ----------------------------------------------------------------------------- the matrix file


def test_cells_follow_recipe_then_grid_then_target_order(tmp_path: Path) -> None:
    m = parse_matrix(MATRIX, tmp_path / "m.toml")
    assert [c.name for c in m.cells] == [
        "mlp[seed=3,width=8]@cpu",
        "mlp[seed=3,width=16]@cpu",
        "gpu[width=4]@sm_90",
        "gpu[width=4]@cpu",
    ]
    assert [c.index for c in m.cells] == [0, 1, 2, 3]
    assert m.cells[1].params == {"seed": 3, "width": 16}
    assert m.cells[2].gpu and m.cells[2].machine == "gpu sm_90" and not m.cells[0].gpu
    assert m.toolchain_path == (tmp_path / "lock.json").absolute()


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("toolchain = 'l'\n[[recipes]]\ncallable = 'a:b'\ntargets = ['cpu']\nsurprise = 1\n", "unknown member"),
        ("toolchain = 'l'\ntargets = ['gpu']\n[[recipes]]\ncallable = 'a:b'\n", "is not a target"),
        ("toolchain = 'l'\ntargets = ['cpu']\n[[recipes]]\ncallable = 'a.b'\n", "module:function"),
        ("toolchain = 'l'\ntargets = ['cpu']\n[[recipes]]\ncallable = 'a:b'\ngrid = {h = []}\n", "non-empty list"),
        ("toolchain = 'l'\ntargets = ['cpu']\n[[recipes]]\ncallable = 'a:b'\ngrid = {h = [1, 1]}\n", "twice"),
        ("toolchain = 'l'\n[[recipes]]\ncallable = 'a:b'\n", "no targets"),
        ("targets = ['cpu']\n[[recipes]]\ncallable = 'a:b'\n", "lock file"),
        ("toolchain = 'l'\ntargets = ['cpu']\n", "at least one recipe"),
        ("toolchain = 'l'\ntargets = ['cpu', 'cpu']\n[[recipes]]\ncallable = 'a:b'\n", "listed twice"),
        (
            "toolchain = 'l'\ntargets = ['cpu']\n[[recipes]]\ncallable = 'a:b'\n[[recipes]]\ncallable = 'c:b'\n",
            "used twice",
        ),
        ("toolchain = 'l'\ntargets = ['cpu']\n[[recipes]]\ncallable = 'a:b'\ngrid = {target = [1]}\n", "'target'"),
        ("toolchain = 'l'\nformat = 2\ntargets = ['cpu']\n[[recipes]]\ncallable = 'a:b'\n", "format 2"),
        ("toolchain = 'l'\n[ray]\nnum_gpus = 1\n[[recipes]]\ncallable = 'a:b'\ntargets = ['cpu']\n", "[ray]"),
        ("toolchain = = 'l'\n", "not valid TOML"),
    ],
)
def test_a_bad_matrix_is_refused_with_its_reason(tmp_path: Path, body: str, needle: str) -> None:
    with pytest.raises(BuildError) as e:
        parse_matrix(body, tmp_path / "m.toml")
    assert e.value.code == "build.matrix_invalid"
    assert needle in str(e.value) and str(tmp_path / "m.toml") in str(e.value)


def test_a_cell_index_outside_the_matrix_is_refused(tmp_path: Path) -> None:
    m = parse_matrix(MATRIX, tmp_path / "m.toml")
    with pytest.raises(BuildError) as e:
        m.cell(4)
    assert e.value.code == "build.index_out_of_range" and "4 cells" in str(e.value)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("{", "cannot read"),
        ("[1, 2]", "object of strings"),
        ('{"cxx": "a"}', "no torch member"),
        ('{"torch": " a"}', "not a toolchain block"),
    ],
)
def test_a_bad_lock_is_refused(tmp_path: Path, text: str, needle: str) -> None:
    (tmp_path / "l.json").write_text(text)
    with pytest.raises(BuildError) as e:
        load_lock(tmp_path / "l.json")
    assert e.value.code == "build.lock_invalid" and needle in str(e.value)


def test_toolchain_record_prints_this_installations_block(tmp_path: Path) -> None:
    from torch_compiled_graphs import record_toolchain

    block = record_lock(tmp_path / "lock.json")
    assert block == record_toolchain()
    assert load_lock(tmp_path / "lock.json") == block


# ----------------------------------------------------------------------------- refusals


def test_the_differing_toolchain_member_is_the_explanation() -> None:
    lock = {"torch": "a" * 16, "cxx": "b" * 16, "triton": "absent"}
    assert toolchain_refusal(lock, dict(lock)) is None
    refused = toolchain_refusal(lock, {**lock, "cxx": "c" * 16})
    assert refused is not None and refused.code == "build.toolchain_mismatch"
    assert refused.fact["member"] == "cxx" and refused.fact["lock"] == "b" * 16 and refused.fact["here"] == "c" * 16
    assert "'cxx'" in str(refused) and "more" not in str(refused)
    extra = toolchain_refusal(lock, {**lock, "torch": "d" * 16, "nvidia-cublas": "e" * 16})
    assert extra is not None and extra.fact["member"] == "torch" and "(and 1 more)" in str(extra)
    assert extra.fact["all"]["nvidia-cublas"] == {"lock": None, "here": "e" * 16}


def test_a_cell_sees_exactly_the_device_its_target_names() -> None:
    assert device_refusal("cpu", [], "cpu-x86-64-v3") is None
    assert device_refusal("sm_90", ["sm_90"], "cpu-x86-64-v3") is None
    assert device_refusal("sm_90a", ["sm_90"], "cpu-x86-64-v3") is None
    assert device_refusal("cpu-x86-64-v3", [], "cpu-x86-64-v3") is None
    cases = {
        ("cpu", ("sm_90",)): "must see no GPU",
        ("cpu-x86-64-v4", ()): "CPU level is cpu-x86-64-v3",
        ("sm_90", ()): "sees none",
        ("sm_90", ("sm_90", "sm_90")): "exactly one GPU",
        ("sm_90", ("sm_80",)): "capability sm_90",
    }
    for (target, gpus), needle in cases.items():
        refused = device_refusal(target, list(gpus), "cpu-x86-64-v3")
        assert refused is not None and refused.code == "build.device_mismatch", target
        assert needle in str(refused), (target, str(refused))


def test_build_cell_refuses_another_toolchain_with_the_differing_member(
    tmp_path: Path, lock: tuple[Path, dict[str, str]]
) -> None:
    other = {**lock[1], "cxx": "0" * 16}
    path = matrix_in(tmp_path, lock, MATRIX + f'store = "{tmp_path / "store"}"\n'.replace("store", "#"), other)
    out = run_cli("build-cell", str(path), "--index", "0")
    assert out.returncode == EXIT_DETERMINISTIC, out.stderr
    row = one_json_line(out.stdout)
    assert row["outcome"] == "refused" and row["code"] == "build.toolchain_mismatch"
    assert row["fact"]["member"] == "cxx" and row["fact"]["lock"] == "0" * 16
    assert row["fact"]["here"] == lock[1]["cxx"] and row["key"] is None
    assert "code: build.toolchain_mismatch" in out.stderr


def test_build_cell_refuses_a_gpu_cell_on_a_machine_without_that_gpu(
    tmp_path: Path, lock: tuple[Path, dict[str, str]]
) -> None:
    result = build_cell(load_matrix(matrix_in(tmp_path, lock)), 2)
    assert result.exit_code == EXIT_DETERMINISTIC
    assert result.outcome == "refused" and result.code == "build.device_mismatch"
    assert result.fact is not None and result.fact["lock"] == ["sm_90"] and result.name == "gpu[width=4]@sm_90"
    assert result.key is None  # refused before the recipe ran


def test_a_failing_recipe_is_a_deterministic_failure(tmp_path: Path, lock: tuple[Path, dict[str, str]]) -> None:
    body = 'toolchain = "lock.json"\ntargets = ["cpu"]\n[[recipes]]\ncallable = "tests.build_recipes:broken"\n'
    result = build_cell(load_matrix(matrix_in(tmp_path, lock, body)), 0)
    assert result.exit_code == EXIT_DETERMINISTIC
    assert result.outcome == "failed" and result.code == "build.recipe_failed" and not result.transient
    assert result.message is not None and "broken on purpose" in result.message


def test_a_missing_recipe_module_is_a_deterministic_failure(tmp_path: Path, lock: tuple[Path, dict[str, str]]) -> None:
    body = 'toolchain = "lock.json"\ntargets = ["cpu"]\n[[recipes]]\ncallable = "tests.no_such_module:f"\n'
    result = build_cell(load_matrix(matrix_in(tmp_path, lock, body)), 0)
    assert result.exit_code == EXIT_DETERMINISTIC and result.code == "build.recipe_invalid"
    assert CELL_ENV not in os.environ  # restored after the step


def test_an_unreachable_remote_is_a_transient_failure(tmp_path: Path, lock: tuple[Path, dict[str, str]]) -> None:
    closed = free_port()  # nothing listens there
    body = MATRIX.replace('targets = ["cpu"]', 'targets = ["cpu"]\nremote = "s3://nobody/fleet"', 1)
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
        "AWS_ENDPOINT": f"http://127.0.0.1:{closed}",
        "TORCH_COMPILED_GRAPHS_REMOTE_TIMEOUT_S": "1",
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }
    out = run_cli("build-cell", str(matrix_in(tmp_path, lock, body)), "--index", "0", env=env)
    assert out.returncode == EXIT_TRANSIENT, out.stderr
    row = one_json_line(out.stdout)
    assert row["outcome"] == "failed" and row["code"] == "build.remote_unavailable" and row["transient"]
    assert row["key"] is not None


@pytest.mark.parametrize(
    ("args", "env", "code"),
    [
        ((), {}, "build.index_missing"),
        ((), {"JOB_COMPLETION_INDEX": "9"}, "build.index_out_of_range"),
        (("--cells", "0,1"), {"JOB_COMPLETION_INDEX": "2"}, "build.index_out_of_range"),
        (("--index", "-1"), {}, "build.index_out_of_range"),
    ],
)
def test_build_cell_without_a_usable_index_is_a_usage_error(
    tmp_path: Path, lock: tuple[Path, dict[str, str]], args: tuple[str, ...], env: dict[str, str], code: str
) -> None:
    path = matrix_in(tmp_path, lock)
    out = run_cli("build-cell", str(path), *args, env={"JOB_COMPLETION_INDEX": "", **env})
    assert out.returncode == 2, out
    assert f"code: {code}" in out.stderr and out.stdout == ""


# ----------------------------------------------------------------------------- routing, imports


def test_the_build_package_imports_neither_torch_nor_ray_nor_kubernetes() -> None:
    code = (
        "import sys, torch_compiled_graphs, torch_compiled_graphs.build, torch_compiled_graphs.build.cli;"
        "import torch_compiled_graphs.build.k8s, torch_compiled_graphs.build.ray_executor;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray', 'kubernetes'));"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_console_script_routes_build_to_python_and_the_rest_to_the_native_cli() -> None:
    help_out = run_cli("build", "--help")
    assert help_out.returncode == 0 and "--executor {local,ray,k8s}" in help_out.stdout
    assert "A second run builds nothing" in help_out.stdout
    cell_help = run_cli("build-cell", "--help")
    assert cell_help.returncode == 0 and "75 transient" in " ".join(cell_help.stdout.split())
    native = run_cli("check-key", "not-a-key")
    assert native.returncode == 1
    script = subprocess.run(
        [str(Path(sys.executable).parent / "torch-compiled-graphs"), "build", "--help"], capture_output=True, text=True
    )
    assert script.returncode == 0 and "--executor" in script.stdout


def test_the_native_binary_refuses_build_and_names_the_console_script() -> None:
    from torch_compiled_graphs import _native

    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from torch_compiled_graphs import _native;"
            "sys.exit(_native.cli_main(['torch-compiled-graphs', 'build', 'm.toml']))",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "error: `build` runs in Python" in proc.stderr
    assert "python -m torch_compiled_graphs build" in proc.stderr
    assert _native is not None


# ----------------------------------------------------------------------------- plan and k8s


@pytest.fixture(scope="module")
def rendered(
    tmp_path_factory: pytest.TempPathFactory, lock: tuple[Path, dict[str, str]]
) -> tuple[Path, dict[str, Any]]:
    """``build --executor k8s --dry-run`` of a matrix without a remote and an empty store."""
    where = tmp_path_factory.mktemp("k8s")
    body = MATRIX + f'store = "{where / "store"}"\n[k8s]\nimage = "registry.example/fleet:1"\nnamespace = "builds"\n'
    body = body.replace(f'store = "{where / "store"}"\n', "")
    body = f'store = "{where / "store"}"\n' + body
    path = matrix_in(where, lock, body)
    out = run_cli("build", str(path), "--executor", "k8s", "--dry-run")
    assert out.returncode == 0, out.stderr
    manifest: dict[str, Any] = json.loads(out.stdout)
    return path, manifest


def test_dry_run_plans_every_cell_without_building(tmp_path: Path, lock: tuple[Path, dict[str, str]]) -> None:
    body = f'store = "{tmp_path / "store"}"\n' + MATRIX
    out = run_cli("build", str(matrix_in(tmp_path, lock, body)), "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["plan"]
    assert [r["state"] for r in rows] == ["needs-mint"] * 4
    assert [r["machine"] for r in rows] == ["cpu", "cpu", "gpu sm_90", "cpu"]
    assert all(r["key"].startswith("cg-key-v1-") for r in rows) and len({r["key"] for r in rows}) == 4
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("refs/*"))


def _model(item: dict[str, Any], kind: str) -> Any:
    """``item`` validated into the official client's model ``kind`` (required fields, types)."""
    import kubernetes.client as k8s

    return getattr(k8s, kind).from_dict(item)


def _clean(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def test_the_k8s_manifest_deserialises_into_the_official_models_and_round_trips(
    rendered: tuple[Path, dict[str, Any]],
) -> None:
    from kubernetes.client import V1ConfigMap, V1Job

    _, manifest = rendered
    assert manifest["apiVersion"] == "v1" and manifest["kind"] == "List"
    kinds = [i["kind"] for i in manifest["items"]]
    assert kinds == ["ConfigMap", "Job", "Job"]
    config = _model(manifest["items"][0], "V1ConfigMap")
    assert isinstance(config, V1ConfigMap) and set(config.data) == {"matrix.toml", "fleet-toolchain.json"}
    for item in manifest["items"][1:]:
        job = _model(item, "V1Job")
        assert isinstance(job, V1Job)
        # render -> deserialize -> serialize gives back what was rendered: no member the
        # schema does not know (it would be dropped), none of a wrong type.
        assert _clean(job.to_dict(serialize=True)) == item
        spec = job.spec
        assert spec.completion_mode in ("NonIndexed", "Indexed") and spec.completion_mode == "Indexed"
        assert spec.template.spec.restart_policy == "Never"  # required by a podFailurePolicy
        assert spec.backoff_limit_per_index >= 0
        for rule in spec.pod_failure_policy.rules:
            assert rule.action in ("FailJob", "FailIndex", "Ignore", "Count")
            if rule.on_exit_codes is not None:
                assert rule.on_exit_codes.operator in ("In", "NotIn")
                assert rule.on_exit_codes.container_name == spec.template.spec.containers[0].name
        (container,) = spec.template.spec.containers
        assert container.name and container.image == "registry.example/fleet:1"
        assert "--index" not in container.command


def test_k8s_jobs_are_one_per_target_with_the_cells_that_need_work(rendered: tuple[Path, dict[str, Any]]) -> None:
    path, manifest = rendered
    matrix = load_matrix(path)
    cpu, gpu = manifest["items"][1], manifest["items"][2]
    assert cpu["spec"]["completions"] == 3 and gpu["spec"]["completions"] == 1
    cpu_cmd = cpu["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cpu_cmd[cpu_cmd.index("--cells") + 1] == "0,1,3"
    gpu_cmd = gpu["spec"]["template"]["spec"]["containers"][0]["command"]
    assert gpu_cmd[gpu_cmd.index("--cells") + 1] == "2"
    rules = cpu["spec"]["podFailurePolicy"]["rules"]
    assert rules[0] == {
        "action": "FailIndex",
        "onExitCodes": {"containerName": "build-cell", "operator": "In", "values": [2, EXIT_DETERMINISTIC]},
    }
    assert rules[1]["action"] == "Ignore" and rules[1]["onPodConditions"][0]["type"] == "DisruptionTarget"
    cpu_env = {e["name"]: e["value"] for e in cpu["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert cpu_env["NVIDIA_VISIBLE_DEVICES"] == "none" and cpu_env["CUDA_VISIBLE_DEVICES"] == ""
    assert "nodeSelector" not in cpu["spec"]["template"]["spec"]
    gpu_pod = gpu["spec"]["template"]["spec"]
    assert gpu_pod["nodeSelector"] == {"nvidia.com/gpu.compute.major": "9", "nvidia.com/gpu.compute.minor": "0"}
    assert gpu_pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert "NVIDIA_VISIBLE_DEVICES" not in {e["name"] for e in gpu_pod["containers"][0]["env"]}
    assert manifest["items"][0]["data"]["matrix.toml"] == matrix.text
    assert cpu["metadata"]["namespace"] == "builds"


def job_argv(job: dict[str, Any], mount: Path) -> tuple[list[str], dict[str, str]]:
    """The Job's container command and env as a pod would run them, with the ConfigMap at ``mount``."""
    container = job["spec"]["template"]["spec"]["containers"][0]
    argv = [
        sys.executable if i == 0 else a.replace("/etc/tcg-build", str(mount))
        for i, a in enumerate(container["command"])
    ]
    return argv, {e["name"]: e["value"] for e in container["env"]}


def test_the_gpu_job_index_runs_the_cell_step_and_fails_its_index(
    rendered: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    _, manifest = rendered
    for name, text in manifest["items"][0]["data"].items():
        (tmp_path / name).write_text(text)
    argv, env = job_argv(manifest["items"][2], tmp_path)
    proc = subprocess.run(
        argv, capture_output=True, text=True, cwd=ROOT, env={**_base_env(), **env, "JOB_COMPLETION_INDEX": "0"}
    )
    row = one_json_line(proc.stdout)
    assert row["index"] == 2 and row["code"] == "build.device_mismatch"
    # The exit code the podFailurePolicy fails the index on.
    assert proc.returncode in manifest["items"][2]["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"]


def _base_env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_ray_tasks_ask_for_the_targets_resource_and_unplaceable_cells_are_detected(tmp_path: Path) -> None:
    from torch_compiled_graphs.build.ray_executor import _demand, task_options, unplaceable

    m = parse_matrix(MATRIX + '[ray]\nnum_cpus = 2\naccelerator_types = { sm_90 = "H100" }\n', tmp_path / "m.toml")
    cpu, gpu = task_options(m, m.cells[0]), task_options(m, m.cells[2])
    assert cpu["resources"] == {"tcg-target-cpu": 1} and cpu["num_gpus"] == 0 and cpu["num_cpus"] == 2
    assert gpu["resources"] == {"tcg-target-sm_90": 1} and gpu["num_gpus"] == 1
    assert gpu["accelerator_type"] == "H100" and "accelerator_type" not in cpu
    assert cpu["max_retries"] == 0  # the driver retries transient outcomes only
    nodes = [{"CPU": 4.0, "tcg-target-cpu": 4.0}, {"CPU": 8.0, "GPU": 1.0, "tcg-target-sm_90": 1.0}]
    assert not unplaceable(_demand(cpu), nodes)
    assert unplaceable(_demand(gpu), nodes)  # no node has accelerator_type:H100
    assert not unplaceable(_demand(gpu), [{**nodes[1], "accelerator_type:H100": 1.0}])
    assert unplaceable(_demand(cpu), nodes[1:])


# ----------------------------------------------------------------------------- size cap, executor values


def _huge(targets: int = 4) -> str:
    # Under 400 bytes of TOML, 4 * 10**10 cells: ten axes of ten values, four targets.
    axes = "\n".join(f"{chr(97 + i)}=[0,1,2,3,4,5,6,7,8,9]" for i in range(10))
    listed = ", ".join(["'cpu'", "'sm_80'", "'sm_90'", "'sm_100'"][:targets])
    return f"toolchain = 'lock.json'\ntargets = [{listed}]\n[[recipes]]\ncallable = 'a:b'\n[recipes.grid]\n{axes}\n"


def test_a_matrix_of_more_cells_than_the_cap_is_refused_before_any_is_made(tmp_path: Path) -> None:
    # Regression: the cells were expanded before anything counted them, so a 374-byte
    # matrix made `build` and `build-cell` hang and grow.
    body = _huge()
    assert len(body.encode()) < 400
    with pytest.raises(BuildError) as e:
        parse_matrix(body, tmp_path / "m.toml")
    assert e.value.code == "build.matrix_too_large"
    assert "describes 40000000000 cells, more than the cap of 10000" in str(e.value), str(e.value)
    # Both commands refuse it as a usage error, at once.
    path = write_matrix(tmp_path / "m.toml", body)
    for args in (("build-cell", str(path), "--index", "0"), ("build", str(path), "--dry-run")):
        out = run_cli(*args, timeout=120)
        assert out.returncode == 2 and "code: build.matrix_too_large" in out.stderr, out


def test_max_cells_raises_or_lowers_the_cap(tmp_path: Path) -> None:
    assert len(parse_matrix("max_cells = 4\n" + MATRIX, tmp_path / "m.toml").cells) == 4
    with pytest.raises(BuildError) as e:
        parse_matrix("max_cells = 3\n" + MATRIX, tmp_path / "m.toml")
    assert e.value.code == "build.matrix_too_large" and "describes 4 cells, more than the cap of 3" in str(e.value)
    for bad in ("0", "-1", "true", "'10'", "1.5"):
        with pytest.raises(BuildError) as e:
            parse_matrix(f"max_cells = {bad}\n" + MATRIX, tmp_path / "m.toml")
        assert e.value.code == "build.matrix_invalid" and "max_cells must be an integer >= 1" in str(e.value)


# One TOML value of each kind; a field refuses every kind it is not.
_KINDS = {
    "string": '"x"',
    "integer": "3",
    "float": "2.5",
    "boolean": "true",
    "array": '["a"]',
    "table": '{ a = "b" }',
}
_ACCEPTS = {
    ("local", "parallelism"): {"integer"},
    ("local", "retries"): {"integer"},
    ("ray", "address"): {"string"},
    ("ray", "num_cpus"): {"integer", "float"},
    ("ray", "retries"): {"integer"},
    ("ray", "accelerator_types"): {"table"},
    ("k8s", "image"): {"string"},
    ("k8s", "namespace"): {"string"},
    ("k8s", "name"): {"string"},
    ("k8s", "parallelism"): {"integer"},
    ("k8s", "backoff_limit_per_index"): {"integer"},
    ("k8s", "service_account"): {"string"},
    ("k8s", "env"): {"table"},
    ("k8s", "env_from_secrets"): {"array"},
    ("k8s", "cpu"): {"string"},
    ("k8s", "memory"): {"string"},
    ("k8s", "node_selectors"): set(),  # a table of tables: every kind here is wrong
    ("k8s", "python"): {"string"},
}


@pytest.mark.parametrize(
    ("section", "member", "kind"),
    [(s, m, k) for (s, m), ok in _ACCEPTS.items() for k in _KINDS if k not in ok],
)
def test_an_executor_value_of_the_wrong_type_is_refused_naming_the_field(
    tmp_path: Path, section: str, member: str, kind: str
) -> None:
    body = MATRIX + f"[{section}]\n{member} = {_KINDS[kind]}\n"
    with pytest.raises(BuildError) as e:
        parse_matrix(body, tmp_path / "m.toml")
    assert e.value.code == "build.matrix_invalid", e.value
    assert f"[{section}] {member} must be" in str(e.value), str(e.value)


def test_every_executor_member_is_covered_by_the_type_test() -> None:
    from torch_compiled_graphs.build.matrix import _SECTIONS

    assert {(s, m) for s, members in _SECTIONS.items() for m in members} == set(_ACCEPTS)


@pytest.mark.parametrize(
    ("section", "member", "value"),
    [
        ("local", "parallelism", "0"),
        ("local", "retries", "-1"),
        ("ray", "num_cpus", "0"),
        ("ray", "accelerator_types", "{ sm_90 = 1 }"),
        ("k8s", "namespace", '"Builds"'),
        ("k8s", "image", '""'),
        ("k8s", "env", "{ WAIT_S = 1800 }"),
        ("k8s", "env_from_secrets", "[1]"),
        ("k8s", "node_selectors", '{ cpu = "amd64" }'),
        ("k8s", "node_selectors", "{ cpu = { arch = 1 } }"),
    ],
)
def test_an_executor_value_of_the_right_type_but_out_of_range_is_refused(
    tmp_path: Path, section: str, member: str, value: str
) -> None:
    with pytest.raises(BuildError) as e:
        parse_matrix(MATRIX + f"[{section}]\n{member} = {value}\n", tmp_path / "m.toml")
    assert e.value.code == "build.matrix_invalid" and f"[{section}] {member} must be" in str(e.value)


def test_job_names_stay_unique_per_target_whatever_the_name_prefix(tmp_path: Path) -> None:
    # Regression: the name was cut at 63 characters after the target was appended, so a
    # long [k8s] name made every target's Job the same name.
    from torch_compiled_graphs.build.k8s import render

    (tmp_path / "lock.json").write_text("{}")
    targets = '["cpu", "cpu-x86_64-v3", "cpu-x86.64-v3", "cpu-x86-64-v3", "sm_90", "sm_90a", "sm_100"]'
    for prefix in ("tcg-build", "x" * 40, "fleet-" * 20, "Build_Of_The_Fleet!" * 3, "___"):
        body = MATRIX.replace('targets = ["cpu"]', f"targets = {targets}", 1)
        body += f'[k8s]\nimage = "registry.example/fleet:1"\nname = "{prefix}"\n'
        matrix = parse_matrix(body, tmp_path / "m.toml")
        jobs = [i for i in render(matrix, list(matrix.cells))["items"] if i["kind"] == "Job"]
        names = [j["metadata"]["name"] for j in jobs]
        assert len(jobs) == 7 and len(set(names)) == 7, (prefix, names)
        labels = [j["metadata"]["labels"]["torch-compiled-graphs/target"] for j in jobs]
        assert len(set(labels)) == 7, labels
        for text in [*names, *labels]:
            assert len(text) <= 63 and re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", text), text
    short = parse_matrix(MATRIX + '[k8s]\nimage = "i"\n', tmp_path / "m.toml")
    (job,) = [i for i in render(short, list(short.cells[:1]))["items"] if i["kind"] == "Job"]
    assert job["metadata"]["name"] == f"tcg-build-{short.digest[:8]}-cpu"  # short names are kept readable


def test_two_targets_rendering_one_job_name_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_compiled_graphs.build import k8s

    (tmp_path / "lock.json").write_text("{}")
    matrix = parse_matrix(MATRIX + '[k8s]\nimage = "i"\n', tmp_path / "m.toml")
    monkeypatch.setattr(k8s, "resource_name", lambda prefix, digest, part: "same")
    with pytest.raises(BuildError) as e:
        k8s.render(matrix, list(matrix.cells))
    assert e.value.code == "build.executor_invalid" and "would share the name 'same'" in str(e.value)


def test_the_docs_example_cell_is_the_cell_the_docs_matrix_produces(tmp_path: Path) -> None:
    # Regression: docs/build.md's example cell line named a cell with another parameter
    # order and another index than its own matrix produces.
    text = (ROOT / "docs" / "build.md").read_text()
    toml = re.search(r"```toml\n(.*?)```", text, re.S)
    assert toml is not None
    matrix = parse_matrix(toml.group(1), tmp_path / "matrix.toml")
    line = re.search(r"It prints one JSON line on stdout:\n\n```json\n(.*?)```", text, re.S)
    assert line is not None
    example = json.loads(line.group(1).replace("…", ""))
    cell = matrix.cells[example["index"]]
    assert (cell.name, cell.target) == (example["cell"], example["target"])
    named = re.search(r"the example's cell (\d+) is\s+`([^`]+)`", text)
    assert named is not None and matrix.cells[int(named.group(1))].name == named.group(2)
