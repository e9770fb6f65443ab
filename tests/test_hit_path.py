"""What the torch-free hit path loads and starts, in a fresh process (issue 34).

The hit path (import, ``Engine(root)``, ``resolve`` of a stored key) is timed by
``scripts/bench.py resolve`` against ``python -c pass`` (docs/benchmarks.md,
"Resolve"); these tests guard the structure that figure relies on, without
timing anything: which modules the hit path imports and that neither the
extension's initialisation, nor opening an engine, nor a local hit starts a
thread, even with a fleet remote configured.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torch_compiled_graphs import Engine, StoreOutcome

from .conftest import REFERENCE, REFERENCE_KEY

# Everything the hit path may add to a bare interpreter's modules: the package,
# its engine and the extension. Not `__future__`, `typing`, `enum`, `pathlib`,
# `logging`, `json`, numpy or torch: each costs more than is left of the budget.
HIT_PATH_MODULES = ["torch_compiled_graphs", "torch_compiled_graphs._native", "torch_compiled_graphs.engine"]


@pytest.fixture()
def store(tmp_path: Path) -> Path:
    engine = Engine(tmp_path / "store")
    assert engine.import_artifact(REFERENCE_KEY, REFERENCE / "mlp-cpu.tar.gz").outcome is StoreOutcome.STORED
    return tmp_path / "store"


def run_child(code: str, *args: str) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter (``before`` is its module set at start) and parse its JSON line."""
    prelude = "import sys, os, json\nbefore = set(sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code), *args], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_a_hit_in_a_fresh_process_imports_only_the_engine_and_the_extension(store: Path, tmp_path: Path) -> None:
    got = run_child(
        """
        import torch_compiled_graphs
        found = torch_compiled_graphs.Engine(sys.argv[1]).resolve(sys.argv[2], sys.argv[3])
        print(json.dumps({"graph_class": found.graph_class, "added": sorted(set(sys.modules) - before)}))
        """,
        str(store),
        REFERENCE_KEY,
        str(tmp_path / "out"),
    )
    assert got == {"graph_class": "model/mlp", "added": HIT_PATH_MODULES}
    assert (tmp_path / "out" / "model.pt2").stat().st_size > 0


def test_import_engine_and_a_local_hit_start_no_thread_even_with_a_remote(store: Path, tmp_path: Path) -> None:
    # A thread pool or the remote's runtime started by the extension's
    # initialisation, by Engine() or by a local hit would show here: the remote
    # is consulted only on a local miss (docs/fleet.md).
    got = run_child(
        """
        def threads():
            return len(os.listdir("/proc/self/task"))
        counts = {"start": threads()}
        import torch_compiled_graphs
        counts["import"] = threads()
        engine = torch_compiled_graphs.Engine(sys.argv[1], remote="s3://tcg-no-such-bucket/prefix")
        counts["engine"] = threads()
        graph = engine.resolve(sys.argv[2], sys.argv[3])
        counts["hit"] = threads()
        print(json.dumps({"counts": counts, "source": graph.source, "remote": engine.remote}))
        """,
        str(store),
        REFERENCE_KEY,
        str(tmp_path / "out"),
    )
    assert got == {
        "counts": {"start": 1, "import": 1, "engine": 1, "hit": 1},
        "source": "local",
        "remote": "s3://tcg-no-such-bucket/prefix",
    }
