"""Every vector of every contract corpus, reproduced through the Python bindings.

The Rust suite (crates/tcg-core/tests/identity_contracts.rs) reproduces the
same files from the core.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import pytest

from torch_compiled_graphs import CompiledGraphKey, GraphClassDeclaration, is_compiled_graph_key
from torch_compiled_graphs.contracts import CONTRACT_NAMES, load_contract, read_contract
from torch_compiled_graphs.identity import (
    canonical_json,
    graph_witness,
    ingress_digest,
    literal_digest,
    toolchain_axis_digest,
)

from .conftest import TESTDATA


def test_shipped_contracts_are_byte_identical_to_testdata_and_pinned(spec_vectors: dict[str, Any]) -> None:
    pins = spec_vectors["contract_sha256"]
    assert sorted(pins) == sorted(CONTRACT_NAMES)
    for name in CONTRACT_NAMES:
        shipped = read_contract(name)
        assert shipped == (TESTDATA / "contracts" / name).read_bytes()
        assert hashlib.sha256(shipped).hexdigest() == pins[name]


def test_read_contract_refuses_unknown_names() -> None:
    for bad in ["nope.json", "../pyproject.toml", "__init__.py", ""]:
        with pytest.raises(ValueError, match="unknown contract"):
            read_contract(bad)


def test_key_grammar_digest_matches_the_shipped_corpus() -> None:
    lines = [
        line
        for line in read_contract("KEY_GRAMMAR_DIGEST").decode().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    corpus = read_contract("compiled_graph_key_vectors.json")
    assert hashlib.sha256(corpus).hexdigest() == lines[-1].strip()
    assert lines[-1].strip() == "a274c5702b8c167ca119758d9fb1f98c40ddfdb3dbf6c58b4aacd580803e8c2b"


def test_key_grammar_vectors_all_26() -> None:
    vectors = load_contract("compiled_graph_key_vectors.json")["vectors"]
    assert len(vectors) == 26
    assert sum(v["valid"] for v in vectors) == 9
    for v in vectors:
        assert is_compiled_graph_key(v["key"]) is v["valid"], v["note"]


def test_key_grammar_needs_a_real_str() -> None:
    key = "cg-key-v1-7692c3ad3540bb803c020b3aee66cd8887123234ea0c6e7143c0add7"

    class Stringy:
        def __str__(self) -> str:
            return key

    assert not is_compiled_graph_key(Stringy())
    assert not is_compiled_graph_key(key.encode())
    assert not is_compiled_graph_key(key + "\n")
    assert not is_compiled_graph_key(None)


def test_toolchain_contract_folds_and_derives_its_key() -> None:
    c = load_contract("toolchain_identity_v1.json")
    axis = toolchain_axis_digest(c["block"])
    assert axis == c["toolchain_axis"] == "88abf09ce9c69ecb"
    key = CompiledGraphKey(c["graph"], c["sm"], axis)
    assert key == c["key"]
    assert key.axes == {"graph": c["graph"], "sm": c["sm"], "toolchain": axis}
    for excluded in ("diffusers", "peft", "transformers"):
        assert toolchain_axis_digest({**c["block"], excluded: "another"}) == axis


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("graph_class_identity_v3.json", "c59210f4ddf6b420"),
        ("graph_class_identity_v3_with_ingress.json", "16509ab34e95cfc7"),
    ],
)
def test_graph_class_contracts_fold_to_their_class_hash(name: str, want: str) -> None:
    c = load_contract(name)
    b = c["block"]
    decl = GraphClassDeclaration(
        "contract/class",
        b["target"],
        b["graph"],
        b["graph_witness"],
        b["range_digest"],
        fork=b["fork"],
        class_dims=b["class_dims"],
        strict=c["strict"],
        lora_bucket=c["lora_bucket"],
        placement=b["placement"],
    )
    assert decl.class_hash == c["class_hash"] == want
    assert decl.placement == ("cuda:0", "cuda:1")


def test_call_ingress_contract_digest() -> None:
    c = load_contract("call_ingress_v1.json")
    assert ingress_digest(c["ingress"]) == c["digest"] == "b389f4904367ba113ba552b7076fc2ff"


def test_literal_contract_digest() -> None:
    c = load_contract("literal_identity_v1.json")
    raw = struct.pack("<4f", *[x for row in c["values"] for x in row])
    assert literal_digest([(c["name"], c["dtype"], c["shape"], raw)]) == c["literal_values"]
    assert literal_digest([]) == ""


def test_canonical_json_probe_and_float_table(spec_vectors: dict[str, Any]) -> None:
    probe = spec_vectors["cj_probe"]
    assert canonical_json(probe["value"]) == probe["cj"].encode()
    assert hashlib.sha256(canonical_json(probe["value"])).hexdigest() == probe["sha256"]
    for text, want in spec_vectors["float_table"]:
        assert canonical_json(float(text)) == want.encode()
    for i in spec_vectors["integer_table"]["accepted"]:
        assert canonical_json(i) == str(i).encode()


def test_axes_vector_and_declaration_vectors(spec_vectors: dict[str, Any]) -> None:
    axes = spec_vectors["axes"]
    assert CompiledGraphKey.derive(axes["axes"]) == axes["key"]
    for case in spec_vectors["declarations"]:
        d = case["declaration"]
        decl = GraphClassDeclaration(
            d["graph_class"],
            d["target"],
            d["graph"],
            d["graph_witness"],
            d["range_digest"],
            fork=d["fork"],
            class_dims=d["class_dims"],
            strict=d["strict"],
            lora_bucket=d["lora_bucket"],
            literal_values=d["literal_values"],
        )
        assert decl.class_hash == case["class_hash"], case["what"]
        assert toolchain_axis_digest(case["toolchain"]) == case["toolchain_axis"]
        assert decl.key(sm=case["sm"], toolchain=case["toolchain"]) == case["key"], case["what"]


def test_sine_witness_lines(spec_vectors: dict[str, Any]) -> None:
    w = spec_vectors["witness"]
    assert graph_witness(w["lines"]) == w["witness"] == "54ceeee7225e57c9"


def test_key_from_metadata_restates_the_reference_fixture() -> None:
    import json
    import tarfile

    with tarfile.open(TESTDATA.parent / "testdata" / "reference-0.2.0" / "mlp-cpu.tar.gz") as tar:
        member = tar.extractfile("metadata.json")
        assert member is not None
        metadata = json.loads(member.read())
    key = CompiledGraphKey.from_metadata(metadata)
    assert key == metadata["compiled_graph_key"]
    assert key.sm == "cpu-avx512"


def test_split_key_takes_the_suffix_and_refuses_non_keys() -> None:
    from torch_compiled_graphs import IdentityError
    from torch_compiled_graphs.identity import split_key

    scheme, digest = split_key(
        "cg-key-v1-7692c3ad3540bb803c02-7692c3ad3540bb803c020b3aee66cd8887123234ea0c6e7143c0add7"
    )
    assert scheme == "cg-key-v1-7692c3ad3540bb803c02"
    assert digest == "7692c3ad3540bb803c020b3aee66cd8887123234ea0c6e7143c0add7"
    for bad in [*vectors_invalid(), None, 7]:
        with pytest.raises(IdentityError) as e:
            split_key(bad)
        assert e.value.code == "identity.key_invalid"


def vectors_invalid() -> list[object]:
    return [v["key"] for v in load_contract("compiled_graph_key_vectors.json")["vectors"] if not v["valid"]]
