"""Parity at mint and the native-unsupported scan (issue 24 items 5 and 6), on one real compile.

The model calls a ``torch.library`` custom op that has no C shim, so the
generated code runs it through torch's proxy executor. One real AOTInductor
compile (module fixture, ``Engine.ensure`` unpatched) proves the passing path
of the parity check, the figures in the mint record, the scan, the refusal of
``load_native`` and that ``load()`` runs the graph. The failing path reuses the
package that compile produced (captured before the mint record was added) and
perturbs one output of the compiled run inside the test only, by replacing
``_parity.run_compiled``, a function of this project (torch is not patched).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torch_compiled_graphs import CompileError, Engine, GraphClassSpec, RuntimeCompatibility, _parity, record_toolchain
from torch_compiled_graphs.errors import BindingError

from .fleet_support import Moto, moto_server, point_at


@torch.library.custom_op("tcgtest::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twice.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class WithCustomOp(nn.Module):
    """Linear -> a custom op without a C shim -> relu."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.tcgtest.twice(self.lin(x)).relu()


def _spec() -> tuple[nn.Module, GraphClassSpec]:
    model = WithCustomOp().eval()
    program = torch.export.export(model, (torch.randn(2, 4, generator=torch.Generator().manual_seed(1)),))
    return model, GraphClassSpec("mint/custom-op", "mint-tests", program)


def _key(spec: GraphClassSpec, toolchain: dict[str, str]) -> str:
    return str(RuntimeCompatibility("cpu", toolchain=toolchain).key(spec.declare()))


