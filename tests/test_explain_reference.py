"""Explaining from a declaration alone against the 0.2.0 reference artifact (no compile).

An imported artifact has no kept canonical lines: a witness difference says so.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REFERENCE, REFERENCE_KEY
from torch_compiled_graphs import Engine, EnsureOutcome, EnsureResult, GraphClassDeclaration
from torch_compiled_graphs.errors import DeclarationError


def reference_metadata() -> dict[str, Any]:
    from torch_compiled_graphs import _native

    metadata: dict[str, Any] = _native.artifact_read_metadata(str(REFERENCE / "mlp-cpu.tar.gz"))
    return metadata


def declaration(**changes: Any) -> GraphClassDeclaration:
    g = dict(reference_metadata()["graph_class"])
    g.update(changes)
    return GraphClassDeclaration(
        g["name"],
        g["target"],
        g["graph"],
        g["graph_witness"],
        g["range_digest"],
        fork=[tuple(p) for p in g["fork"]],
        class_dims=[tuple(p) for p in g["class_dims"]],
        strict=g["strict"],
        lora_bucket=g["lora_bucket"],
        literal_values=g["literal_values"],
        placement=g["placement"],
    )


@pytest.fixture()
def engine(tmp_path: Path) -> Engine:
    e = Engine(tmp_path / "store")
    e.import_artifact(REFERENCE_KEY, REFERENCE / "mlp-cpu.tar.gz")
    return e


def test_a_declaration_is_explained_against_the_imported_artifact(engine: Engine) -> None:
    md = reference_metadata()
    sm, toolchain = md["sm"], md["toolchain"]
    same = engine.explain(declaration(), target=sm, toolchain=toolchain)
    assert same.present and same.key == REFERENCE_KEY and same.neighbours == ()

    e = engine.explain(declaration(), target=sm, toolchain={**toolchain, "triton": "3.5.0"})
    assert not e.present and e.remote is None
    assert e.nearest is not None and e.nearest.key == REFERENCE_KEY
    assert e.nearest.facts == ("toolchain.triton",)
    assert (e.nearest.differences[0].requested, e.nearest.differences[0].stored) == ("3.5.0", "none")
    assert "toolchain.triton: requested 3.5.0, stored none" in str(e)
    # Explanations are hashable values, like the rest of EnsureResult.
    result = EnsureResult(EnsureOutcome.MINTED, engine.resolve(REFERENCE_KEY, engine.root.parent / "out"), None, e)  # type: ignore[arg-type]
    assert hash(result) == hash(result) and result.explanation is e

    w = engine.explain(declaration(graph_witness="0" * 16), target=sm, toolchain=toolchain)
    assert w.nearest is not None and w.nearest.facts == ("graph_witness",)
    assert not w.nearest.lines_kept
    assert "unavailable" in w.nearest.differences[0].detail

    lora = engine.explain(declaration(lora_bucket=8), target=sm, toolchain=toolchain)
    assert lora.nearest is not None and lora.nearest.facts == ("lora_bucket",)

    other = engine.explain(declaration(name="model/other"), target=sm, toolchain={**toolchain, "triton": "x"})
    assert other.neighbours == ()


def test_explain_refuses_bad_targets_and_toolchains(engine: Engine) -> None:
    with pytest.raises(DeclarationError) as info:
        engine.explain(declaration(), target="gpu", toolchain={"torch": "x"})
    assert info.value.code == "declaration.target_unsupported"
    with pytest.raises(DeclarationError) as info:
        engine.explain(declaration(), target="cpu", toolchain={})
    assert info.value.code == "declaration.toolchain_invalid"
    with pytest.raises(DeclarationError) as info:
        engine.explain(object(), target="cpu", toolchain={"torch": "x"})  # type: ignore[arg-type]
    assert info.value.code == "declaration.program_invalid"


def test_the_cli_lists_the_class_of_the_imported_artifact(engine: Engine) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch_compiled_graphs.cli",
            "explain",
            "--cas-root",
            str(engine.root),
            "--graph-class",
            "model/mlp",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [e["key"] for e in report["entries"]] == [REFERENCE_KEY]
    assert report["entries"][0]["lines_kept"] is False
    assert report == engine.explain_class("model/mlp")
