"""The libtorch-free variant's size hints: where its compile autotunes a dynamic dimension.

AOTInductor compiles one kernel per template for every size a dynamic dimension takes,
timed at the dimension's hint. The default variant keeps the export's example as the hint;
``shim-v1`` (``tuning: "range-ends/8x"``) first probes each dynamic dimension at the bottom
of its range (at least 2) and at its top, at most eight times the example's size, then
compiles it at that top, each for that pass only. No real compile here: the compiler and
the packager are stand-ins that record the hints the shape environment gives while each
pass runs (tests/test_tuning_probe.py compiles for real; the shim stage of
``scripts/cuda_e2e.py`` measures what the rule buys on a GPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from torch_compiled_graphs import RuntimeCompatibility, record_toolchain
from torch_compiled_graphs import compile as tcg_compile
from torch_compiled_graphs.compile import POLICY, SHIM_V1_POLICY, TUNING_RANGE_ENDS, TUNING_RANGE_TOP


class ThreeInputs(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return x.sum() + y.sum() + z.sum()


def _exported() -> Any:
    """x: batch 1..8, example 2; y: 1..100, example 4; z: unbounded, example 3."""
    dims = (
        {0: torch.export.Dim("batch", min=1, max=8)},
        {0: torch.export.Dim("n", min=1, max=100)},
        {0: torch.export.Dim("free")},
    )
    args = (torch.randn(2, 3), torch.randn(4, 3), torch.randn(3, 3))
    return torch.export.export(ThreeInputs(), args, dynamic_shapes=dims)


def _symbols(program: Any) -> dict[str, Any]:
    """Each input's first dimension's symbol, by placeholder name."""
    out = {}
    for node in program.graph_module.graph.nodes:
        if node.op == "placeholder":
            out[node.name] = node.meta["val"].shape[0].node.expr
    return out


def _hints_now(program: Any) -> dict[str, int]:
    _, env = tcg_compile._compile_context(program)
    hints = tcg_compile._backed_hints(env)
    return {name: int(hints[symbol]) for name, symbol in _symbols(program).items()}


def _compile(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, program: Any, variant: str, fail: bool = False
) -> list[dict[str, int]]:
    """compile_package with a compiler that records the hints it sees (and fails if asked)."""
    import torch._inductor

    seen: list[dict[str, int]] = []
    made = tmp_path / "wrapper.so"
    made.write_bytes(b"")

    def aot_compile(module: Any, args: Any, kwargs: Any, options: Any) -> list[str]:
        seen.append(_hints_now(program))
        if fail:
            raise RuntimeError("the compile failed")
        return [str(made)]

    monkeypatch.setattr(torch._inductor, "aot_compile", aot_compile)
    monkeypatch.setattr(tcg_compile, "_package", lambda files, name, workdir: workdir / "model.pt2")
    runtime = RuntimeCompatibility("cpu", toolchain=record_toolchain(variant))
    tcg_compile.compile_package(program, "three", runtime, tmp_path, variant=variant)
    return seen


def test_the_variant_probes_each_dimension_at_its_bottom_and_compiles_it_at_its_top(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    program = _exported()
    before = _hints_now(program)
    assert before == {"x": 2, "y": 4, "z": 3}
    seen = _compile(monkeypatch, tmp_path, program, "shim-v1")
    # The bottom's probe: every dimension at its bottom, never below 2 (batch's example
    # already is 2). The top's probe and the compile: batch at its top, 8; n at eight times
    # its example (32), not its top (100); free is unbounded and keeps its example.
    top = {"x": 8, "y": 32, "z": 3}
    assert seen == [{"x": 2, "y": 2, "z": 2}, top, top]
    # The program's own shape environment is as it was: only the compile saw the hints.
    assert _hints_now(program) == before


def test_the_default_variant_compiles_at_the_example(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    program = _exported()
    assert _compile(monkeypatch, tmp_path, program, "default") == [{"x": 2, "y": 4, "z": 3}]
    assert POLICY.tuning is None and "tuning" not in POLICY.settings_declaration()
    assert SHIM_V1_POLICY.settings_declaration()["tuning"] == TUNING_RANGE_ENDS == "range-ends/8x"


def test_a_failed_compile_leaves_the_hints_as_they_were(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    program = _exported()
    with pytest.raises(tcg_compile.CompileError) as err:
        _compile(monkeypatch, tmp_path, program, "shim-v1", fail=True)
    assert err.value.code == "compile.failed"
    assert _hints_now(program) == {"x": 2, "y": 4, "z": 3}


def test_tuning_hints_by_rule() -> None:
    program = _exported()
    _, env = tcg_compile._compile_context(program)
    symbols = _symbols(program)
    moved = tcg_compile.tuning_hints(program, env, TUNING_RANGE_TOP)
    assert moved == {symbols["x"]: 8, symbols["y"]: 32}
    assert tcg_compile.tuning_hints(program, env, TUNING_RANGE_ENDS) == moved
    assert tcg_compile.tuning_hints(program, env, None) == {}
    # Only range-ends probes; x's bottom (1) is floored at 2, its example.
    assert tcg_compile.probe_hints(program, env, TUNING_RANGE_ENDS) == {symbols["y"]: 2, symbols["z"]: 2}
    assert tcg_compile.probe_hints(program, env, TUNING_RANGE_TOP) is None
    assert tcg_compile.probe_hints(program, env, None) is None
    for rule_of in (tcg_compile.tuning_hints, tcg_compile.probe_hints):
        with pytest.raises(tcg_compile.CompileError) as err:
            rule_of(program, env, "range-middle")
        assert err.value.code == "compile.program_invalid"


class Double(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def _batch_program(example: int, top: int) -> Any:
    """Double exported at batch ``example`` with ``Dim("batch", 1, top)``."""
    dims = ({0: torch.export.Dim("batch", min=1, max=top)},)
    return torch.export.export(Double(), (torch.randn(example, 3),), dynamic_shapes=dims)


def test_a_dimension_at_the_top_of_its_range_and_a_static_one_keep_their_size() -> None:
    program = _batch_program(8, 8)
    _, env = tcg_compile._compile_context(program)
    assert tcg_compile.tuning_hints(program, env, TUNING_RANGE_TOP) == {}
    # Its bottom is not its top: the probe takes it at 2.
    (symbol,) = program.range_constraints
    assert tcg_compile.probe_hints(program, env, TUNING_RANGE_ENDS) == {symbol: 2}
    static = torch.export.export(Double(), (torch.randn(2, 3),))
    assert static.range_constraints == {}
    # A static program has no shape environment to move; the rules have nothing to do.
    assert tcg_compile.tuning_hints(static, None, TUNING_RANGE_TOP) == {}
    assert tcg_compile.probe_hints(static, None, TUNING_RANGE_ENDS) is None


def test_a_range_whose_ends_meet_the_example_has_no_probe() -> None:
    # Bottom floored at 2 and top at the example: one size to tune at, no probe.
    program = _batch_program(2, 2)
    _, env = tcg_compile._compile_context(program)
    assert tcg_compile.tuning_hints(program, env, TUNING_RANGE_ENDS) == {}
    assert tcg_compile.probe_hints(program, env, TUNING_RANGE_ENDS) is None


def test_a_shape_environment_without_hints_is_refused() -> None:
    """A shape environment that keeps no hints (a torch whose ShapeEnv moved them elsewhere)
    is refused, typed, before anything is compiled."""

    class NoHints:
        pass

    with pytest.raises(tcg_compile.CompileError) as err:
        tcg_compile.tuning_hints(_exported(), NoHints(), TUNING_RANGE_TOP)
    assert err.value.code == "compile.context"