@pytest.fixture(scope="module")
def minted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One real mint; the compiled package is also kept as torch wrote it (``raw``)."""
    import torch_compiled_graphs.compile as policy

    root = tmp_path_factory.mktemp("parity")
    real = policy.compile_package
    raw = root / "raw.pt2"

    def capturing(*args: Any, **kwargs: Any) -> Path:
        out = real(*args, **kwargs)
        shutil.copyfile(out, raw)
        return out

    model, spec = _spec()
    toolchain = record_toolchain()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(policy, "compile_package", capturing)
        result = Engine(root / "store").ensure(
            _key(spec, toolchain), root / "graph", target="cpu", toolchain=toolchain, recipe=lambda: spec
        )
    assert raw.is_file()
    return {"root": root, "model": model, "spec": spec, "toolchain": toolchain, "result": result, "raw": raw}


@pytest.mark.real_aoti
def test_the_mint_checks_parity_and_records_the_figures_outside_the_metadata(minted: dict[str, Any]) -> None:
    result = minted["result"]
    assert result.outcome == "minted"
    graph = result.compiled_graph
    record = graph.mint_record
    assert record is not None and record["format"] == "tcg-mint-record-v1"
    parity = record["parity"]
    assert parity["status"] == "passed" and parity["inputs"] == "example_inputs"
    assert parity["runner"] == "torch"  # the .so uses the process's C++ runtime
    (leaf,) = parity["leaves"]
    assert leaf["path"] == "" and leaf["dtype"] == "float32" and leaf["shape"] == [2, 4] and leaf["numel"] == 8
    assert (leaf["atol"], leaf["rtol"]) == _parity.TOLERANCES["float32"]
    assert leaf["scale"] == 1.0  # atol is not scaled (kept for the record's shape)
    assert 0.0 <= leaf["max_abs_diff"] <= leaf["atol"] + leaf["rtol"] * 10.0
    # Not in the metadata, not in the key: the key is the one the declaration derives.
    text = json.dumps(graph.metadata)
    assert "parity" not in text and "tcg-mint" not in text and "unsupported" not in text
    assert graph.key == _key(minted["spec"], minted["toolchain"])
    assert sorted(graph.metadata) == sorted(
        [
            "compiled_graph_format",
            "compiled_graph_key",
            "constant_folding_fenced",
            "graph_class",
            "host_isa",
            "kind",
            "package_constants_in_so",
            "sm",
            "toolchain",
        ]
    )


@pytest.mark.real_aoti
def test_a_custom_op_without_a_c_shim_is_listed_refused_natively_and_run_by_load(
    minted: dict[str, Any], tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    graph = minted["result"].compiled_graph
    want = [{"call": "aoti_torch_proxy_executor_call_function", "count": 1, "target": "tcgtest::twice"}]
    assert graph.mint_record["native"]["unsupported_calls"] == want
    assert graph.native_unsupported_calls == want
    # The .so imports the proxy executor's entry point from libtorch's C shim (docs/shim.md).
    assert "aoti_torch_proxy_executor_call_function" in graph.shim_imports["aoti_torch"]
    model = minted["model"]
    weights = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, weights)
    with pytest.raises(BindingError) as e:
        graph.load_native(weights)
    assert e.value.code == "run.native_unsupported"
    assert "tcgtest::twice" in str(e.value) and "use load()" in str(e.value)
    # load() runs it through torch's proxy executor, in this process that registered the op.
    x = torch.randn(2, 4)
    loaded = graph.load(model)
    torch.testing.assert_close(loaded(x), model(x))


@pytest.fixture(scope="module")
def moto() -> Iterator[Moto]:
    with moto_server() as m:
        yield m


@pytest.mark.real_aoti
def test_a_parity_mismatch_refuses_the_mint_and_publishes_nothing_locally_or_remotely(
    minted: dict[str, Any], moto: Moto, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import torch_compiled_graphs.compile as policy

    fleet = point_at(moto, monkeypatch, tmp_path, "2")
    raw = tmp_path / "model.pt2"
    shutil.copyfile(minted["raw"], raw)
    monkeypatch.setattr(policy, "compile_package", lambda *a, **k: raw)
    original = _parity.run_compiled

    def perturbed(*args: Any, **kwargs: Any) -> list[Any]:
        outputs = original(*args, **kwargs)
        bad = outputs[0].clone()
        bad.view(-1)[5] += 0.25
        return [bad, *outputs[1:]]

    monkeypatch.setattr(_parity, "run_compiled", perturbed)
    _, spec = _spec()
    key = _key(spec, minted["toolchain"])
    engine = Engine(tmp_path / "store", remote=fleet)
    with pytest.raises(CompileError) as e:
        engine.ensure(key, tmp_path / "graph", target="cpu", toolchain=minted["toolchain"], recipe=lambda: spec)
    assert e.value.code == "mint.parity_failed"
    message = str(e.value)
    assert "max abs error 0.25 exceeds the allowed" in message, message
    assert "at element [1, 1]" in message and "nothing is published" in message, message
    # Nothing for the key, here or on the remote.
    assert engine.list() == []
    assert engine.resolve(key, tmp_path / "again") is None
    assert not (tmp_path / "graph").exists()
    other = Engine(tmp_path / "other", remote=fleet)
    assert other.resolve(key, tmp_path / "remote-copy") is None
    import boto3

    bucket = fleet[len("s3://") :].split("/", 1)[0]
    s3 = boto3.client(
        "s3",
        endpoint_url=moto.endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    assert s3.list_objects_v2(Bucket=bucket).get("Contents", []) == []


@pytest.mark.real_aoti
def test_a_program_without_example_inputs_cannot_be_checked(minted: dict[str, Any]) -> None:
    _, spec = _spec()
    program = spec.program
    program.example_inputs = None
    with pytest.raises(CompileError) as e:
        _parity.check_parity(program, minted["raw"], spec.graph_class)
    assert e.value.code == "mint.parity_unavailable"
    assert "example inputs" in str(e.value)


# ----------------------------------------------------------------------------- the comparison, no compile


def _leaf(expected: torch.Tensor, actual: torch.Tensor) -> tuple[dict[str, Any] | None, str | None]:
    return _parity._compare("[0]", expected, actual)


def test_every_floating_dtype_has_a_tolerance_and_integers_are_exact() -> None:
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128):
        atol, rtol = _parity.tolerance(str(dtype).removeprefix("torch."))
        assert atol > 0 and rtol > 0, dtype
    for dtype in (torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool):
        assert _parity.tolerance(str(dtype).removeprefix("torch.")) == (0.0, 0.0)


def test_within_the_tolerance_passes_with_its_figures() -> None:
    e = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
    leaf, failure = _leaf(e, e + 1e-5)
    assert failure is None and leaf is not None
    assert leaf["numel"] == 4 and leaf["scale"] == 1.0 and leaf["shape"] == [2, 2]
    assert leaf["max_abs_diff"] == pytest.approx(1e-5, rel=1e-2)
    assert leaf["max_rel_diff"] == pytest.approx(1e-5, rel=1e-2)


def test_past_the_tolerance_fails_with_both_maxima() -> None:
    e = torch.zeros(3, 4)
    a = e.clone()
    a[2, 1] = 1e-3
    leaf, failure = _leaf(e, a)
    assert failure is not None and leaf is not None
    assert "max abs error 0.001 exceeds the allowed 0.0001 at element [2, 1]" in failure, failure
    assert "1 of 12 elements outside" in failure


def test_bf16_is_judged_looser_than_f32() -> None:
    e = torch.linspace(-3, 3, 64)
    off = e + 0.05
    assert _leaf(e.bfloat16(), off.bfloat16())[1] is None
    assert _leaf(e, off)[1] is not None
    assert _leaf(e.bfloat16(), (e + 0.5).bfloat16())[1] is not None


def test_integers_and_bools_must_be_equal() -> None:
    e = torch.arange(6)
    assert _leaf(e, e.clone())[1] is None
    a = e.clone()
    a[0] = 1
    assert "the largest difference is 1 at element [0]" in str(_leaf(e, a)[1])
    b = torch.tensor([True, False])
    assert _leaf(b, b.clone())[1] is None
    assert _leaf(b, ~b)[1] is not None


def test_nan_must_match_nan_and_infinities_must_be_equal() -> None:
    e = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0])
    leaf, failure = _leaf(e, e.clone())
    assert failure is None and leaf is not None and leaf["max_abs_diff"] == 0.0 and leaf["scale"] == 1.0
    a = e.clone()
    a[0] = 0.0
    assert _leaf(e, a)[1] is not None
    a = e.clone()
    a[1] = 1e30
    assert _leaf(e, a)[1] is not None


def test_a_dtype_or_shape_difference_is_a_failure() -> None:
    e = torch.zeros(2, 2)
    assert "compiled is float64" in str(_leaf(e, e.double())[1])
    assert "compiled is float32[4]" in str(_leaf(e, e.reshape(4))[1])
    assert _leaf(torch.zeros(0, 3), torch.zeros(0, 3))[1] is None


def test_a_scalar_output_compares_by_value() -> None:
    assert _parity._compare("[1]", 3, torch.tensor(3))[1] is None
    assert _parity._compare("[1]", 3, 3)[1] is None
    assert "eager 3, compiled 4" in str(_parity._compare("[1]", 3, 4)[1])
    assert _parity._compare("[1]", 3, torch.tensor([3, 3]))[1] is not None


def test_an_int64_difference_below_float64_resolution_refuses_the_mint() -> None:
    # Regression: both sides went through float64, whose spacing near 2**60 is 256, so
    # 2**60 and 2**60 + 127 compared equal with max_abs_diff 0.0.
    e = torch.tensor([[2**60, 7], [-(2**60), 0]], dtype=torch.int64)
    a = e.clone()
    a[0, 0] += 127
    a[1, 0] -= 1
    leaf, failure = _leaf(e, a)
    assert failure is not None and leaf is not None
    assert "2 of 4 elements differ (int64 must be equal exactly)" in failure, failure
    assert "the largest difference is 127 at element [0, 0]" in failure, failure
    assert f"eager {2**60}, compiled {2**60 + 127}" in failure, failure
    assert leaf["max_abs_diff"] == 127 and isinstance(leaf["max_abs_diff"], int)


def test_integer_differences_are_exact_across_the_whole_range() -> None:
    # The difference of two int64 needs 64 bits unsigned: computed without overflow.
    e = torch.tensor([-(2**63), 5], dtype=torch.int64)
    a = torch.tensor([2**63 - 1, 5], dtype=torch.int64)
    leaf, failure = _leaf(e, a)
    assert leaf is not None and leaf["max_abs_diff"] == 2**64 - 1, leaf
    assert f"the largest difference is {2**64 - 1} at element [0]" in str(failure)
    u = torch.tensor([2**64 - 1, 2**63 + 1], dtype=torch.uint64)
    v = u.clone()
    v[1] = 2**63
    leaf, failure = _leaf(u, v)
    assert leaf is not None and leaf["max_abs_diff"] == 1, leaf
    assert f"eager {2**63 + 1}, compiled {2**63}" in str(failure), failure
    assert _leaf(u, u.clone()) == (
        {
            "atol": 0.0,
            "dtype": "uint64",
            "max_abs_diff": 0,
            "max_rel_diff": 0.0,
            "numel": 2,
            "path": "[0]",
            "rtol": 0.0,
            "scale": 1.0,
            "shape": [2],
        },
        None,
    )


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.uint8, torch.uint16, torch.uint32])
def test_every_integer_dtype_is_compared_exactly_in_its_own_dtype(dtype: torch.dtype) -> None:
    top = torch.iinfo(dtype).max
    e = torch.tensor([top, 0, 1], dtype=dtype)
    assert _leaf(e, e.clone())[1] is None
    a = e.clone()
    a[0] = top - 1
    a[2] = 0
    leaf, failure = _leaf(e, a)
    assert leaf is not None and leaf["max_abs_diff"] == 1
    assert "2 of 3 elements differ" in str(failure), failure


def test_a_huge_masked_value_does_not_loosen_the_other_elements() -> None:
    # Regression: atol was scaled by the leaf's largest finite value, so one finfo.min
    # (what transformers and diffusers write into masked positions) let every other
    # element be wrong by 1e30.
    low = torch.finfo(torch.float32).min
    e = torch.tensor([[low, 0.25], [1.0, low]])
    a = e.clone()
    a[0, 1] = 1e30
    leaf, failure = _leaf(e, a)
    assert failure is not None and leaf is not None
    assert "exceeds the allowed 0.000125 at element [0, 1]" in failure, failure
    assert "1 of 4 elements outside" in failure
    a = e.clone()
    a[1, 0] = 1.01
    assert "at element [1, 0]" in str(_leaf(e, a)[1])


def test_masked_positions_equal_in_both_pass_with_exact_figures() -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        low = torch.finfo(dtype).min
        e = torch.tensor([[low, 0.5], [-2.0, low]]).to(dtype)
        a = e.clone()
        a[0, 1] += 1e-5
        leaf, failure = _leaf(e, a)
        assert failure is None, (dtype, failure)
        assert leaf is not None and leaf["max_abs_diff"] < 1e-4 and leaf["scale"] == 1.0


def test_each_element_is_judged_by_its_own_magnitude() -> None:
    # |a - e| <= atol + rtol * |e| element by element: a large element may differ more.
    e = torch.tensor([1000.0, 0.0])
    a = e.clone()
    a[0] += 0.09  # allowed 1e-4 + 1e-4 * 1000 = 0.1001
    assert _leaf(e, a)[1] is None
    a[1] = 2e-4  # allowed 1e-4 near zero, whatever the other element is
    assert "exceeds the allowed 0.0001 at element [1]" in str(_leaf(e, a)[1])


def test_non_finite_elements_must_be_the_same_value() -> None:
    inf = float("inf")
    e = torch.tensor([inf, -inf, float("nan"), 1.0], dtype=torch.float64)
    assert _leaf(e, e.clone())[1] is None
    for i, value in [(0, -inf), (0, 1e308), (1, 0.0), (2, inf), (3, inf), (3, float("nan"))]:
        a = e.clone()
        a[i] = value
        failure = _leaf(e, a)[1]
        assert failure is not None and f"at element [{i}]" in failure, (i, value, failure)
    c = torch.tensor([1 + 1j, complex(inf, 0)], dtype=torch.complex64)
    assert _leaf(c, c.clone())[1] is None
    d = c.clone()
    d[0] = 1 + 1.01j
    assert "at element [0]" in str(_leaf(c, d)[1])
