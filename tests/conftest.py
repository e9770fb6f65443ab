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
