//! Every vector of every contract file of testdata/contracts, and the further
//! vectors of SPEC-v1 collected in testdata/spec_vectors.json, reproduced
//! from Rust. The Python suite reproduces the same files through the bindings.

use std::collections::BTreeMap;
use std::path::PathBuf;

use sha2::{Digest, Sha256};
use tcg_cj::{parse_strict, to_canonical_string, Map, Value};
use tcg_core::identity::{
    derive_key, derive_key_from_axes, graph_witness, ingress_digest, is_compiled_graph_key,
    literal_digest, toolchain_axis, validate_toolchain_block, DeclarationInput,
    GraphClassDeclaration, LiteralRow,
};
use tcg_core::Code;

fn testdata(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata")
        .join(name)
}

fn read(name: &str) -> Vec<u8> {
    std::fs::read(testdata(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn json(name: &str) -> Value {
    parse_strict(&read(name)).unwrap()
}

fn spec() -> Value {
    json("spec_vectors.json")
}

fn obj(v: &Value) -> &Map {
    v.as_object().unwrap()
}

fn s(v: &Value) -> &str {
    v.as_str().unwrap()
}

fn block(v: &Value) -> BTreeMap<String, String> {
    validate_toolchain_block(v, Code::DeclarationToolchainInvalid).unwrap()
}

fn declaration_from_block(b: &Map, strict: Value, lora_bucket: Value) -> GraphClassDeclaration {
    GraphClassDeclaration::new(DeclarationInput {
        graph_class: "contract/class".into(),
        target: b["target"].clone(),
        graph: b["graph"].clone(),
        graph_witness: b["graph_witness"].clone(),
        range_digest: b["range_digest"].clone(),
        fork: b["fork"].clone(),
        class_dims: b["class_dims"].clone(),
        strict,
        lora_bucket,
        literal_values: "".into(),
        placement: b["placement"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| s(p).to_string())
            .collect(),
    })
    .unwrap()
}

#[test]
fn contract_files_are_pinned_by_sha256() {
    let spec = spec();
    let pins = obj(&obj(&spec)["contract_sha256"]);
    assert_eq!(pins.len(), 7);
    for (name, digest) in pins {
        let bytes = read(&format!("contracts/{name}"));
        assert_eq!(
            hex::encode(Sha256::digest(&bytes)),
            s(digest),
            "{name} changed"
        );
        let shipped = std::fs::read(
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../python/torch_compiled_graphs/contracts")
                .join(name),
        )
        .unwrap();
        assert_eq!(
            shipped, bytes,
            "the packaged copy of {name} differs from testdata"
        );
    }
}

#[test]
fn key_grammar_digest_matches_the_corpus() {
    let text = String::from_utf8(read("contracts/KEY_GRAMMAR_DIGEST")).unwrap();
    let last = text
        .lines()
        .rfind(|l| !l.starts_with('#') && !l.trim().is_empty())
        .unwrap();
    let corpus = read("contracts/compiled_graph_key_vectors.json");
    assert_eq!(hex::encode(Sha256::digest(&corpus)), last.trim());
    assert_eq!(
        last.trim(),
        "a274c5702b8c167ca119758d9fb1f98c40ddfdb3dbf6c58b4aacd580803e8c2b"
    );
}

#[test]
fn key_grammar_vectors_all_26() {
    let corpus = json("contracts/compiled_graph_key_vectors.json");
    let vectors = obj(&corpus)["vectors"].as_array().unwrap();
    assert_eq!(vectors.len(), 26);
    let mut valid = 0;
    for v in vectors {
        let v = obj(v);
        let key = s(&v["key"]);
        let want = v["valid"].as_bool().unwrap();
        assert_eq!(
            is_compiled_graph_key(key),
            want,
            "{key:?}: {}",
            s(&v["note"])
        );
        valid += usize::from(want);
    }
    assert_eq!(valid, 9);
}

#[test]
fn toolchain_contract_folds_and_derives_its_key() {
    let c = json("contracts/toolchain_identity_v1.json");
    let c = obj(&c);
    let b = block(&c["block"]);
    let axis = toolchain_axis(&b);
    assert_eq!(axis, s(&c["toolchain_axis"]));
    assert_eq!(axis, "88abf09ce9c69ecb");
    assert_eq!(
        derive_key(s(&c["graph"]), s(&c["sm"]), &axis).unwrap(),
        s(&c["key"])
    );
    for excluded in ["diffusers", "peft", "transformers"] {
        let mut changed = b.clone();
        changed.insert(excluded.to_string(), "another value".to_string());
        assert_eq!(
            toolchain_axis(&changed),
            axis,
            "{excluded} entered the axis"
        );
    }
    let mut changed = b.clone();
    changed.insert("torch".to_string(), "3333333333333334".to_string());
    assert_ne!(toolchain_axis(&changed), axis);
}

#[test]
fn graph_class_identity_v3_folds_to_its_class_hash() {
    for (file, want) in [
        ("contracts/graph_class_identity_v3.json", "c59210f4ddf6b420"),
        (
            "contracts/graph_class_identity_v3_with_ingress.json",
            "16509ab34e95cfc7",
        ),
    ] {
        let c = json(file);
        let c = obj(&c);
        let decl = declaration_from_block(
            obj(&c["block"]),
            c["strict"].clone(),
            c["lora_bucket"].clone(),
        );
        assert_eq!(decl.class_hash(), s(&c["class_hash"]), "{file}");
        assert_eq!(decl.class_hash(), want);
        assert_eq!(decl.placement(), ["cuda:0", "cuda:1"]);
    }
}

#[test]
fn call_ingress_contract_digest() {
    let c = json("contracts/call_ingress_v1.json");
    let c = obj(&c);
    assert_eq!(ingress_digest(&c["ingress"]).unwrap(), s(&c["digest"]));
    assert_eq!(s(&c["digest"]), "b389f4904367ba113ba552b7076fc2ff");
}

#[test]
fn literal_contract_digest() {
    let c = json("contracts/literal_identity_v1.json");
    let c = obj(&c);
    let mut bytes = Vec::new();
    for row in c["values"].as_array().unwrap() {
        for x in row.as_array().unwrap() {
            let f = match x {
                Value::Float(f) => *f as f32,
                other => panic!("{other:?}"),
            };
            bytes.extend_from_slice(&f.to_le_bytes());
        }
    }
    let shape: Vec<u64> = c["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_i64().unwrap() as u64)
        .collect();
    let row = LiteralRow {
        name: s(&c["name"]).into(),
        dtype: s(&c["dtype"]).into(),
        shape,
        bytes,
    };
    assert_eq!(literal_digest(&[row]).unwrap(), s(&c["literal_values"]));
}

#[test]
fn canonical_json_probe_and_float_table() {
    let spec = spec();
    let probe = obj(&obj(&spec)["cj_probe"]);
    let cj = to_canonical_string(&probe["value"]).unwrap();
    assert_eq!(cj, s(&probe["cj"]));
    assert_eq!(
        hex::encode(Sha256::digest(cj.as_bytes())),
        s(&probe["sha256"])
    );
    for pair in obj(&spec)["float_table"].as_array().unwrap() {
        let pair = pair.as_array().unwrap();
        let x: f64 = s(&pair[0]).parse().unwrap();
        assert_eq!(to_canonical_string(&Value::Float(x)).unwrap(), s(&pair[1]));
    }
    let ints = obj(&obj(&spec)["integer_table"]);
    for i in ints["accepted"].as_array().unwrap() {
        assert_eq!(
            to_canonical_string(i).unwrap(),
            i.as_i64().unwrap().to_string()
        );
    }
    for text in ints["refused_text"].as_array().unwrap() {
        assert!(parse_strict(s(text).as_bytes()).is_err());
    }
}

#[test]
fn axes_vector_and_declaration_vectors() {
    let spec = spec();
    let axes = obj(&obj(&spec)["axes"]);
    assert_eq!(
        derive_key_from_axes(obj(&axes["axes"])).unwrap(),
        s(&axes["key"])
    );
    for case in obj(&spec)["declarations"].as_array().unwrap() {
        let case = obj(case);
        let d = obj(&case["declaration"]);
        let decl = GraphClassDeclaration::new(DeclarationInput {
            graph_class: d["graph_class"].clone(),
            target: d["target"].clone(),
            graph: d["graph"].clone(),
            graph_witness: d["graph_witness"].clone(),
            range_digest: d["range_digest"].clone(),
            fork: d["fork"].clone(),
            class_dims: d["class_dims"].clone(),
            strict: d["strict"].clone(),
            lora_bucket: d["lora_bucket"].clone(),
            literal_values: d["literal_values"].clone(),
            placement: vec![],
        })
        .unwrap();
        assert_eq!(
            decl.class_hash(),
            s(&case["class_hash"]),
            "{}",
            s(&case["what"])
        );
        let axis = toolchain_axis(&block(&case["toolchain"]));
        assert_eq!(axis, s(&case["toolchain_axis"]));
        assert_eq!(
            derive_key(decl.class_hash(), s(&case["sm"]), &axis).unwrap(),
            s(&case["key"])
        );
    }
}

#[test]
fn sine_witness_lines_hash_to_the_contract_witness() {
    let spec = spec();
    let w = obj(&obj(&spec)["witness"]);
    let lines: Vec<&str> = w["lines"].as_array().unwrap().iter().map(s).collect();
    assert_eq!(lines.len(), 6);
    assert_eq!(graph_witness(&lines), s(&w["witness"]));
}
