"""Runtime compatibility, the host-code clamp and record_toolchain (SPEC-v1 §3.4, §4, §5.4)."""

from __future__ import annotations

import platform
import subprocess
import sys
import threading
from typing import Any

import pytest
import torch
from torch.export import export

from tests.models import Sine
from torch_compiled_graphs import _native, runtime
from torch_compiled_graphs import compile as policy
from torch_compiled_graphs.declaration import GraphClassSpec
from torch_compiled_graphs.errors import CompileError, DeclarationError
from torch_compiled_graphs.identity import CompiledGraphKey
from torch_compiled_graphs.runtime import RuntimeCompatibility, impose_clamp
from torch_compiled_graphs.toolchain import record_toolchain

TOOLCHAIN = {"torch": "record-digest", "triton": "compiler-digest"}
X86 = platform.machine().lower() in ("x86_64", "amd64")


def _inductor_config() -> Any:
    import torch._inductor.config as config

    return config


# ----------------------------------------------------------------- targets (§4.1 to §4.3)


def test_cpu_target_is_normalised_and_takes_the_native_cpu_sm() -> None:
    rt = RuntimeCompatibility(" CPU\t", toolchain=TOOLCHAIN)
    assert rt.target == "cpu"
    assert rt.sm == _native.cpu_sm()
    assert rt.sm.startswith("cpu-")
    assert rt.host_isa == _native.host_requirement()
    assert rt.toolchain == TOOLCHAIN
    assert rt.toolchain_axis == _native.toolchain_axis(TOOLCHAIN)


@pytest.mark.parametrize("target", ["gpu", "cuda", "", "  ", "sm_", "sm_8x", "sm_89b", "sm89", "cpu0", 3])
def test_other_targets_are_unsupported(target: Any) -> None:
    with pytest.raises(DeclarationError) as e:
        RuntimeCompatibility(target, toolchain=TOOLCHAIN)
    assert e.value.code == "declaration.target_unsupported"
    assert str(e.value) == "runtime target must be 'cpu' or a concrete 'sm_NN'"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_cuda_target_without_cuda_is_refused() -> None:
    with pytest.raises(DeclarationError) as e:
        RuntimeCompatibility("sm_89", toolchain=TOOLCHAIN)
    assert e.value.code == "declaration.cuda_unavailable"


def test_cuda_target_must_match_the_device_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 9))
    assert RuntimeCompatibility("SM_89", toolchain=TOOLCHAIN).sm == "sm_89"
    assert RuntimeCompatibility("sm_89a", toolchain=TOOLCHAIN).sm == "sm_89a"
    with pytest.raises(DeclarationError) as e:
        RuntimeCompatibility("sm_90", toolchain=TOOLCHAIN)
    assert e.value.code == "declaration.device_mismatch"


@pytest.mark.parametrize("block", [{}, {"torch": " x"}, {"torch": ""}, {" torch": "x"}, ["torch"]])
def test_invalid_toolchain_blocks_are_refused(block: Any) -> None:
    with pytest.raises(DeclarationError) as e:
        RuntimeCompatibility("cpu", toolchain=block)
    assert e.value.code == "declaration.toolchain_invalid"


def test_runtime_key_is_the_declarations_key_for_sm_and_toolchain() -> None:
    declaration = GraphClassSpec("s", "cpu", export(Sine(), (torch.ones(2, 3),))).declare()
    rt = RuntimeCompatibility("cpu", toolchain=TOOLCHAIN)
    key = rt.key(declaration)
    assert isinstance(key, CompiledGraphKey)
    assert key == declaration.key(sm=rt.sm, toolchain=TOOLCHAIN)
    assert key.axes == {"graph": declaration.class_hash, "sm": rt.sm, "toolchain": rt.toolchain_axis}


def test_excluded_toolchain_names_do_not_change_the_key() -> None:
    declaration = GraphClassSpec("s", "cpu", export(Sine(), (torch.ones(2, 3),))).declare()
    a = RuntimeCompatibility("cpu", toolchain=TOOLCHAIN).key(declaration)
    b = RuntimeCompatibility("cpu", toolchain={**TOOLCHAIN, "diffusers": "0.30"}).key(declaration)
    c = RuntimeCompatibility("cpu", toolchain={**TOOLCHAIN, "torch": "other"}).key(declaration)
    assert a == b != c


# ----------------------------------------------------------------- the clamp (§5.4)


