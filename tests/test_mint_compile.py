"""The sole compile policy (SPEC-v1 §11), weight swap (§13.3) and the x86-64 clamp in real code (§5.4).

Real compiles are few and shared through session fixtures: the weight-swap
package (also disassembled for the ISA check) and the literal package.
"""

from __future__ import annotations

import dataclasses
import platform
import re
import subprocess
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.export import export

from tests.models import Sine, SwapModel, WithLiteral, swap_weights
from torch_compiled_graphs import compile as policy
from torch_compiled_graphs._runner_min import MinimalGraph
from torch_compiled_graphs.compile import POLICY, compile_package, literal_tensors
from torch_compiled_graphs.declaration import GraphClassSpec, canonical_lines
from torch_compiled_graphs.errors import AdmissionError, CompileError
from torch_compiled_graphs.runtime import RuntimeCompatibility

TOOLCHAIN = {"torch": "record-digest", "triton": "compiler-digest"}
X86 = platform.machine().lower() in ("x86_64", "amd64")
SWAP_ENTRY = "tests/swap"
LITERAL_ENTRY = "tests/literal"
COMPILE_SECONDS: dict[str, float] = {}
LINES: dict[str, list[str]] = {}


def _runtime() -> RuntimeCompatibility:
    return RuntimeCompatibility("cpu", toolchain=TOOLCHAIN)


def _swap_program(seed: int = 0) -> Any:
    model = SwapModel().eval()
    model.load_state_dict(swap_weights(seed))
    return export(model, (torch.randn(4, 16),))


