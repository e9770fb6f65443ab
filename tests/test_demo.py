"""The demo's steps at a smaller size: a real mint, then reuse from fresh processes.

This is the end-to-end proof of the product: the first run compiles with
AOTInductor and stores the artifact; a fresh process resolves it without
importing torch, loads it with the weights bound and matches eager on a batch
size other than the export's; a second run reuses without compiling.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from torch_compiled_graphs import Engine

from .conftest import ROOT

DEMO = ROOT / "scripts" / "demo.py"


def run_demo(workdir: Path) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, str(DEMO), "--dir", str(workdir), "--small", "--json"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.real_aoti
def test_mint_once_then_reuse_from_fresh_processes_without_compiling(tmp_path: Path) -> None:
    first = run_demo(tmp_path)
    assert first["ok"] is True
    mint = first["mint"]
    reuse = first["reuse"]
    assert isinstance(mint, dict) and isinstance(reuse, dict)
    assert mint["outcome"] == "MINTED"
    assert reuse["resolve_without_torch"] is True
    assert float(reuse["max_abs_error"]) < 1e-4

    second = run_demo(tmp_path)
    assert second["ok"] is True
    again = second["mint"]
    assert isinstance(again, dict)
    assert again["outcome"] == "REUSED"
    assert again["key"] == mint["key"]

    stats = Engine(tmp_path / "store").stats()
    assert stats["mints"] == 1
    assert stats["hits"] >= 3
    rows = Engine(tmp_path / "store").list()
    assert [r["key"] for r in rows] == [mint["key"]]
    assert rows[0]["sm"].startswith("cpu-")
