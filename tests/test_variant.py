"""The libtorch-free variant ``shim-v1`` (issue 34, item 1; docs/keys.md "Variants").

Without compiling: each policy's settings declaration (the default's unchanged, so every
default key is), the native table of policy names against the Python policies, the keys
of the two variants, the checks of a request, the names a refusal gives, and the build
matrix's variants. With three small real compiles (``real_aoti``): an elementwise and
reduction graph minted as the variant (its ``.so`` imports only shim set v1, its key is not the default's,
``explain`` names the variant) and a convolution the variant refuses (code, op named,
nothing published), whose default variant still mints.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.export import export

from torch_compiled_graphs import (
    CompileError,
    DeclarationError,
    Engine,
    EnsureOutcome,
    GraphClassSpec,
    RuntimeCompatibility,
    _native,
    record_toolchain,
)
from torch_compiled_graphs.build.cell import cell_key, cell_toolchain
from torch_compiled_graphs.build.errors import BuildError
from torch_compiled_graphs.build.matrix import parse_matrix
from torch_compiled_graphs.compile import POLICY, SHIM_V1_POLICY, policy_of
from torch_compiled_graphs.toolchain import settings_digest, variant_of_block, variant_toolchain
from torch_compiled_graphs.variant import check_request, refusal_names

#: The default policy's settings declaration digest: pinned, so every default key is unchanged.
DEFAULT_DIGEST = "e498023a9ea8081a"
#: The libtorch-free variant's.
SHIM_V1_DIGEST = "c2b5fae3810f44f2"


# --------------------------------------------------------------------------- without compiling


def test_the_default_policy_declares_exactly_what_it_declared_before_variants() -> None:
    assert POLICY.settings_declaration() == {
        "policy": "tcg-compile-policy-v1",
        "inductor": {
            "aot_inductor.package": True,
            "aot_inductor.package_constants_in_so": False,
            "aot_inductor.use_runtime_constant_folding": False,
            "always_keep_tensor_constants": True,
            "freezing": False,
            "joint_graph_constant_folding": False,
        },
    }
    assert settings_digest() == settings_digest("default") == DEFAULT_DIGEST
    assert record_toolchain()["settings_declaration"] == DEFAULT_DIGEST
    assert record_toolchain("default") == record_toolchain()
    # The device options of a variant are none of the default's business.
    assert POLICY.inductor_options("cpu") == POLICY.inductor_options("cuda")


def test_the_variant_policy_is_the_default_plus_libtorch_free_kernels() -> None:
    declared = SHIM_V1_POLICY.settings_declaration()
    assert declared["policy"] == "tcg-compile-policy-shim-v1"
    assert declared["inductor"] == {
        **POLICY.settings_declaration()["inductor"],  # type: ignore[dict-item]
        "aot_inductor.link_libtorch": False,
        "max_autotune": True,
    }
    assert declared["inductor_by_device"] == {
        "cpu": {
            "cpp.threads": 1,
            "cpp.weight_prepack": False,
            "max_autotune_conv_backends": "TRITON",
            "max_autotune_gemm_backends": "CPP",
        },
        "cuda": {"max_autotune_conv_backends": "TRITON", "max_autotune_gemm_backends": "TRITON"},
    }
    assert declared["attention"] == "flex"
    assert declared["tuning"] == "range-ends/8x"
    assert SHIM_V1_POLICY.package_constants_in_so is False and SHIM_V1_POLICY.constant_folding_fenced
    cpu, cuda = SHIM_V1_POLICY.inductor_options("cpu"), SHIM_V1_POLICY.inductor_options("cuda")
    assert cpu["max_autotune_gemm_backends"] == "CPP" and cpu["cpp.threads"] == 1
    assert cuda["max_autotune_gemm_backends"] == "TRITON" and "cpp.threads" not in cuda
    assert cpu["compile_threads"] == 1  # topology, not in the declaration
    assert settings_digest("shim-v1") == SHIM_V1_DIGEST != DEFAULT_DIGEST
    assert record_toolchain("shim-v1") == {**record_toolchain(), "settings_declaration": SHIM_V1_DIGEST}
    assert policy_of("shim-v1") is SHIM_V1_POLICY


def test_the_native_policy_names_are_those_of_the_python_policies() -> None:
    # explain (Rust, also the CLI) names a settings_declaration digest from this table.
    assert _native.COMPILE_POLICIES == {
        settings_digest("default"): "default policy",
        settings_digest("shim-v1"): "libtorch-free variant shim-v1",
    }


def test_an_unknown_variant_is_refused_everywhere() -> None:
    for call in (
        lambda: policy_of("shim-v2"),
        lambda: settings_digest("shim-v2"),
        lambda: record_toolchain("tuned"),
        lambda: check_request("shim-v2", record_toolchain()),
        lambda: check_request(None, record_toolchain()),
    ):
        with pytest.raises(DeclarationError) as e:
            call()
        assert e.value.code == "declaration.variant_unknown"


def test_the_two_variants_of_one_graph_have_different_keys_in_the_toolchain_axis_only() -> None:
    program = export(nn.Linear(4, 2).eval(), (torch.randn(3, 4),))
    declaration = GraphClassSpec("tests/variant-keys", "t", program).declare()
    default = RuntimeCompatibility("cpu", toolchain=record_toolchain())
    variant = RuntimeCompatibility("cpu", toolchain=record_toolchain("shim-v1"))
    assert default.key(declaration) != variant.key(declaration)
    assert default.sm == variant.sm and default.toolchain_axis != variant.toolchain_axis
    block = record_toolchain()
    assert variant_toolchain(block, "shim-v1") == record_toolchain("shim-v1")
    assert variant_toolchain(variant_toolchain(block, "shim-v1"), "default") == block
    assert variant_of_block(block) == "default"
    assert variant_of_block(record_toolchain("shim-v1")) == "shim-v1"
    assert variant_of_block({**block, "settings_declaration": "0123456789abcdef"}) is None


def test_a_request_must_name_its_variant_in_the_toolchain() -> None:
    default, variant = record_toolchain(), record_toolchain("shim-v1")
    assert check_request("default", default) == "default"
    assert check_request("shim-v1", variant) == "shim-v1"
    # A caller's own block is the default's business, as before variants existed.
    assert check_request("default", {"torch": "t", "settings_declaration": "policy-1"}) == "default"
    for asked, block in (("shim-v1", default), ("default", variant), ("shim-v1", {"torch": "t"})):
        with pytest.raises(DeclarationError) as e:
            check_request(asked, block)
        assert e.value.code == "declaration.variant_mismatch", (asked, block)


def test_ensure_refuses_a_variant_its_toolchain_does_not_name(tmp_path: Path) -> None:
    engine = Engine(tmp_path / "store")
    called = []
    for variant, block in (("shim-v1", record_toolchain()), ("default", record_toolchain("shim-v1"))):
        with pytest.raises(DeclarationError) as e:
            engine.ensure(
                "cg-key-v1-" + "0" * 56,
                tmp_path / "out",
                target="cpu",
                toolchain=block,
                recipe=lambda: called.append(1),  # type: ignore[arg-type,return-value]
                variant=variant,
            )
        assert e.value.code == "declaration.variant_mismatch"
    with pytest.raises(DeclarationError) as e:
        engine.ensure("k", tmp_path / "out", target="cpu", toolchain={}, recipe=lambda: None, variant="v2")  # type: ignore[arg-type,return-value]
    assert e.value.code == "declaration.variant_unknown"
    assert called == [] and engine.list() == []


def test_a_refusal_names_the_aten_op_behind_each_extern() -> None:
    names = refusal_names(
        [
            "GOMP_parallel",
            "Sleef_expf8_u10",
            "_ZN3c106detail14torchCheckFailEPKcS2_jS2_",
            "aoti_torch_cpu__scaled_dot_product_flash_attention_for_cpu",
            "aoti_torch_cpu_addmm_out",
            "aoti_torch_cpu_convolution",
            "aoti_torch_cuda_mm_out",
            "aoti_torch_proxy_executor_call_function",
            "aoti_torch_zero_",
        ],
        [{"call": "aoti_torch_proxy_executor_call_function", "target": "mylib::scale", "count": 2}],
    )
    assert names == [
        "GOMP_parallel (the OpenMP runtime)",
        "Sleef_expf8_u10 (SLEEF vector math, carried by libtorch)",
        "_ZN3c106detail14torchCheckFailEPKcS2_jS2_ (a libtorch C++ API symbol)",
        "aten._scaled_dot_product_flash_attention_for_cpu (aoti_torch_cpu__scaled_dot_product_flash_attention_for_cpu)",
        "aten.addmm (aoti_torch_cpu_addmm_out)",
        "aten.convolution (aoti_torch_cpu_convolution)",
        "aten.mm (aoti_torch_cuda_mm_out)",
        "mylib::scale (aoti_torch_proxy_executor_call_function)",
        "aoti_torch_zero_ (a libtorch C shim function outside shim set v1)",
    ]
    assert refusal_names(["aoti_torch_proxy_executor_call_function"], []) == [
        "an operator the extern-kernel table does not name (aoti_torch_proxy_executor_call_function)"
    ]


def test_the_shim_set_judges_imports_as_package_covered_does() -> None:
    assert _native.SHIM_SET_V1 == "shim set v1"
    assert _native.shim_set_v1_missing(["aoti_torch_clone", "aoti_torch_empty_strided"], []) == []
    assert _native.shim_set_v1_missing(
        ["aoti_torch_cpu_addmm_out", "aoti_torch_clone", "aoti_torch_cpu_addmm_out"], ["GOMP_parallel"]
    ) == ["GOMP_parallel", "aoti_torch_cpu_addmm_out"]


MATRIX = """
toolchain = "lock.json"
targets = ["cpu"]
[[recipes]]
callable = "tests.build_recipes:mlp"
grid = {{ width = [8, 16] }}
{variants}
"""


def test_the_build_matrix_mints_the_variants_a_recipe_lists(tmp_path: Path) -> None:
    plain = parse_matrix(MATRIX.format(variants=""), tmp_path / "m.toml")
    assert [c.variant for c in plain.cells] == ["default", "default"]
    assert [c.name for c in plain.cells] == ["mlp[width=8]@cpu", "mlp[width=16]@cpu"]  # unchanged names
    both = parse_matrix(MATRIX.format(variants='variants = ["default", "shim-v1"]'), tmp_path / "m.toml")
    assert [(c.index, c.name, c.variant) for c in both.cells] == [
        (0, "mlp[width=8]@cpu", "default"),
        (1, "mlp[width=8]@cpu+shim-v1", "shim-v1"),
        (2, "mlp[width=16]@cpu", "default"),
        (3, "mlp[width=16]@cpu+shim-v1", "shim-v1"),
    ]
    lock = record_toolchain()
    assert cell_toolchain(both.cells[0], lock) == lock
    assert cell_toolchain(both.cells[1], lock) == record_toolchain("shim-v1")
    program = export(nn.Linear(4, 2).eval(), (torch.randn(3, 4),))
    spec = GraphClassSpec("tests/variant-cells", "t", program)
    assert cell_key(spec, both.cells[0], lock) != cell_key(spec, both.cells[1], lock)
    assert cell_key(spec, both.cells[0], lock) == str(RuntimeCompatibility("cpu", toolchain=lock).key(spec.declare()))
    for bad in ('variants = ["shim-v2"]', "variants = []", 'variants = ["default", "default"]', 'variants = "x"'):
        with pytest.raises(BuildError) as e:
            parse_matrix(MATRIX.format(variants=bad), tmp_path / "m.toml")
        assert e.value.code == "build.matrix_invalid", bad


def test_toolchain_record_prints_the_variant_block() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "torch_compiled_graphs", "toolchain", "record", "--variant", "shim-v1"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout) == record_toolchain("shim-v1")


# --------------------------------------------------------------------------- real compiles


class Admitted(nn.Module):
    """Elementwise work and reductions with a bound parameter and buffer: all generated
    kernels, no extern (a Linear is not: on the CPU it stays an aten.addmm extern)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(16))
        self.register_buffer("shift", torch.randn(16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.relu(x * self.scale + self.shift)
        centred = y - y.mean(dim=-1, keepdim=True)
        return centred / (centred.abs().amax(dim=-1, keepdim=True) + 1.0), y.sum(dim=0)


class Refused(nn.Module):
    """A convolution: on the CPU no template replaces the aten.convolution extern."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


def admitted_spec() -> GraphClassSpec:
    torch.manual_seed(0)
    return GraphClassSpec("tests/variant-admitted", "t", export(Admitted().eval(), (torch.randn(4, 16),)))


def refused_spec() -> GraphClassSpec:
    torch.manual_seed(0)
    return GraphClassSpec("tests/variant-refused", "t", export(Refused().eval(), (torch.randn(1, 3, 8, 8),)))


class Gemm(nn.Module):
    """A Linear: on the CPU no GEMM template applies to a weight bound by fqn, and the
    variant lists no ATEN backend, so inductor finds no kernel for it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


@pytest.fixture(scope="module")
def minted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The admitted graph minted as the variant; the convolution refused as it, then minted as the default."""
    root = tmp_path_factory.mktemp("variant")
    engine = Engine(root / "store")
    default_tc, variant_tc = record_toolchain(), record_toolchain("shim-v1")
    spec = admitted_spec()
    key = RuntimeCompatibility("cpu", toolchain=variant_tc).key(spec.declare())
    result = engine.ensure(key, root / "v", target="cpu", toolchain=variant_tc, recipe=lambda: spec, variant="shim-v1")

    conv = refused_spec()
    conv_variant_key = RuntimeCompatibility("cpu", toolchain=variant_tc).key(conv.declare())
    with pytest.raises(CompileError) as refusal:
        engine.ensure(
            conv_variant_key, root / "cv", target="cpu", toolchain=variant_tc, recipe=lambda: conv, variant="shim-v1"
        )
    keys_after_refusal = [row["key"] for row in engine.list()]
    conv_default_key = RuntimeCompatibility("cpu", toolchain=default_tc).key(conv.declare())
    conv_default = engine.ensure(conv_default_key, root / "cd", target="cpu", toolchain=default_tc, recipe=lambda: conv)
    return {
        "root": root,
        "engine": engine,
        "spec": spec,
        "key": str(key),
        "result": result,
        "refusal": refusal.value,
        "keys_after_refusal": keys_after_refusal,
        "conv_variant_key": str(conv_variant_key),
        "conv_default_key": str(conv_default_key),
        "conv_default": conv_default,
    }


@pytest.mark.real_aoti
def test_a_graph_the_variant_admits_mints_as_it_with_only_shim_set_v1_imports(minted: dict[str, Any]) -> None:
    result = minted["result"]
    assert result.outcome is EnsureOutcome.MINTED and result.compiled_graph.key == minted["key"]
    default_key = RuntimeCompatibility("cpu", toolchain=record_toolchain()).key(minted["spec"].declare())
    assert str(default_key) != minted["key"]
    graph = result.compiled_graph
    imports = graph.shim_imports
    assert imports["other"] == []
    assert imports["aoti_torch"] and _native.shim_set_v1_missing(imports["aoti_torch"], imports["other"]) == []
    assert not any(name.startswith(("aoti_torch_cpu_", "aoti_torch_cuda_")) for name in imports["aoti_torch"])
    # The parity check ran it (through libtorch's shim, made global) against eager before publication.
    record = graph.mint_record
    assert record is not None and record["parity"]
    # And it serves through load() under torch, equal to eager.
    torch.manual_seed(0)
    module = Admitted().eval()
    loaded = graph.load(module)
    x = torch.randn(4, 16)
    torch.testing.assert_close(tuple(loaded(x)), module(x))


@pytest.mark.real_aoti
def test_explain_names_the_variant_when_two_keys_differ_only_by_it(minted: dict[str, Any]) -> None:
    engine = minted["engine"]
    e = engine.explain(minted["spec"], target="cpu", toolchain=record_toolchain(), limit=1)
    assert not e.present and e.nearest is not None and e.nearest.key == minted["key"]
    assert e.nearest.facts == ("toolchain.settings_declaration",)
    difference = e.nearest.differences[0]
    assert (difference.requested, difference.stored) == (DEFAULT_DIGEST, SHIM_V1_DIGEST)
    assert difference.detail == {"policies": {"requested": "default policy", "stored": "libtorch-free variant shim-v1"}}
    assert "compile policy: requested default policy vs stored libtorch-free variant shim-v1" in str(e)


@pytest.mark.real_aoti
def test_a_graph_the_variant_cannot_serve_is_refused_with_the_op_and_nothing_published(
    minted: dict[str, Any],
) -> None:
    refusal = minted["refusal"]
    assert refusal.code == "compile.variant_refused"
    message = str(refusal)
    assert "aten.convolution (aoti_torch_cpu_convolution)" in message
    assert "shim set v1" in message and "variant='default'" in message
    assert minted["conv_variant_key"] not in minted["keys_after_refusal"]
    assert minted["keys_after_refusal"] == [minted["key"]]
    engine = minted["engine"]
    assert engine.resolve(minted["conv_variant_key"], minted["root"] / "none") is None
    # The default variant of the same graph still mints, and imports the extern through libtorch.
    done = minted["conv_default"]
    assert done.outcome is EnsureOutcome.MINTED and done.compiled_graph.key == minted["conv_default_key"]
    assert "aoti_torch_cpu_convolution" in done.compiled_graph.shim_imports["aoti_torch"]
    torch.manual_seed(0)
    module = Refused().eval()
    x = torch.randn(1, 3, 8, 8)
    torch.testing.assert_close(done.compiled_graph.load(module)(x), module(x))


def test_a_no_kernel_failure_names_the_lowered_op_and_nothing_else_does() -> None:
    from torch_compiled_graphs.variant import no_kernel_ops

    class NoValidChoicesError(RuntimeError):
        pass

    inner = NoValidChoicesError("No choices to select")
    outer = RuntimeError(
        "LoweringException: NoValidChoicesError: No choices\n  target: aten.addmm.default\n  args: ..."
    )
    outer.__cause__ = inner
    assert no_kernel_ops(outer) == ["aten.addmm (no kernel of the variant's template backends: NoValidChoicesError)"]
    assert no_kernel_ops(inner) == ["an operator inductor names no target for (NoValidChoicesError)"]
    assert no_kernel_ops(RuntimeError("target: aten.addmm.default, something else failed")) is None


@pytest.mark.real_aoti
def test_a_gemm_without_a_variant_kernel_is_refused_as_the_variant_naming_the_op(tmp_path: Path) -> None:
    torch.manual_seed(0)
    spec = GraphClassSpec("tests/variant-gemm", "t", export(Gemm().eval(), (torch.randn(4, 16),)))
    engine = Engine(tmp_path / "store")
    variant_tc = record_toolchain("shim-v1")
    key = RuntimeCompatibility("cpu", toolchain=variant_tc).key(spec.declare())
    with pytest.raises(CompileError) as refusal:
        engine.ensure(key, tmp_path / "v", target="cpu", toolchain=variant_tc, recipe=lambda: spec, variant="shim-v1")
    assert refusal.value.code == "compile.variant_refused", str(refusal.value)
    message = str(refusal.value)
    assert "aten.addmm (no kernel of the variant's template backends: NoValidChoicesError)" in message, message
    assert "variant='default'" in message and engine.list() == []
    # The default variant of the same graph mints (its GEMM an extern through libtorch).
    default_tc = record_toolchain()
    default_key = RuntimeCompatibility("cpu", toolchain=default_tc).key(spec.declare())
    done = engine.ensure(default_key, tmp_path / "d", target="cpu", toolchain=default_tc, recipe=lambda: spec)
    assert done.outcome is EnsureOutcome.MINTED


# A variant mint in a machine whose inductor cache is new: the cache's check of the
# host's vector ISAs (a probe library compiled once and remembered on disk) must come
# out as it does for the default, or every later CPU compile there emits scalar code.
VARIANT_MINT_CHILD = r"""
import sys
import torch
from torch.export import export
from torch_compiled_graphs import record_toolchain
from torch_compiled_graphs.compile import compile_package
from torch_compiled_graphs.runtime import RuntimeCompatibility

class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1, 1, 24))

    def forward(self, x):
        return torch.tanh(x * self.w) + x

program = export(Scale().eval(), (torch.randn(5, 24),))
runtime = RuntimeCompatibility("cpu", toolchain=record_toolchain("shim-v1"))
compile_package(program, "tests/variant-isa", runtime, sys.argv[1], variant="shim-v1")
"""

ISA_CHILD = r"""
from torch._inductor import cpu_vec_isa
print(",".join(str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()))
"""


def _host_has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return any(line.startswith("flags") and " avx2" in line for line in f)
    except OSError:
        return False


@pytest.mark.real_aoti
@pytest.mark.skipif(not _host_has_avx2(), reason="an x86-64 host with AVX2")
def test_a_variant_mint_leaves_the_machines_vector_isa_check_as_the_default_finds_it(tmp_path: Path) -> None:
    env = {**__import__("os").environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache")}

    def child(code: str, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=900, check=False
        )
        assert done.returncode == 0, done.stderr[-4000:]
        return done.stdout.strip()

    child(VARIANT_MINT_CHILD, str(tmp_path / "mint"))
    assert (tmp_path / "mint" / "model.pt2").is_file()
    # A later process on the same cache: the check it finds on disk is a loadable one.
    assert "avx2" in child(ISA_CHILD).split(",")
