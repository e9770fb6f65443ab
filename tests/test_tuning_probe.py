"""The probes of the tuning rule ``"range-ends/8x"`` (``_tuning``): each autotuning call of
the compile is offered the candidate whose worse slowdown over the range's two ends, as
the probes timed them there, is least.

Without compiling: the table and the narrowing on candidates shaped as inductor's are (a
name with a serial, a description, the input nodes and the output layout), the probe's
hooks on inductor's algorithm selector and scheduler (installed, and removed after), its
stop found through inductor's wrapping, and a shape environment the probe changed put
back. With one real CPU compile (``real_aoti``): a GEMM graph with a dynamic batch, compiled
under a policy that autotunes its GEMM between an aten extern and a C++ template, probes
the call at both ends, narrows it, and its package computes what eager does at both ends
of the range and between.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_compiled_graphs import RuntimeCompatibility, _tuning, record_toolchain
from torch_compiled_graphs import compile as tcg_compile


@dataclasses.dataclass(frozen=True)
class Layout:
    dtype: str
    size: tuple[str, ...]
    stride: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Node:
    layout: Layout

    def get_layout(self) -> Layout:
        return self.layout


@dataclasses.dataclass(eq=False)
class Choice:
    name: str
    description: str
    input_nodes: tuple[Node, ...]
    layout: Layout


A = Node(Layout("torch.bfloat16", ("128*s0", "64"), ("64", "1")))
B = Node(Layout("torch.bfloat16", ("64", "256"), ("1", "64")))
OUT = Layout("torch.bfloat16", ("128*s0", "256"), ("256", "1"))
OTHER_OUT = Layout("torch.bfloat16", ("128*s0", "64"), ("64", "1"))


def _call(serial: int, out: Layout = OUT) -> list[Choice]:
    """One autotuning call's candidates as inductor names them (the serial differs per call)."""
    return [
        Choice(f"triton_mm_{serial + i}", f"BLOCK_M={m}, BLOCK_N=64, num_warps=4", (A, B), out)
        for i, m in enumerate((16, 32, 64, 128))
    ]


def _timed(call: list[Choice], times: tuple[float, ...]) -> _tuning.ChoiceTable:
    table = _tuning.ChoiceTable()
    table.record(dict(zip(call, times, strict=True)))
    return table


def test_the_compile_is_offered_the_candidate_least_slow_at_its_worse_end() -> None:
    # BLOCK_M 16, 32, 64, 128. At the bottom small tiles win, at the top large ones:
    # slowdowns (bottom, top) 1.0/2.0, 1.05/1.3, 1.2/1.1, 2.0/1.0: 64 is least slow at
    # its worse end (1.2), where the fastest at either end is 2x slow at the other.
    bottom = _timed(_call(0), (1.0, 1.05, 1.2, 2.0))
    top = _timed(_call(4), (4.0, 2.6, 2.2, 2.0))
    tally = _tuning.Narrowing()
    # The compile's call: the same computation, other serials.
    kept = _tuning.narrow([bottom, top], _call(40), tally)
    assert [c.name for c in kept] == ["triton_mm_42"]
    assert (tally.narrowed, tally.whole, tally.kept, tally.offered) == (1, 0, 1, 4)
    assert tally.worst == pytest.approx(1.2)
    # Timed at one end only: the fastest there; equal slowdowns are all kept.
    assert [c.name for c in _tuning.narrow([top], _call(50))] == ["triton_mm_53"]
    assert len(_tuning.narrow([_timed(_call(0), (1.0, 1.0, 3.0, 3.0))], _call(60))) == 2


def test_a_call_the_probes_did_not_time_or_whose_ends_share_no_candidate_keeps_them_all() -> None:
    table = _timed(_call(0), (1.0, 1.0, 1.0, 1.0))
    tally = _tuning.Narrowing()
    # Another output layout: another call, untimed.
    other = _call(10, OTHER_OUT)
    assert _tuning.narrow([table], other, tally) == other
    # Candidates the probes never saw (another template): none chosen is offered.
    unseen = [dataclasses.replace(c, name=f"triton_persistent_mm_{i}") for i, c in enumerate(_call(20))]
    assert _tuning.narrow([table], unseen, tally) == unseen
    # The two ends timed disjoint candidates (inductor scales its tiles to the size).
    disjoint = _timed(unseen, (1.0, 1.0, 1.0, 1.0))
    assert _tuning.least_regret([table, disjoint], _tuning.call_key(unseen)) is None
    assert (tally.narrowed, tally.whole) == (0, 2)
    # A lone candidate is never counted (autotuning has nothing to choose).
    assert _tuning.narrow([table], other[:1], tally) == other[:1] and tally.offered == 8


def test_failed_candidates_are_not_recorded_and_the_fastest_time_of_a_configuration_is_kept() -> None:
    table = _tuning.ChoiceTable()
    first, second = _call(0), _call(4)
    table.record(dict(zip(first, (float("inf"), 1.0, 3.0, float("nan")), strict=True)))
    table.record(dict(zip(second, (2.0, 1.5, 1.05, 9.0), strict=True)))
    (row,) = table.timings.values()
    assert sorted(row.values()) == [1.0, 1.05, 2.0, 9.0]
    assert _tuning.least_regret([table], _tuning.call_key(first)) == ({_tuning.choice_config(first[1])}, 1.0)
    assert _tuning.least_regret([table], "no such call") is None
    table.record({})
    assert len(table.timings) == 1


