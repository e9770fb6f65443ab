//! One refusal per declaration rule of SPEC-v1 §3.6, each pinned by its code.

use tcg_cj::{Map, Value};
use tcg_core::identity::{DeclarationInput, GraphClassDeclaration};
use tcg_core::{Code, Kind};

fn graph() -> Map {
    let mut pytree = Map::new();
    pytree.insert("in".into(), "leaf".into());
    pytree.insert("out".into(), "leaf".into());
    let mut g = Map::new();
    g.insert("v".into(), Value::Int(3));
    g.insert("constant_fqns".into(), Value::Array(vec![]));
    g.insert("lifted_inputs".into(), Value::Array(vec![]));
    g.insert("pytree".into(), Value::Object(pytree));
    g.insert("specialization".into(), Value::Object(Map::new()));
    g
}

fn base() -> DeclarationInput {
    DeclarationInput {
        graph_class: "denoiser/h=64,w=64".into(),
        target: "unet".into(),
        graph: Value::Object(graph()),
        graph_witness: "fedcba9876543210".into(),
        range_digest: "0123456789abcdef0123456789abcdef".into(),
        ..DeclarationInput::default()
    }
}

fn refused(input: DeclarationInput) -> Code {
    let err = GraphClassDeclaration::new(input).unwrap_err();
    assert_eq!(err.kind(), Kind::Declaration, "{err}");
    err.code()
}

fn with_graph(f: impl FnOnce(&mut Map)) -> DeclarationInput {
    let mut g = graph();
    f(&mut g);
    DeclarationInput {
        graph: Value::Object(g),
        ..base()
    }
}

fn pair(name: &str, v: Value) -> Value {
    Value::Array(vec![name.into(), v])
}

#[test]
fn base_declaration_is_accepted_and_names_are_trimmed() {
    let d = GraphClassDeclaration::new(DeclarationInput {
        graph_class: "\u{1c} denoiser/h=64,w=64 \u{3000}".into(),
        target: " unet\t".into(),
        ..base()
    })
    .unwrap();
    assert_eq!(d.name(), "denoiser/h=64,w=64");
    assert_eq!(d.target(), "unet");
    assert_eq!(d.class_hash(), "b2de22c15285fe2d");
}

#[test]
fn rule_1_name_must_be_a_safe_relative_path() {
    for bad in [
        "", "  ", "a\\b", "/a", "a/", "a//b", "a/./b", "a/../b", ".", "..",
    ] {
        assert_eq!(
            refused(DeclarationInput {
                graph_class: bad.into(),
                ..base()
            }),
            Code::DeclarationNameInvalid,
            "{bad:?}"
        );
    }
    assert_eq!(
        refused(DeclarationInput {
            graph_class: Value::Int(1),
            ..base()
        }),
        Code::DeclarationNameInvalid
    );
}

#[test]
fn rule_1_target_must_be_non_empty() {
    assert_eq!(
        refused(DeclarationInput {
            target: " \u{85}".into(),
            ..base()
        }),
        Code::DeclarationTargetInvalid
    );
}

#[test]
fn rule_2_graph_must_be_a_non_empty_canonical_object() {
    assert_eq!(
        refused(DeclarationInput {
            graph: Value::Object(Map::new()),
            ..base()
        }),
        Code::DeclarationGraphInvalid
    );
    assert_eq!(
        refused(DeclarationInput {
            graph: Value::Array(vec![]),
            ..base()
        }),
        Code::DeclarationGraphInvalid
    );
    let nan = with_graph(|g| {
        g.insert(
            "specialization".into(),
            Value::Object(
                [("x".to_string(), Value::Float(f64::NAN))]
                    .into_iter()
                    .collect(),
            ),
        );
    });
    assert_eq!(refused(nan), Code::DeclarationGraphInvalid);
}

#[test]
fn rule_3_graph_key_set_version_lists_and_objects() {
    assert_eq!(
        refused(with_graph(|g| {
            g.insert("extra".into(), Value::Null);
        })),
        Code::DeclarationGraphKeys
    );
    assert_eq!(
        refused(with_graph(|g| {
            g.remove("pytree");
        })),
        Code::DeclarationGraphKeys
    );
    assert_eq!(
        refused(with_graph(|g| {
            g.insert("v".into(), Value::Float(3.0));
        })),
        Code::DeclarationGraphVersion
    );
    assert_eq!(
        refused(with_graph(|g| {
            g.insert("v".into(), Value::Int(2));
        })),
        Code::DeclarationGraphVersion
    );
    for bad in [vec!["b", "a"], vec!["a", "a"], vec![""]] {
        let list = Value::Array(bad.iter().map(|s| Value::from(*s)).collect());
        assert_eq!(
            refused(with_graph(|g| {
                g.insert("constant_fqns".into(), list.clone());
            })),
            Code::DeclarationGraphList
        );
        assert_eq!(
            refused(with_graph(|g| {
                g.insert("lifted_inputs".into(), list.clone());
            })),
            Code::DeclarationGraphList
        );
    }
    assert_eq!(
        refused(with_graph(|g| {
            g.insert("pytree".into(), "leaf".into());
        })),
        Code::DeclarationGraphObject
    );
    assert_eq!(
        refused(with_graph(|g| {
            g.insert("specialization".into(), Value::Array(vec![]));
        })),
        Code::DeclarationGraphObject
    );
}

