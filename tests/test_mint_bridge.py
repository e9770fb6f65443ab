"""The miss path's checks around the compile, with the compile replaced so
that no AOTInductor run is needed: a recipe deriving another key and a
program that changes during the compile are refused, and nothing is stored."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_compiled_graphs import AdmissionError, DeclarationError, Engine, GraphClassSpec, record_toolchain

from .conftest import TESTDATA


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()


def spec(graph_class: str = "bridge/small") -> GraphClassSpec:
    program = torch.export.export(Small().eval(), (torch.randn(2, 4),))
    return GraphClassSpec(graph_class, "bridge", program)


@pytest.fixture()
def toolchain() -> dict[str, str]:
    return record_toolchain()


@pytest.fixture()
def no_compile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[int]:
    """Replace the compile with a stand-in that returns a real package file."""
    import tarfile

    import torch_compiled_graphs.compile as policy

    with tarfile.open(TESTDATA / "reference-0.2.0" / "mlp-cpu.tar.gz") as tar:
        tar.extract("model.pt2", tmp_path, filter="data")
    calls: list[int] = []

    def fake_compile(*args: Any, **kwargs: Any) -> Path:
        calls.append(1)
        return tmp_path / "model.pt2"

    monkeypatch.setattr(policy, "compile_package", fake_compile)
    return calls


def key_of(s: GraphClassSpec, toolchain: dict[str, str]) -> str:
    from torch_compiled_graphs import RuntimeCompatibility

    return str(RuntimeCompatibility("cpu", toolchain=toolchain).key(s.declare()))


def test_a_recipe_deriving_another_key_is_refused_before_compiling(
    tmp_path: Path, toolchain: dict[str, str], no_compile: list[int]
) -> None:
    engine = Engine(tmp_path / "store")
    wanted = key_of(spec(), toolchain)
    other = dataclasses.replace(spec(), target="another-target")
    with pytest.raises(AdmissionError) as e:
        engine.ensure(wanted, tmp_path / "out", target="cpu", toolchain=toolchain, recipe=lambda: other)
    assert e.value.code == "admission.recipe_key_mismatch"
    assert no_compile == []
    assert engine.list() == [] and not (tmp_path / "out").exists()


def test_a_program_that_changes_during_the_compile_is_refused(
    tmp_path: Path, toolchain: dict[str, str], no_compile: list[int]
) -> None:
    first = spec()
    # After the compile, the recipe's program is another one (another input shape).
    changed = torch.export.export(Small().eval(), (torch.randn(3, 4),))

    class Mutating(GraphClassSpec):
        calls = 0

        def declare(self):  # type: ignore[no-untyped-def]
            Mutating.calls += 1
            program = self.program if Mutating.calls == 1 else changed
            return GraphClassSpec(self.graph_class, self.target, program).declare()

    mutating = Mutating(first.graph_class, first.target, first.program)
    engine = Engine(tmp_path / "store")
    with pytest.raises(AdmissionError) as e:
        engine.ensure(
            key_of(first, toolchain), tmp_path / "out", target="cpu", toolchain=toolchain, recipe=lambda: mutating
        )
    assert e.value.code == "admission.program_mutated"
    assert no_compile == [1]
    assert engine.list() == [] and not (tmp_path / "out").exists()


def test_a_recipe_that_returns_no_spec_is_refused(tmp_path: Path, toolchain: dict[str, str]) -> None:
    engine = Engine(tmp_path / "store")
    key = "cg-key-v1-" + "1" * 56
    with pytest.raises(DeclarationError) as e:
        engine.ensure(key, tmp_path / "out", target="cpu", toolchain=toolchain, recipe=lambda: "not a spec")
    assert e.value.code == "declaration.program_invalid"
