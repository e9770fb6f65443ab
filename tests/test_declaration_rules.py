"""One refusal per declaration rule of SPEC-v1 §3.6, asserted with its code."""

from __future__ import annotations

import math
from typing import Any

import pytest

from torch_compiled_graphs import DeclarationError, GraphClassDeclaration
from torch_compiled_graphs.contracts import load_contract

LV = "f0bf7306bf0a83cc13766d1b8f990c00"


def graph(**changes: Any) -> dict[str, Any]:
    g: dict[str, Any] = {
        "v": 3,
        "constant_fqns": [],
        "lifted_inputs": [],
        "pytree": {"in": "leaf", "out": "leaf"},
        "specialization": {},
    }
    g.update(changes)
    return g


def declare(**changes: Any) -> GraphClassDeclaration:
    args: dict[str, Any] = {
        "graph_class": "denoiser/h=64,w=64",
        "target": "unet",
        "graph": graph(),
        "graph_witness": "fedcba9876543210",
        "range_digest": "0123456789abcdef0123456789abcdef",
    }
    args.update(changes)
    return GraphClassDeclaration(**args)


def refused(code: str, **changes: Any) -> DeclarationError:
    with pytest.raises(DeclarationError) as e:
        declare(**changes)
    assert e.value.code == code, str(e.value)
    return e.value


def test_valid_declaration_matches_the_spec_example() -> None:
    d = declare(graph_class=" denoiser/h=64,w=64\u3000", target="\x1cunet ")
    assert d.class_hash == "b2de22c15285fe2d"
    assert d.graph_class == "denoiser/h=64,w=64"
    assert d.target == "unet"


@pytest.mark.parametrize("name", ["", "  ", "a\\b", "/a", "a/", "a//b", "a/./b", "../a", 7, None])
def test_rule_1_name_must_be_a_safe_relative_path(name: Any) -> None:
    refused("declaration.name_invalid", graph_class=name)


@pytest.mark.parametrize("target", ["", " \x85 ", None, 3])
def test_rule_1_target_must_be_non_empty(target: Any) -> None:
    refused("declaration.target_invalid", target=target)


@pytest.mark.parametrize("g", [{}, [], "graph", {"specialization": {"x": math.nan}}, {"v": object()}])
def test_rule_2_graph_must_be_a_non_empty_canonical_object(g: Any) -> None:
    refused("declaration.graph_invalid", graph=g)


def test_rule_2_tuples_canonicalise_as_arrays() -> None:
    a = declare(graph=graph(specialization={"x": (1, 2)}))
    b = declare(graph=graph(specialization={"x": [1, 2]}))
    assert a == b and a.class_hash == b.class_hash


def test_rule_3_graph_key_set() -> None:
    refused("declaration.graph_keys", graph={**graph(), "extra": 1})
    g = graph()
    del g["pytree"]
    refused("declaration.graph_keys", graph=g)


@pytest.mark.parametrize("v", [3.0, 2, True, "3"])
def test_rule_3_graph_version_is_the_integer_3(v: Any) -> None:
    refused("declaration.graph_version", graph=graph(v=v))


@pytest.mark.parametrize("member", ["constant_fqns", "lifted_inputs"])
@pytest.mark.parametrize("items", [["b", "a"], ["a", "a"], [""], [1], "ab"])
def test_rule_3_graph_lists_are_sorted_unique_non_empty_strings(member: str, items: Any) -> None:
    refused("declaration.graph_list", graph=graph(**{member: items}))


@pytest.mark.parametrize("member", ["pytree", "specialization"])
def test_rule_3_pytree_and_specialization_are_objects(member: str) -> None:
    refused("declaration.graph_object", graph=graph(**{member: ["leaf"]}))


@pytest.mark.parametrize("w", ["FEDCBA9876543210", "fedcba987654321", "fedcba98765432100", 16])
def test_rule_4_witness_is_hex16(w: Any) -> None:
    refused("declaration.witness_invalid", graph_witness=w)


@pytest.mark.parametrize("r", ["0123", "0123456789ABCDEF0123456789ABCDEF", None])
def test_rule_4_range_digest_is_hex32(r: Any) -> None:
    refused("declaration.range_digest_invalid", range_digest=r)