@pytest.mark.skipif(not X86, reason="the x86-64 clamp")
def test_the_clamp_holds_on_another_thread() -> None:
    RuntimeCompatibility("cpu", toolchain=TOOLCHAIN)
    config = _inductor_config()
    want = (_native.host_requirement()["cpp_march"], int(_native.host_requirement()["cpp_simdlen"]))
    assert want == ("x86-64-v3", 256) or want[0] in ("x86-64-v2", "x86-64")
    seen: list[tuple[object, object]] = []
    thread = threading.Thread(target=lambda: seen.append((config.cpp.march, config.cpp.simdlen)))
    thread.start()
    thread.join()
    assert seen == [want]
    assert (config.cpp.march, config.cpp.simdlen) == want
    assert config._config["cpp.march"].default == want[0]
    assert config._config["cpp.simdlen"].default == want[1]


def test_a_clamp_that_only_holds_on_the_calling_thread_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    main = threading.get_ident()
    real = runtime._read_clamp
    monkeypatch.setattr(
        runtime,
        "_read_clamp",
        lambda config: real(config) if threading.get_ident() == main else (None, None),
    )
    with pytest.raises(DeclarationError) as e:
        RuntimeCompatibility("cpu", toolchain=TOOLCHAIN)
    assert e.value.code == "declaration.host_policy"
    assert "clamp is thread-local" in str(e.value)
    with pytest.raises(CompileError) as c:
        impose_clamp(CompileError, "compile.host_policy")
    assert c.value.code == "compile.host_policy"


def test_inductor_config_without_process_wide_entries_fails_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    config = _inductor_config()
    monkeypatch.delitem(config._config, "cpp.simdlen")
    with pytest.raises(DeclarationError) as e:
        RuntimeCompatibility("cpu", toolchain=TOOLCHAIN)
    assert e.value.code == "declaration.host_policy"


@pytest.mark.skipif(not X86, reason="the x86-64 clamp")
def test_an_environment_forced_march_fails_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = _inductor_config()._config["cpp.march"]
    monkeypatch.setattr(entry, "env_value_force", "native")
    with pytest.raises(CompileError) as e:
        impose_clamp(CompileError, "compile.host_policy")
    assert e.value.code == "compile.host_policy"