@pytest.fixture(scope="session")
def swap_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SwapModel with weights A, compiled once under the policy."""
    program = _swap_program(0)
    LINES["before"] = canonical_lines(program)
    started = time.monotonic()
    path = compile_package(program, SWAP_ENTRY, _runtime(), tmp_path_factory.mktemp("swap"))
    COMPILE_SECONDS["swap"] = time.monotonic() - started
    LINES["after"] = canonical_lines(program)
    return path


@pytest.fixture(scope="session")
def literal_package(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """WithLiteral (a plain tensor attribute export lifts as a constant), compiled once."""
    program = export(WithLiteral(), (torch.ones(3, 2),))
    started = time.monotonic()
    path = compile_package(program, LITERAL_ENTRY, _runtime(), tmp_path_factory.mktemp("literal"))
    COMPILE_SECONDS["literal"] = time.monotonic() - started
    return program, path


def _member(package: Path, entry: str, suffix: str) -> bytes:
    with zipfile.ZipFile(package) as archive:
        (name,) = [n for n in archive.namelist() if f"/data/aotinductor/{entry}/" in n and n.endswith(suffix)]
        return archive.read(name)


_FIELD = re.compile(r'constants_info_\[(\d+)\]\.(name|original_fqn) = "([^"]*)";')
_TYPE = re.compile(
    r"constants_info_\[(\d+)\]\.type = static_cast<int32_t>\(torch::aot_inductor::ConstantType::(\w+)\);"
)


def _wrapper_rows(package: Path, entry: str) -> list[dict[str, str]]:
    """Test-side reading of the wrapper constant table (fqn, name, type); the core verifies it for real."""
    text = _member(package, entry, ".wrapper.cpp").decode()
    rows: dict[int, dict[str, str]] = {}
    for index, field, value in _FIELD.findall(text):
        rows.setdefault(int(index), {})[field] = value
    for index, kind in _TYPE.findall(text):
        rows.setdefault(int(index), {})["type"] = kind
    return [
        {"fqn": r.get("original_fqn") or r["name"], "name": r["name"], "type": r["type"]}
        for _, r in sorted(rows.items())
    ]


# ----------------------------------------------------------------- the policy object


def test_policy_stamps_are_code_only_and_fenced() -> None:
    assert POLICY.package_constants_in_so is False
    assert POLICY.constant_folding_fenced is True
    options = POLICY.inductor_options()
    assert options["aot_inductor.package"] is True
    assert options["aot_inductor.package_constants_in_so"] is False
    assert options["always_keep_tensor_constants"] is True
    assert options["freezing"] is False
    assert options["joint_graph_constant_folding"] is False
    options["freezing"] = True
    assert POLICY.inductor_options()["freezing"] is False  # accessors hand out copies
    with pytest.raises(dataclasses.FrozenInstanceError):
        POLICY.code_options = ()  # type: ignore[misc]


def test_every_policy_option_is_a_real_inductor_option() -> None:
    import torch._inductor.config as config

    for name in POLICY.inductor_options():
        assert name in config._config, name


# ----------------------------------------------------------------- refusals without compiling


@pytest.mark.parametrize("value", [None, "program", torch.nn.Linear(2, 2)])
def test_compile_refuses_a_non_exported_program(value: object, tmp_path: Path) -> None:
    with pytest.raises(CompileError) as e:
        compile_package(value, "g", _runtime(), tmp_path)
    assert e.value.code == "compile.program_invalid"


def test_compile_accepts_a_graph_class_spec_but_not_a_bad_entry_name(tmp_path: Path) -> None:
    spec = GraphClassSpec("g", "cpu", export(Sine(), (torch.ones(2, 3),)))
    with pytest.raises(CompileError) as e:
        compile_package(spec, " g", _runtime(), tmp_path)
    assert e.value.code == "compile.package_failed"


def test_an_inductor_failure_is_wrapped_with_its_message(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import torch._inductor

    seen: dict[str, Any] = {}

    def failing(module: Any, args: Any, kwargs: Any, *, options: dict[str, Any]) -> Any:
        seen["options"], seen["args"] = options, args
        raise RuntimeError("C++ compile error: no such instruction")

    monkeypatch.setattr(torch._inductor, "aot_compile", failing)
    with pytest.raises(CompileError) as e:
        compile_package(export(Sine(), (torch.ones(2, 3),)), "g", _runtime(), tmp_path)
    assert e.value.code == "compile.failed"
    assert str(e.value) == "AOTInductor compile failed: RuntimeError: C++ compile error: no such instruction"
    # The compile saw the policy and fake inputs rebuilt from the graph, not stored example inputs.
    assert seen["options"]["aot_inductor.package_constants_in_so"] is False
    if X86:
        assert seen["options"]["cpp.march"] == RuntimeCompatibility("cpu", toolchain=TOOLCHAIN).host_isa["cpp_march"]
    (x,) = seen["args"]
    assert type(x).__name__ == "FakeTensor" and tuple(x.shape) == (2, 3)


def test_compile_does_not_need_stored_example_inputs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import torch._inductor

    program = export(Sine(), (torch.ones(2, 3),))
    program._example_inputs = None
    monkeypatch.setattr(torch._inductor, "aot_compile", lambda *a, **k: [])
    with pytest.raises(CompileError) as e:
        compile_package(program, "g", _runtime(), tmp_path)
    assert e.value.code == "compile.result_invalid"


def test_a_packaging_failure_is_package_failed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import torch._inductor
    import torch._inductor.package.package as package

    made = tmp_path / "made.so"
    made.write_bytes(b"\x7fELF")
    monkeypatch.setattr(torch._inductor, "aot_compile", lambda *a, **k: [str(made)])

    def failing(*a: Any, **k: Any) -> Any:
        raise OSError("disk full")

    monkeypatch.setattr(package, "package_aoti", failing)
    with pytest.raises(CompileError) as e:
        compile_package(export(Sine(), (torch.ones(2, 3),)), "g", _runtime(), tmp_path / "out")
    assert e.value.code == "compile.package_failed"
    assert "disk full" in str(e.value)


def test_two_fake_modes_in_one_graph_are_a_context_error(tmp_path: Path) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    program = export(Sine(), (torch.ones(2, 3),))
    node = next(n for n in program.graph_module.graph.nodes if n.op == "call_function")
    with FakeTensorMode(shape_env=ShapeEnv()) as other:
        node.meta["val"] = other.from_tensor(torch.ones(2, 3))
    with pytest.raises(CompileError) as e:
        compile_package(program, "g", _runtime(), tmp_path)
    assert e.value.code == "compile.context"
    assert "exactly one FakeTensorMode, found 2" in str(e.value)


def test_literal_tensors_by_fqn_are_detached_cpu_and_contiguous() -> None:
    program = export(WithLiteral(), (torch.ones(3, 2),))
    values = literal_tensors(program, [{"fqn": "table"}, ("other-name", "table")])
    assert set(values) == {"table", "other-name"}
    assert torch.equal(values["table"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert values["table"].is_contiguous() and not values["table"].requires_grad


# ----------------------------------------------------------------- real compiles


@pytest.mark.real_aoti
def test_package_is_code_only_with_one_entry(swap_package: Path) -> None:
    assert policy._package_entries(swap_package) == [SWAP_ENTRY]
    wrapper = _member(swap_package, SWAP_ENTRY, ".wrapper.cpp").decode()
    constructor = re.search(r"AOTInductorModelBase\((.*?)\)\s*\{", wrapper, re.S)
    assert constructor is not None
    assert constructor.group(1).split(",")[-1].strip() == "false"  # load_constants_from_blob
    rows = _wrapper_rows(swap_package, SWAP_ENTRY)
    assert {r["fqn"] for r in rows} == {"linear.weight", "linear.bias", "scale", "shift", "offset"}
    assert {r["type"] for r in rows} <= {"Parameter", "Buffer"}  # nothing inlined, nothing folded


@pytest.mark.real_aoti
def test_compiling_leaves_the_program_witness_unchanged(swap_package: Path) -> None:
    assert LINES["after"] == LINES["before"]


@pytest.mark.real_aoti
def test_weight_swap_binds_by_fqn_and_bakes_no_weight(swap_package: Path) -> None:
    """SPEC §13.3: weights B give eager B; rebinding A gives eager A (rank-0, short 1-D, buffer)."""
    graph = MinimalGraph(swap_package, SWAP_ENTRY)
    assert sorted(graph.constant_fqns) == ["linear.bias", "linear.weight", "offset", "scale", "shift"]
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(7))
    for seed in (1, 0, 2, 0):
        weights = swap_weights(seed)
        eager = SwapModel().eval()
        eager.load_state_dict(weights)
        graph.bind(weights)
        with torch.no_grad():
            want = eager(x)
            got = graph(x)
        got = got[0] if isinstance(got, (list, tuple)) else got
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Weights A and B really differ in every kind of constant the test relies on.
    a, b = swap_weights(0), swap_weights(1)
    assert all(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.real_aoti
def test_binding_is_a_full_update(swap_package: Path) -> None:
    graph = MinimalGraph(swap_package, SWAP_ENTRY)
    partial = {k: v for k, v in swap_weights(1).items() if k != "scale"}
    with pytest.raises(RuntimeError):
        graph.bind(partial)


_EVEX_MNEMONIC = re.compile(r"%zmm\d|%k[0-7]\b|\{%k[0-7]\}")
_LEGACY_PREFIXES = {"26", "2e", "36", "3e", "64", "65", "67"}


def _instructions(disassembly: str) -> list[tuple[list[str], str]]:
    """``(bytes, text)`` of each instruction line of ``objdump -d`` output."""
    out = []
    for line in disassembly.splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and parts[0].strip().endswith(":"):
            out.append((parts[1].split(), parts[2]))
    return out


def _is_evex(raw: list[str], text: str) -> bool:
    rest = list(raw)
    while rest and rest[0] in _LEGACY_PREFIXES:
        rest.pop(0)
    # 0x62 opens an EVEX prefix in 64-bit mode (BOUND is invalid there).
    return bool(rest and rest[0] == "62") or bool(_EVEX_MNEMONIC.search(text))


def test_the_evex_detector_recognises_evex_and_vex_encodings() -> None:
    sample = (
        "  10:\t62 f1 7c 48 58 c1       \tvaddps %zmm1,%zmm0,%zmm0\n"
        "  16:\t67 62 f1 7c 28 58 00    \tvaddps (%eax),%ymm0,%ymm0\n"
        "  1d:\tc5 fc 58 c1             \tvaddps %ymm1,%ymm0,%ymm0\n"
        "  21:\tc5 f8 77                \tvzeroupper\n"
    )
    flags = [_is_evex(raw, text) for raw, text in _instructions(sample)]
    assert flags == [True, True, False, False]


@pytest.mark.real_aoti
@pytest.mark.skipif(not X86, reason="x86-64 host code")
def test_clamped_cpu_code_has_vex_but_no_evex(swap_package: Path, tmp_path: Path) -> None:
    so = tmp_path / "wrapper.so"
    so.write_bytes(_member(swap_package, SWAP_ENTRY, ".wrapper.so"))
    kernel = _member(swap_package, SWAP_ENTRY, ".kernel.cpp").decode()
    assert "-march=x86-64-v3" in kernel and "Vectorized<float>" in kernel
    disassembly = subprocess.run(
        ["objdump", "-d", "-w", str(so)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    instructions = _instructions(disassembly)
    assert len(instructions) > 1000
    evex = [text for raw, text in instructions if _is_evex(raw, text)]
    assert evex == [], evex[:5]
    assert any("%ymm" in text for _, text in instructions)  # the vector kernel really is VEX (AVX2)


@pytest.mark.real_aoti
def test_a_literal_whose_fqn_the_compiler_erased_is_unbound(literal_package: tuple[Any, Path]) -> None:
    program, package = literal_package
    rows = [r for r in _wrapper_rows(package, LITERAL_ENTRY) if r["type"] not in ("Parameter", "Buffer")]
    assert [r["type"] for r in rows] == ["TensorConstant"]
    (row,) = rows
    assert row["fqn"] != "table" and row["fqn"].startswith("_tensor_constant")
    with pytest.raises(AdmissionError) as e:
        literal_tensors(program, [row])
    assert e.value.code == "admission.literal_unbound"
    assert str(e.value) == (
        f"declared literal constant '{row['fqn']}' has no exported value; register durable tensors as buffers"
    )


@pytest.mark.real_aoti
def test_without_the_fence_small_constants_are_baked_into_code(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Negative control for the weight-swap arbiter: inductor's defaults inline the rank-0
    ``scale`` and the 4-element ``shift`` (they leave the constant table), so binding B
    silently computes with A's values. The policy's fence is what prevents it."""
    unfenced = policy.CompilePolicy(
        code_options=(("aot_inductor.package", True), ("aot_inductor.package_constants_in_so", False)),
        topology_options=POLICY.topology_options,
    )
    monkeypatch.setattr(policy, "POLICY", unfenced)
    started = time.monotonic()
    package = compile_package(_swap_program(0), "tests/unfenced", _runtime(), tmp_path)
    COMPILE_SECONDS["unfenced"] = time.monotonic() - started
    graph = MinimalGraph(package, "tests/unfenced")
    assert sorted(graph.constant_fqns) == ["linear.bias", "linear.weight", "offset"]
    weights = swap_weights(1)
    graph.bind(weights)
    eager = SwapModel().eval()
    eager.load_state_dict(weights)
    x = torch.randn(4, 16)
    with torch.no_grad():
        got, want = graph(x), eager(x)
    got = got[0] if isinstance(got, (list, tuple)) else got
    assert not torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_report_compile_times() -> None:
    """Not an assertion on time (benchmarks measure speed): records what the fixtures took."""
    for name, seconds in COMPILE_SECONDS.items():
        print(f"real compile {name}: {seconds:.1f}s")
