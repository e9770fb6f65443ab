"""The demo's steps at a smaller size: a real mint, then reuse from fresh processes.

This is the end-to-end proof of the product: the first run compiles with
AOTInductor and stores the artifact; a fresh process resolves it without
importing torch, loads it with the weights bound and matches eager on a batch
size other than the export's; a second run reuses without compiling.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from torch_compiled_graphs import Engine

from .conftest import run_demo


@pytest.mark.real_aoti
def test_mint_once_then_reuse_from_fresh_processes_without_compiling(
    demo_minted: tuple[Path, dict[str, Any]],
) -> None:
    workdir, first = demo_minted
    assert first["ok"] is True
    mint, reuse = first["mint"], first["reuse"]
    assert mint["outcome"] == "MINTED"
    assert reuse["resolve_without_torch"] is True
    assert float(reuse["max_abs_error"]) < 1e-4

    second = run_demo(workdir)
    assert second["ok"] is True
    assert second["mint"]["outcome"] == "REUSED"
    assert second["mint"]["key"] == mint["key"]

    engine = Engine(workdir / "store")
    assert engine.stats()["mints"] == 1
    rows = engine.list()
    assert [r["key"] for r in rows] == [mint["key"]]
    assert rows[0]["sm"].startswith("cpu-")