def test_the_probe_hooks_inductor_and_removes_its_hooks_after(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor import select_algorithm
    from torch._inductor.graph import GraphLowering

    built: list[object] = []

    def build_scheduler(graph: object) -> None:  # stands in for inductor's
        built.append(graph)

    monkeypatch.setattr(GraphLowering, "_update_scheduler", build_scheduler)
    selector = select_algorithm.get_algorithm_selector_cache()
    savers, preprocessors = list(selector.feedback_saver_fns), list(selector.preprocessing_fns)
    with _tuning.probe() as table:
        # Timings reach the table through inductor's feedback hook.
        assert len(selector.feedback_saver_fns) == len(savers) + 1
        selector.feedback_saver_fns[-1](dict(zip(_call(0), (1.0, 2.0, 3.0, 4.0), strict=True)), "mm", [], [], None)
        assert len(table.timings) == 1
        # The scheduler is built, then the probe stops.
        graph = object()
        with pytest.raises(_tuning.ProbeDone):
            GraphLowering._update_scheduler(graph)  # type: ignore[arg-type]
        assert built == [graph]
        # Another thread's compile builds its scheduler and goes on.
        raised: list[BaseException] = []

        def elsewhere() -> None:
            try:
                GraphLowering._update_scheduler(graph)  # type: ignore[arg-type]
            except BaseException as exc:  # recorded for the assertion
                raised.append(exc)

        other = threading.Thread(target=elsewhere)
        other.start()
        other.join()
        assert built == [graph, graph] and raised == []
    assert GraphLowering._update_scheduler is build_scheduler
    assert selector.feedback_saver_fns == savers
    with _tuning.narrowed([table]) as tally:
        assert len(selector.preprocessing_fns) == len(preprocessors) + 1
        assert len(selector.preprocessing_fns[-1](_call(9))) == 1 and tally.narrowed == 1
    assert selector.preprocessing_fns == preprocessors


def test_the_probes_stop_is_found_through_inductors_wrapping() -> None:
    def wrapped() -> None:
        try:
            raise _tuning.ProbeDone("settled")
        except _tuning.ProbeDone as exc:
            raise RuntimeError("inductor wrapped it") from exc

    with pytest.raises(RuntimeError) as err:
        wrapped()
    assert _tuning.is_probe_done(err.value)

    class Wrapper(Exception):
        def __init__(self, inner: BaseException) -> None:
            super().__init__("wrapper")
            self.inner_exception = inner

    assert _tuning.is_probe_done(Wrapper(_tuning.ProbeDone("x")))
    assert not _tuning.is_probe_done(Wrapper(ValueError("a real failure")))
    loop = RuntimeError("a")
    loop.__context__ = loop  # a cycle ends
    assert not _tuning.is_probe_done(loop)


def test_a_shape_environment_the_probe_changed_is_put_back() -> None:
    import sympy
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.utils._sympy.value_ranges import ValueRanges

    env = ShapeEnv()
    s0 = sympy.Symbol("s0", integer=True, positive=True)
    env.var_to_range[s0] = ValueRanges(1, 8)
    version = env._version_counter
    with _tuning.kept_env(env):
        env.var_to_range[s0] = ValueRanges(1, 2)  # a guard at the bottom narrowed the range
        env.replacements[s0] = sympy.Integer(2)
    assert env.var_to_range[s0] == ValueRanges(1, 8) and s0 not in env.replacements
    assert env._version_counter > version
    # Unchanged: nothing is touched.
    version = env._version_counter
    with _tuning.kept_env(env):
        pass
    assert env._version_counter == version


# --------------------------------------------------------------------------- a real compile


class Gemm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.up(x))


@pytest.mark.real_aoti
def test_a_real_compile_probes_its_gemm_at_both_ends_narrows_it_and_serves_the_whole_range(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = Gemm().eval()
    program = torch.export.export(
        model, (torch.randn(2, 16, 64),), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=8)},)
    )
    # The default policy plus GEMM autotuning between aten and the C++ template on the CPU
    # (shim-v1's own CPU GEMM has no kernel for a weight fed by fqn), under the rule.
    # The C++ template reads a weight it packs at compile time: this test's package keeps
    # its constants in the .so (a policy of this project never does) to be run as is.
    options = dict(tcg_compile.POLICY.code_options)
    options.update({"aot_inductor.package_constants_in_so": True, "max_autotune": True})
    options["max_autotune_gemm_backends"] = "CPP,ATEN"
    policy = dataclasses.replace(
        tcg_compile.POLICY, code_options=tuple(options.items()), tuning=tcg_compile.TUNING_RANGE_ENDS
    )
    monkeypatch.setattr(tcg_compile, "POLICY", policy)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))
    seen: list[list[Any]] = []
    narrow = _tuning.narrow

    def spy(tables: list[_tuning.ChoiceTable], choices: list[Any], tally: Any = None) -> list[Any]:
        kept = narrow(tables, choices, tally)
        seen.append([[len(t.timings) for t in tables], len(choices), len(kept)])
        return kept

    monkeypatch.setattr(_tuning, "narrow", spy)
    caplog.set_level(logging.DEBUG, logger="torch_compiled_graphs")
    runtime = RuntimeCompatibility("cpu", toolchain=record_toolchain())
    package = tcg_compile.compile_package(program, "gemm", runtime, tmp_path / "work")
    # Each probe timed the GEMM (the bottom at the example, 2, as the bottom is floored at
    # 2; the top at 8), and the compile offered it one of its two candidates.
    assert seen == [[[1, 1], 2, 1]]
    assert caplog.text.count("probe timed 1 autotuning calls") == 2
    assert "compile narrowed 1 autotuning calls" in caplog.text
    from torch_compiled_graphs._loadpath import torch_package_loader

    loader = torch_package_loader(torch, str(package), "gemm", False, -1)
    for batch in (1, 3, 8):
        x = torch.randn(batch, 16, 64)
        (y,) = loader.boxed_run([x])
        torch.testing.assert_close(y, model(x), rtol=1e-4, atol=1e-4)
