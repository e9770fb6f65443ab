from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTDATA = ROOT / "testdata"
#: The 0.2.0 reference artifact (CPU MLP with folded constants), its weights and io.
REFERENCE = TESTDATA / "reference-0.2.0"
REFERENCE_KEY = "cg-key-v1-ddd506362c49696787e3eb3d0e44c08b00a6358015d9004ba1cd363a"


def resolve_reference(root: Path) -> Any:
    """Import the reference artifact into a new store under ``root`` and resolve it there."""
    from torch_compiled_graphs import Engine

    engine = Engine(root / "store")
    engine.import_artifact(REFERENCE_KEY, REFERENCE / "mlp-cpu.tar.gz")
    found = engine.resolve(REFERENCE_KEY, root / "graph")
    assert found is not None
    return found


REFERENCE_WEIGHTS = REFERENCE / "mlp-cpu.weights.safetensors"


# The reference artifact resolved into a store of its own, bound natively, and its
# recorded inputs/outputs: the fixtures of the native-path tests (test_native*.py).
# Module-scoped: each test module gets its own store; a module may define its own
# `graph` fixture, which then takes precedence.
@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return resolve_reference(tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def native(graph: Any) -> Any:
    return graph.load_native(REFERENCE_WEIGHTS)


@pytest.fixture(scope="module")
def io() -> dict[str, Any]:
    from safetensors.numpy import load_file

    return load_file(REFERENCE / "mlp-cpu.io.safetensors")


def refused_binding(code: str, call: Any, *args: Any, **kwargs: Any) -> Any:
    """Calls ``call`` and checks that it raises a BindingError with ``code``; returns the error."""
    from torch_compiled_graphs.errors import BindingError

    with pytest.raises(BindingError) as e:
        call(*args, **kwargs)
    assert e.value.code == code, str(e.value)
    return e.value


@pytest.fixture(scope="session")
def spec_vectors() -> dict[str, Any]:
    return json.loads((TESTDATA / "spec_vectors.json").read_text())


def run_demo(workdir: Path) -> dict[str, Any]:
    """Run scripts/demo.py at its small size in `workdir`; return its JSON report."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py"), "--dir", str(workdir), "--small", "--json"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="session")
def demo_minted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One real AOTInductor mint per test session (the demo's first run), shared by the
    end-to-end, engine and artifact tests that need a package this project compiled."""
    workdir = tmp_path_factory.mktemp("demo")
    return workdir, run_demo(workdir)