@pytest.mark.parametrize(
    "fork",
    [
        [("b", 1), ("a", 1)],
        [(" a", 1)],
        [("",)],
        [("a", 1, 2)],
        [("a", math.inf)],
        [("a", {1: 2})],
        "ab",
    ],
)
def test_rule_5_fork_pairs_are_canonical_and_sorted(fork: Any) -> None:
    refused("declaration.fork_invalid", fork=fork)


def test_rule_5_fork_names_pass_through_str_and_equal_names_are_tolerated() -> None:
    d = declare(fork=[(1, "x"), ("1", "y"), ("b", None)])
    assert d.fork == (("1", "x"), ("1", "y"), ("b", None))


@pytest.mark.parametrize("dims", [[("h", 64.0)], [("h", True)], [("w", 1), ("h", 1)], [("h", "64")]])
def test_rule_6_class_dims_are_named_integers(dims: Any) -> None:
    refused("declaration.class_dims_invalid", class_dims=dims)


@pytest.mark.parametrize("strict", [1, 0, "true", None])
def test_rule_7_strict_is_a_boolean(strict: Any) -> None:
    refused("declaration.strict_invalid", strict=strict)


@pytest.mark.parametrize("bucket", [True, 0.0, "0", None])
def test_rule_7_lora_bucket_is_an_integer(bucket: Any) -> None:
    refused("declaration.lora_bucket_invalid", lora_bucket=bucket)


@pytest.mark.parametrize("lv", ["xyz", LV.upper(), None])
def test_rule_8_literal_values_is_empty_or_hex32(lv: Any) -> None:
    refused("declaration.literal_values_invalid", literal_values=lv)


def test_rule_8_literal_values_must_agree_with_the_graph() -> None:
    refused("declaration.literal_values_mismatch", literal_values=LV)
    refused("declaration.literal_values_mismatch", graph=graph(literal_values=LV))
    refused("declaration.literal_values_mismatch", graph=graph(literal_values=LV[::-1]), literal_values=LV)
    d = declare(graph=graph(constant_fqns=["table"], literal_values=LV), literal_values=LV)
    assert d.class_hash == "9fc76cf20c7d04ce"


def test_rule_9_single_device_placement_is_refused() -> None:
    e = refused("declaration.placement_single", placement=["cuda:0", "", None, "cuda:0"])
    assert str(e) == "single-device placement must be omitted"


def test_rule_9_placement_is_canonicalised() -> None:
    d = declare(placement=["cuda:1", "", "cuda:0", "cuda:1", 0])
    assert d.placement == ("cuda:0", "cuda:1")
    assert "placement" in d.facts()
    assert "placement" not in declare().facts()


def ingress_graph(ingress: Any) -> dict[str, Any]:
    return graph(pytree={"in": "leaf", "out": "leaf", "ingress": ingress})


def test_rule_10_ingress_must_be_valid() -> None:
    ingress = load_contract("call_ingress_v1.json")["ingress"]
    for broken in (
        {**ingress, "flat_arity": 0},
        {**ingress, "v": 2},
        {**ingress, "extra": 1},
        {**ingress, "symbols": {"S0": [1, 8]}},
        {**ingress, "excluded_inputs": ["value"]},
        {**ingress, "inputs": [{**ingress["inputs"][0], "exported_name": "other"}]},
        {**ingress, "inputs": [{**ingress["inputs"][0], "position": 1}]},
    ):
        refused("declaration.ingress_invalid", graph=ingress_graph(broken))


def test_rule_10_range_digest_must_restate_the_ingress() -> None:
    ingress = load_contract("call_ingress_v1.json")["ingress"]
    refused("declaration.ingress_mismatch", graph=ingress_graph(ingress))
    declare(graph=ingress_graph(ingress), range_digest="b389f4904367ba113ba552b7076fc2ff")


def test_toolchain_block_refusals() -> None:
    from torch_compiled_graphs.identity import toolchain_axis_digest

    for block in ({}, {"torch": " x"}, {"": "x"}, {"torch": ""}):
        with pytest.raises(DeclarationError) as e:
            toolchain_axis_digest(block)
        assert e.value.code == "declaration.toolchain_invalid"


def test_declarations_are_immutable_and_compare_by_canonical_fields() -> None:
    a = declare()
    with pytest.raises(AttributeError):
        a.target = "x"  # type: ignore[misc]
    assert a == declare(graph_class="denoiser/h=64,w=64 ")
    assert a != declare(graph_class="other")
    assert a.class_hash == declare(graph_class="other").class_hash
    g = a.graph
    g["v"] = 4
    assert a.graph["v"] == 3
