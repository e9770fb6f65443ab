"""Declaring graph classes from exported programs (SPEC-v1 §3.7 to §3.10); no compile."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.export import Dim, export

from tests.models import MLP, Cosine, Pair, Sine, SwapModel, WithLiteral, swap_weights
from torch_compiled_graphs import _native
from torch_compiled_graphs.declaration import (
    GraphClassSpec,
    call_ingress,
    canonical_lines,
    constant_fqns,
    literal_names,
    literal_rows,
    placement,
)
from torch_compiled_graphs.errors import DeclarationError
from torch_compiled_graphs.identity import GraphClassDeclaration, graph_witness

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "testdata" / "reference-0.2.0"
CONTRACTS = ROOT / "testdata" / "contracts"

SINE_LINES = [
    "v=1 ir=export",
    "node 0 placeholder  arg0 args=() kwargs=() val=t(torch.float32|[2,3]|cpu)",
    "node 1 call_function torch._ops.aten.aten::sin  args=(%0) kwargs=() val=t(torch.float32|[2,3]|cpu)",
    "node 2 output output  args=((%1)) kwargs=() val=-",
    "sig in 0 kind=USER_INPUT target=-",
    "sig out 0 kind=USER_OUTPUT target=-",
]
TOOLCHAIN = {"torch": "record-digest", "triton": "compiler-digest"}


def _sine(dynamic: bool = False) -> Any:
    shapes = ({0: Dim("batch", min=1, max=8)},) if dynamic else None
    return export(Sine(), (torch.ones(2, 3),), dynamic_shapes=shapes)


# ----------------------------------------------------------------- canonical lines (§3.7)


def test_sine_fixture_renders_the_six_spec_lines_and_witness(spec_vectors: dict[str, Any]) -> None:
    lines = canonical_lines(_sine())
    assert lines == SINE_LINES == spec_vectors["witness"]["lines"]
    assert graph_witness(lines) == "54ceeee7225e57c9" == spec_vectors["witness"]["witness"]


def test_dynamic_batch_renders_symbols_and_a_sorted_range_line_before_sig_lines() -> None:
    lines = canonical_lines(_sine(dynamic=True))
    assert lines[1].endswith("val=t(torch.float32|[S0,3]|cpu)")
    assert lines[2].endswith("val=t(torch.float32|[S0,3]|cpu)")
    assert lines[4] == "sym S0 range=[1,8]"
    assert lines[5:] == SINE_LINES[4:]
    assert graph_witness(lines) != "54ceeee7225e57c9"


def test_unbounded_dim_renders_the_int_oo_bound_without_plus() -> None:
    program = export(Sine(), (torch.ones(2, 3),), dynamic_shapes=({0: Dim("batch")},))
    (line,) = [ln for ln in canonical_lines(program) if ln.startswith("sym ")]
    assert line == "sym S0 range=[0,int_oo]"
    # The derived call ingress needs finite bounds; the caller states a range digest instead
    # (see test_a_stated_range_digest_is_opaque_and_no_ingress_is_placed).
    with pytest.raises(DeclarationError) as e:
        GraphClassSpec("s", "cpu", program).declare()
    assert e.value.code == "declaration.ingress_invalid"


def test_parameters_render_as_placeholders_with_signature_targets() -> None:
    model = MLP().eval()
    lines = canonical_lines(export(model, (torch.ones(4, 16),)))
    assert "sig in 0 kind=PARAMETER target=l1.weight" in lines
    assert "node 5 call_function torch._ops.aten.aten::linear  args=(%4,%0,%1) kwargs=() " in lines[6]


@pytest.mark.parametrize("value", [None, object(), "program", torch.nn.Linear(2, 2)])
def test_non_exported_programs_are_refused(value: object) -> None:
    with pytest.raises(DeclarationError) as e:
        canonical_lines(value)
    assert e.value.code == "declaration.program_invalid"
    with pytest.raises(DeclarationError) as e:
        GraphClassSpec("g", "cpu", value).declare()
    assert e.value.code == "declaration.program_invalid"


# ----------------------------------------------------------------- identity


def _key(program: Any, **spec: Any) -> str:
    declaration = GraphClassSpec("model/g", "cpu", program, **spec).declare()
    return str(declaration.key(sm="cpu-x86-64-v3", toolchain=TOOLCHAIN))


def test_same_program_exported_twice_gives_the_same_key() -> None:
    assert _key(_sine()) == _key(_sine())
    torch.manual_seed(0)
    a = export(SwapModel().eval(), (torch.randn(4, 16),))
    b = export(SwapModel().eval(), (torch.randn(4, 16),))
    assert _key(a) == _key(b)


def test_changing_an_op_changes_the_key() -> None:
    cosine = export(Cosine(), (torch.ones(2, 3),))
    assert _key(_sine()) != _key(cosine)


def test_changing_weights_keeps_the_key() -> None:
    keys = set()
    for seed in (0, 1, 2):
        model = SwapModel().eval()
        model.load_state_dict(swap_weights(seed))
        keys.add(_key(export(model, (torch.randn(4, 16),))))
    assert len(keys) == 1


def test_dynamic_dims_change_the_key_and_state_symbols_and_ranges() -> None:
    static, dynamic = _sine(), _sine(dynamic=True)
    assert _key(static) != _key(dynamic)
    ingress = call_ingress(dynamic)
    assert ingress["inputs"][0]["shape"] == ["S0", 3]
    assert ingress["symbols"] == {"S0": [1, 8]}
    narrower = export(Sine(), (torch.ones(2, 3),), dynamic_shapes=({0: Dim("batch", min=1, max=4)},))
    assert _key(narrower) != _key(dynamic)


def test_display_name_is_not_identity_but_target_is() -> None:
    program = _sine()
    a = GraphClassSpec("a", "cpu", program).declare()
    b = GraphClassSpec("b/c", "cpu", program).declare()
    c = GraphClassSpec("a", "unet", program).declare()
    assert a.class_hash == b.class_hash != c.class_hash


# ----------------------------------------------------------------- derived interface and ingress (§3.9)


def test_derived_interface_carries_the_call_ingress_and_its_digest() -> None:
    declaration = GraphClassSpec("s", "cpu", _sine(dynamic=True)).declare()
    graph = declaration.graph
    assert set(graph) == {"v", "constant_fqns", "lifted_inputs", "pytree", "specialization"}
    assert graph["v"] == 3 and graph["lifted_inputs"] == [] and graph["specialization"] == {}
    assert set(graph["pytree"]) == {"in", "out", "ingress"}
    assert json.loads(graph["pytree"]["out"]) == [1, {"type": None, "context": None, "children_spec": []}]
    assert declaration.range_digest == _native.ingress_digest(graph["pytree"]["ingress"])


def test_ingress_of_the_contract_program_restates_the_contract_digest() -> None:
    class Value(torch.nn.Module):
        def forward(self, value: Any) -> Any:
            return value.sin()

    contract = json.loads((CONTRACTS / "call_ingress_v1.json").read_text())
    ingress = call_ingress(export(Value(), (torch.ones(2, 3),)))
    assert ingress == contract["ingress"]
    assert _native.ingress_digest(ingress) == contract["digest"] == "b389f4904367ba113ba552b7076fc2ff"


def test_ingress_names_positional_and_keyword_parameters() -> None:
    program = export(Pair(), (torch.ones(2),), {"y": torch.ones(2)})
    ingress = call_ingress(program)
    assert ingress["parameters"] == ["x", "y"]
    assert [row["name"] for row in ingress["inputs"]] == ["x", "y"]
    assert [row["position"] for row in ingress["inputs"]] == [0, 1]
    assert ingress["flat_arity"] == 2
    GraphClassSpec("pair", "cpu", program).declare()


def test_a_stated_range_digest_is_opaque_and_no_ingress_is_placed() -> None:
    declaration = GraphClassSpec("s", "cpu", _sine(), range_digest="0" * 32).declare()
    assert declaration.range_digest == "0" * 32
    assert set(declaration.graph["pytree"]) == {"in", "out"}
    unbounded = export(Sine(), (torch.ones(2, 3),), dynamic_shapes=({0: Dim("batch")},))
    GraphClassSpec("s", "cpu", unbounded, range_digest="1" * 32).declare()


def test_a_stated_ingress_must_restate_the_range_digest() -> None:
    program = _sine()
    graph = GraphClassSpec("s", "cpu", program).declare().graph
    with pytest.raises(DeclarationError) as e:
        GraphClassSpec("s", "cpu", program, graph=graph, range_digest="0" * 32).declare()
    assert e.value.code == "declaration.ingress_mismatch"
    derived = GraphClassSpec("s", "cpu", program, graph=graph).declare()
    assert derived.range_digest == _native.ingress_digest(graph["pytree"]["ingress"])


# ----------------------------------------------------------------- constants, literals, placement


def test_constant_fqns_are_the_sorted_state_and_constant_names() -> None:
    program = export(SwapModel().eval(), (torch.randn(4, 16),))
    assert constant_fqns(program) == ["linear.bias", "linear.weight", "offset", "scale", "shift"]
    assert literal_names(program) == []
    declaration = GraphClassSpec("swap", "cpu", program).declare()
    assert declaration.literal_values == "" and "literal_values" not in declaration.graph


def test_literal_rows_and_digest_restate_the_contract() -> None:
    contract = json.loads((CONTRACTS / "literal_identity_v1.json").read_text())
    program = export(WithLiteral(), (torch.ones(3, 2),))
    rows = literal_rows(program)
    assert rows == [("table", "torch.float32", [2, 2], torch.tensor([1.0, 2, 3, 4]).numpy().tobytes())]
    declaration = GraphClassSpec("lit", "cpu", program).declare()
    assert declaration.literal_values == "f0bf7306bf0a83cc13766d1b8f990c00"
    assert declaration.graph["literal_values"] == declaration.literal_values
    assert declaration.graph["constant_fqns"] == ["table"]
    assert json.dumps(contract).count("f0bf7306bf0a83cc13766d1b8f990c00") >= 1


def _stated(program: Any, **graph: Any) -> GraphClassSpec:
    base = {"v": 3, "lifted_inputs": [], "pytree": {"in": "leaf", "out": "leaf"}, "specialization": {}}
    return GraphClassSpec("g", "cpu", program, graph={**base, **graph}, range_digest="0" * 32)


def test_stated_constant_fqns_must_match_the_program() -> None:
    program = export(WithLiteral(), (torch.ones(3, 2),))
    assert _stated(program, constant_fqns=["table"]).declare().graph["constant_fqns"] == ["table"]
    with pytest.raises(DeclarationError) as e:
        _stated(program, constant_fqns=["other"]).declare()
    assert e.value.code == "declaration.constant_fqns_mismatch"


def test_stated_literal_values_must_match_and_may_not_be_stated_without_literals() -> None:
    literal = export(WithLiteral(), (torch.ones(3, 2),))
    _stated(literal, literal_values="f0bf7306bf0a83cc13766d1b8f990c00").declare()
    with pytest.raises(DeclarationError) as e:
        _stated(literal, literal_values="1" * 32).declare()
    assert e.value.code == "declaration.literal_values_mismatch"
    with pytest.raises(DeclarationError) as e:
        _stated(_sine(), literal_values="1" * 32).declare()
    assert e.value.code == "declaration.literal_values_mismatch"


def test_the_callers_graph_is_copied_never_mutated() -> None:
    graph = {"v": 3, "lifted_inputs": [], "pytree": {"in": "leaf", "out": "leaf"}, "specialization": {}}
    before = json.dumps(graph, sort_keys=True)
    program = export(WithLiteral(), (torch.ones(3, 2),))
    declaration = GraphClassSpec("g", "cpu", program, graph=graph, range_digest="0" * 32).declare()
    assert json.dumps(graph, sort_keys=True) == before
    assert "constant_fqns" in declaration.graph and "literal_values" in declaration.graph


def test_single_device_placement_is_omitted() -> None:
    program = _sine()
    assert placement(program) == ["cpu"]
    assert GraphClassSpec("g", "cpu", program).declare().placement == ()


# ----------------------------------------------------------------- interop with the reference 0.2.0


def _reference_metadata() -> dict[str, Any]:
    with tarfile.open(REFERENCE / "mlp-cpu.tar.gz") as archive:
        member = archive.extractfile("metadata.json")
        assert member is not None
        data: dict[str, Any] = json.load(io.TextIOWrapper(member, encoding="utf-8"))
        return data


def test_reference_mlp_restates_class_hash_witness_and_key() -> None:
    """The compatibility proof: the same program and facts give the reference's identity."""
    from safetensors.torch import load_file

    reference = json.loads((REFERENCE / "mlp-cpu.json").read_text())
    recorded = _reference_metadata()
    model = MLP().eval()
    model.load_state_dict(load_file(REFERENCE / "mlp-cpu.weights.safetensors"))
    program = export(model, (torch.ones(4, 16),))
    declaration = GraphClassSpec(
        reference["graph_class"],
        reference["target"],
        program,
        graph=reference["graph_interface"],
        range_digest=reference["range_digest"],
    ).declare()
    assert isinstance(declaration, GraphClassDeclaration)
    assert declaration.graph_witness == recorded["graph_class"]["graph_witness"] == "decdff623af935cb"
    assert declaration.class_hash == recorded["graph_class"]["class_hash"] == "bec36ee0772ab315"
    assert declaration.graph == recorded["graph_class"]["graph"]
    key = declaration.key(sm=recorded["sm"], toolchain=recorded["toolchain"])
    assert recorded["sm"] == "cpu-avx512"
    assert key == recorded["compiled_graph_key"] == reference["compiled_graph_key"]
    assert key == "cg-key-v1-ddd506362c49696787e3eb3d0e44c08b00a6358015d9004ba1cd363a"