#[test]
fn rule_4_witness_and_range_digest_are_lowercase_hex() {
    assert_eq!(
        refused(DeclarationInput {
            graph_witness: "FEDCBA9876543210".into(),
            ..base()
        }),
        Code::DeclarationWitnessInvalid
    );
    assert_eq!(
        refused(DeclarationInput {
            graph_witness: "fedcba987654321".into(),
            ..base()
        }),
        Code::DeclarationWitnessInvalid
    );
    assert_eq!(
        refused(DeclarationInput {
            range_digest: "0123".into(),
            ..base()
        }),
        Code::DeclarationRangeDigestInvalid
    );
}

#[test]
fn rule_5_fork_pairs_are_canonical_and_sorted_with_equal_names_tolerated() {
    let ok = Value::Array(vec![
        pair("a", Value::Bool(false)),
        pair("a", Value::Int(1)),
        pair("b", Value::Null),
    ]);
    GraphClassDeclaration::new(DeclarationInput { fork: ok, ..base() }).unwrap();
    for bad in [
        Value::Array(vec![pair("b", Value::Null), pair("a", Value::Null)]),
        Value::Array(vec![pair(" a", Value::Null)]),
        Value::Array(vec![Value::Array(vec!["a".into()])]),
        Value::Array(vec![pair("a", Value::Float(f64::INFINITY))]),
        Value::Str("a".into()),
    ] {
        assert_eq!(
            refused(DeclarationInput {
                fork: bad,
                ..base()
            }),
            Code::DeclarationForkInvalid
        );
    }
}

#[test]
fn rule_6_class_dims_are_named_integers() {
    for bad in [
        Value::Array(vec![pair("h", Value::Float(64.0))]),
        Value::Array(vec![pair("h", Value::Bool(true))]),
        Value::Array(vec![pair("w", Value::Int(1)), pair("h", Value::Int(1))]),
    ] {
        assert_eq!(
            refused(DeclarationInput {
                class_dims: bad,
                ..base()
            }),
            Code::DeclarationClassDimsInvalid
        );
    }
}

#[test]
fn rule_7_strict_is_boolean_and_lora_bucket_integer() {
    assert_eq!(
        refused(DeclarationInput {
            strict: Value::Int(1),
            ..base()
        }),
        Code::DeclarationStrictInvalid
    );
    assert_eq!(
        refused(DeclarationInput {
            lora_bucket: Value::Bool(false),
            ..base()
        }),
        Code::DeclarationLoraBucketInvalid
    );
    assert_eq!(
        refused(DeclarationInput {
            lora_bucket: Value::Float(0.0),
            ..base()
        }),
        Code::DeclarationLoraBucketInvalid
    );
}

#[test]
fn rule_8_literal_values_shape_and_agreement() {
    let lv = "f0bf7306bf0a83cc13766d1b8f990c00";
    assert_eq!(
        refused(DeclarationInput {
            literal_values: "xyz".into(),
            ..base()
        }),
        Code::DeclarationLiteralValuesInvalid
    );
    assert_eq!(
        refused(DeclarationInput {
            literal_values: lv.into(),
            ..base()
        }),
        Code::DeclarationLiteralValuesMismatch
    );
    let mut stated = with_graph(|g| {
        g.insert("literal_values".into(), lv.into());
    });
    assert_eq!(
        refused(stated.clone()),
        Code::DeclarationLiteralValuesMismatch
    );
    stated.literal_values = lv.into();
    GraphClassDeclaration::new(stated).unwrap();
}

#[test]
fn rule_9_single_device_placement_is_refused_and_duplicates_collapse() {
    let err = GraphClassDeclaration::new(DeclarationInput {
        placement: vec!["cuda:0".into(), "".into(), "cuda:0".into()],
        ..base()
    })
    .unwrap_err();
    assert_eq!(err.code(), Code::DeclarationPlacementSingle);
    assert_eq!(err.message(), "single-device placement must be omitted");
    let d = GraphClassDeclaration::new(DeclarationInput {
        placement: vec!["cuda:1".into(), "cuda:0".into(), "cuda:1".into()],
        ..base()
    })
    .unwrap();
    assert_eq!(d.placement(), ["cuda:0", "cuda:1"]);
}

#[test]
fn rule_10_ingress_must_validate_and_restate_the_range_digest() {
    let c = tcg_cj::parse_strict(
        &std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../testdata/contracts/call_ingress_v1.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let ingress = c.as_object().unwrap()["ingress"].clone();
    let put = |ing: Value| {
        with_graph(|g| {
            let mut p = g["pytree"].as_object().unwrap().clone();
            p.insert("ingress".into(), ing);
            g.insert("pytree".into(), Value::Object(p));
        })
    };
    assert_eq!(
        refused(put(ingress.clone())),
        Code::DeclarationIngressMismatch
    );
    let mut ok = put(ingress.clone());
    ok.range_digest = "b389f4904367ba113ba552b7076fc2ff".into();
    GraphClassDeclaration::new(ok).unwrap();
    let mut broken = ingress.as_object().unwrap().clone();
    broken.insert("flat_arity".into(), Value::Int(0));
    assert_eq!(
        refused(put(Value::Object(broken))),
        Code::DeclarationIngressInvalid
    );
}

#[test]
fn renaming_keeps_the_class_hash_and_retargeting_changes_it() {
    let a = GraphClassDeclaration::new(base()).unwrap();
    let b = GraphClassDeclaration::new(DeclarationInput {
        graph_class: "other/name".into(),
        ..base()
    })
    .unwrap();
    let c = GraphClassDeclaration::new(DeclarationInput {
        target: "vae".into(),
        ..base()
    })
    .unwrap();
    assert_eq!(a.class_hash(), b.class_hash());
    assert_ne!(a, b);
    assert_ne!(a.class_hash(), c.class_hash());
}