@pytest.fixture
def without_cpp_march(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    """Inductor as torch 2.11 has it (no ``cpp.march`` entry), restored afterwards; a private cache."""
    config = _inductor_config()
    entry = config._config["cpp.cxx"]
    before = config.cpp.cxx
    monkeypatch.setattr(entry, "default", entry.default)
    monkeypatch.delitem(config._config, "cpp.march")
    monkeypatch.setattr(runtime, "_REAL_CXX", [])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    yield config
    config.cpp.cxx = before


def _macros(compiler: str, *flags: str) -> list[str]:
    out = subprocess.run(
        [compiler, *flags, "-dM", "-E", "-x", "c++", "/dev/null"], check=True, capture_output=True, text=True
    ).stdout
    return sorted(out.splitlines())


@pytest.mark.skipif(not X86, reason="the x86-64 clamp")
def test_without_cpp_march_the_compiler_wrapper_clamps_native(without_cpp_march: Any, tmp_path: Any) -> None:
    config = without_cpp_march
    requirement = impose_clamp(CompileError, "compile.host_policy")
    march = requirement["cpp_march"]
    seen: list[object] = []
    thread = threading.Thread(target=lambda: seen.append(config.cpp.cxx))
    thread.start()
    thread.join()
    assert seen == [config.cpp.cxx]
    none, wrapper = config.cpp.cxx
    assert none is None and wrapper.startswith(str(tmp_path / "cache" / "torch-compiled-graphs-cxx-clamp"))
    # Beside the default store root, not inside it: Engine() on the default root still opens.
    from torch_compiled_graphs import Engine

    assert not (tmp_path / "cache" / "torch-compiled-graphs").exists()
    Engine()
    assert (tmp_path / "cache" / "torch-compiled-graphs").is_dir()
    assert config._config["cpp.cxx"].default == (None, wrapper)
    assert config.cpp.simdlen == int(requirement["cpp_simdlen"])
    real = runtime._REAL_CXX[0]
    assert wrapper.rsplit("/", 1)[1] == real.rsplit("/", 1)[1]  # inductor picks flags by the compiler's name
    # -march=native through the wrapper is exactly -march=<level> through the compiler...
    clamped = _macros(wrapper, "-march=native", "-DTCG_PROBE=a b")
    assert clamped == _macros(real, f"-march={march}", "-DTCG_PROBE=a b")
    assert "#define TCG_PROBE a b" in clamped  # ...and every other argument passes through unchanged
    if _macros(real, "-march=native") != _macros(real, f"-march={march}"):
        assert clamped != _macros(real, "-march=native", "-DTCG_PROBE=a b")
    # Compile options state the same clamp.
    assert policy._target_options(RuntimeCompatibility("cpu", toolchain=TOOLCHAIN), requirement) == {
        "cpp.cxx": (None, wrapper),
        "cpp.simdlen": int(requirement["cpp_simdlen"]),
    }


@pytest.mark.skipif(not X86, reason="the x86-64 clamp")
def test_a_tampered_compiler_wrapper_is_rewritten(without_cpp_march: Any) -> None:
    impose_clamp(CompileError, "compile.host_policy")
    wrapper = without_cpp_march.cpp.cxx[1]
    original = open(wrapper, "rb").read()
    with open(wrapper, "wb") as fh:
        fh.write(b'#!/bin/sh\nexec g++ "$@"\n')
    impose_clamp(CompileError, "compile.host_policy")
    assert without_cpp_march.cpp.cxx[1] == wrapper
    assert open(wrapper, "rb").read() == original


@pytest.mark.skipif(not X86, reason="the x86-64 clamp")
def test_a_compiler_wrapper_in_a_shared_directory_fails_closed(without_cpp_march: Any, tmp_path: Any) -> None:
    import os

    shared = tmp_path / "cache" / "torch-compiled-graphs-cxx-clamp"
    shared.mkdir(parents=True)
    os.chmod(shared, 0o777)
    with pytest.raises(DeclarationError) as e:
        RuntimeCompatibility("cpu", toolchain=TOOLCHAIN)
    assert e.value.code == "declaration.host_policy"
    assert "not a private directory" in str(e.value)


def test_a_host_requirement_failure_is_a_host_policy_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail() -> dict[str, str]:
        raise DeclarationError("cannot state a native ISA requirement", "declaration.host_policy")

    monkeypatch.setattr(_native, "host_requirement", fail)
    with pytest.raises(CompileError) as e:
        impose_clamp(CompileError, "compile.host_policy")
    assert e.value.code == "compile.host_policy"


# ----------------------------------------------------------------- record_toolchain (§3.4)


def test_record_toolchain_states_the_compile_stack_as_build_facts() -> None:
    block = record_toolchain()
    assert block == record_toolchain()
    assert {"torch", "triton", "cxx", "settings_declaration"} <= set(block)
    extra = set(block) - {"torch", "triton", "cxx", "settings_declaration"}
    assert all(name.startswith("nvidia-") for name in extra)
    for name, value in block.items():
        assert value == "absent" or (len(value) == 16 and set(value) <= set("0123456789abcdef")), name
    assert block["torch"] != block["triton"]
    assert len(_native.toolchain_axis(block)) == 16


def test_record_toolchain_names_the_compiler_inductor_invokes() -> None:
    from torch._inductor.cpp_builder import get_cpp_compiler

    from torch_compiled_graphs import toolchain

    assert toolchain._cxx_command() == get_cpp_compiler()


def test_settings_declaration_follows_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    before = record_toolchain()["settings_declaration"]
    changed = policy.CompilePolicy(
        code_options=(*policy.POLICY.code_options, ("max_autotune", True)),
        topology_options=policy.POLICY.topology_options,
    )
    monkeypatch.setattr(policy, "POLICY", changed)
    assert record_toolchain()["settings_declaration"] != before


def test_topology_options_do_not_enter_the_settings_declaration() -> None:
    threads = policy.CompilePolicy(code_options=policy.POLICY.code_options, topology_options=(("compile_threads", 7),))
    assert threads.settings_declaration() == policy.POLICY.settings_declaration()


def test_torch_adapter_modules_and_record_toolchain_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import torch_compiled_graphs.declaration, torch_compiled_graphs.runtime\n"
        "import torch_compiled_graphs.compile, torch_compiled_graphs.toolchain\n"
        "import torch_compiled_graphs._runner_min\n"
        "block = torch_compiled_graphs.toolchain.record_toolchain()\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch.'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
