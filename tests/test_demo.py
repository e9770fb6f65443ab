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
    assert mint["outcome"] == "minted"
    assert reuse["resolve_without_torch"] is True
    assert float(reuse["max_abs_error"]) < 1e-4
    native = first["native"]
    assert native["without_torch"] is True
    assert float(native["max_abs_error"]) < 1e-4

    second = run_demo(workdir)
    assert second["ok"] is True
    assert second["mint"]["outcome"] == "reused"
    assert second["mint"]["key"] == mint["key"]

    engine = Engine(workdir / "store")
    assert engine.stats()["mints"] == 1
    rows = engine.list()
    assert [r["key"] for r in rows] == [mint["key"]]
    assert rows[0]["sm"].startswith("cpu-")


@pytest.mark.real_aoti
def test_a_corrupted_store_is_quarantined_and_the_next_ensure_repairs_it_by_a_mint(
    demo_minted: tuple[Path, dict[str, Any]],
) -> None:
    from torch_compiled_graphs import QuarantinedArtifact

    workdir, first = demo_minted
    key = first["mint"]["key"]
    engine = Engine(workdir / "store")
    flipped = 0
    for obj in (workdir / "store" / "objects").rglob("*"):
        if obj.is_file() and obj.stat().st_size > 4096:
            obj.chmod(0o644)
            data = bytearray(obj.read_bytes())
            data[len(data) // 2] ^= 0x10
            obj.write_bytes(bytes(data))
            flipped += 1
    assert flipped >= 2  # the envelope and the admitted package
    with pytest.raises(QuarantinedArtifact) as e:
        engine.resolve(key, workdir / "after-corruption")
    assert e.value.code == "quarantine.store_verification"
    assert not (workdir / "after-corruption").exists()

    repaired = run_demo(workdir)
    assert repaired["ok"] is True
    assert repaired["mint"]["outcome"] == "minted"
    assert repaired["mint"]["publication"] == "repaired"
    stats = engine.stats()
    assert stats["mints"] == 2 and stats["quarantines"] >= 1
    assert engine.resolve(key, workdir / "after-repair") is not None
