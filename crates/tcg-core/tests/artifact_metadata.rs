//! metadata.json (SPEC-v1 §7): the §7.6 examples byte for byte, the CPU
//! deviation key of §4.2, and every refusal of §7.5 with its code.

use tcg_cj::{Map, Value};
use tcg_core::artifact::metadata::{
    build_metadata, format_of, validate_metadata, ConstantRow, ConstantSource,
};
use tcg_core::host_isa::HostIsa;
use tcg_core::identity::{DeclarationInput, GraphClassDeclaration};
use tcg_core::Code;

const EXAMPLE: &str = r#"{"compiled_graph_format":1,"compiled_graph_key":"cg-key-v1-45847d8ae3d3bd0ca0d672cb5abe5776c73fe407593e03fc105985ad","constant_folding_fenced":true,"graph_class":{"class_dims":[],"class_hash":"b2de22c15285fe2d","constants":[],"fork":[],"graph":{"constant_fqns":[],"lifted_inputs":[],"pytree":{"in":"leaf","out":"leaf"},"specialization":{},"v":3},"graph_witness":"fedcba9876543210","literal_values":"","lora_bucket":0,"name":"denoiser/h=64,w=64","placement":[],"range_digest":"0123456789abcdef0123456789abcdef","strict":true,"target":"unet"},"host_isa":{"cpp_march":"x86-64-v3","cpp_simdlen":"256","host_isa_features":"abm,avx,avx2,bmi1,bmi2,cx16,f16c,fma,lahf_lm,movbe,popcnt,sse4_1,sse4_2,ssse3,xsave","host_isa_level":"x86-64-v3","machine":"x86_64"},"kind":"aot-inductor","package_constants_in_so":false,"sm":"sm_89","toolchain":{"torch":"record-digest","triton":"compiler-digest"}}"#;

const LITERAL: &str = "f0bf7306bf0a83cc13766d1b8f990c00";

fn obj(v: &Value) -> Map {
    v.as_object().unwrap().clone()
}

fn parse(s: &str) -> Value {
    tcg_cj::parse_strict(s.as_bytes()).unwrap()
}

fn host_v3() -> HostIsa {
    HostIsa::from_value(
        &obj(&parse(EXAMPLE))["host_isa"],
        Code::ArtifactHostIsaInvalid,
    )
    .unwrap()
}

fn declaration(literal: bool) -> GraphClassDeclaration {
    let mut graph = obj(&parse(
        r#"{"constant_fqns":[],"lifted_inputs":[],"pytree":{"in":"leaf","out":"leaf"},"specialization":{},"v":3}"#,
    ));
    if literal {
        graph.insert("constant_fqns".into(), Value::Array(vec!["table".into()]));
        graph.insert("literal_values".into(), LITERAL.into());
    }
    GraphClassDeclaration::new(DeclarationInput {
        graph_class: "denoiser/h=64,w=64".into(),
        target: "unet".into(),
        graph: Value::Object(graph),
        graph_witness: "fedcba9876543210".into(),
        range_digest: "0123456789abcdef0123456789abcdef".into(),
        literal_values: if literal { LITERAL.into() } else { "".into() },
        ..DeclarationInput::default()
    })
    .unwrap()
}

fn toolchain() -> Value {
    parse(r#"{"torch":"record-digest","triton":"compiler-digest"}"#)
}

fn table_row() -> ConstantRow {
    ConstantRow {
        fqn: "table".into(),
        source: ConstantSource::Literal,
        dtype: "float32".into(),
        shape: vec![2, 2],
    }
}

#[test]
fn build_metadata_pins_the_canonical_example_byte_for_byte() {
    let md = build_metadata(&declaration(false), &[], "sm_89", &toolchain(), &host_v3()).unwrap();
    assert_eq!(md.bytes().len(), 884);
    assert_eq!(std::str::from_utf8(md.bytes()).unwrap(), EXAMPLE);
    assert_eq!(md.declaration().class_hash(), "b2de22c15285fe2d");
    assert_eq!(
        md.key(),
        "cg-key-v1-45847d8ae3d3bd0ca0d672cb5abe5776c73fe407593e03fc105985ad"
    );
    let again = validate_metadata(EXAMPLE.as_bytes(), Some(false)).unwrap();
    assert_eq!(again.bytes(), md.bytes());
}

#[test]
fn build_metadata_pins_the_literal_example() {
    let md = build_metadata(
        &declaration(true),
        &[table_row()],
        "sm_89",
        &toolchain(),
        &host_v3(),
    )
    .unwrap();
    assert_eq!(md.declaration().class_hash(), "9fc76cf20c7d04ce");
    assert_eq!(
        md.key(),
        "cg-key-v1-1370b308727fdcf52eaaea60b9195c6a4a9e2fbf05addc6588ced3f5"
    );
    let gc = obj(&md.value()["graph_class"]);
    assert_eq!(gc["literal_values"], Value::from(LITERAL));
    let constants = tcg_cj::to_canonical_string(&gc["constants"]).unwrap();
    assert_eq!(
        constants,
        r#"[{"dtype":"float32","fqn":"table","shape":[2,2],"source":"literal"}]"#
    );
    assert!(md.has_literal_rows());
    validate_metadata(md.bytes(), Some(true)).unwrap();
    let err = validate_metadata(md.bytes(), Some(false)).unwrap_err();
    assert_eq!(err.code(), Code::ArtifactLiteralsMismatch);
    assert!(err
        .message()
        .contains("declares literal constants but carries no literal payload"));
}

#[test]
fn the_cpu_deviation_key_is_pinned() {
    let md = build_metadata(
        &declaration(false),
        &[],
        "cpu-x86-64-v3",
        &toolchain(),
        &host_v3(),
    )
    .unwrap();
    assert_eq!(
        md.key(),
        "cg-key-v1-9bddd930db3d7228936204264ecc99855461bd02a4815f483fb86e36"
    );
}

fn code_of_bytes(b: &[u8]) -> Code {
    validate_metadata(b, None).unwrap_err().code()
}

fn code_of(v: &Map) -> Code {
    code_of_bytes(&tcg_cj::to_canonical(&Value::Object(v.clone())).unwrap())
}

fn example() -> Map {
    obj(&parse(EXAMPLE))
}

fn with_gc(f: impl FnOnce(&mut Map)) -> Map {
    let mut m = example();
    let mut gc = obj(&m["graph_class"]);
    f(&mut gc);
    m.insert("graph_class".into(), Value::Object(gc));
    m
}

fn with_isa(k: &str, v: Value) -> Map {
    let mut m = example();
    let mut isa = obj(&m["host_isa"]);
    isa.insert(k.into(), v);
    m.insert("host_isa".into(), Value::Object(isa));
    m
}

fn set(k: &str, v: Value) -> Map {
    let mut m = example();
    m.insert(k.into(), v);
    m
}

#[test]
fn parse_failures_and_non_canonical_bytes_are_metadata_json() {
    let dup_top = EXAMPLE.replacen(
        r#""kind":"aot-inductor","#,
        r#""kind":"aot-inductor","kind":"aot-inductor","#,
        1,
    );
    assert_eq!(
        code_of_bytes(dup_top.as_bytes()),
        Code::ArtifactMetadataJson
    );
    let dup_nested = EXAMPLE.replacen(r#""in":"leaf","#, r#""in":"leaf","in":"leaf","#, 1);
    assert_eq!(
        code_of_bytes(dup_nested.as_bytes()),
        Code::ArtifactMetadataJson
    );
    let spaced = EXAMPLE.replacen(r#""kind":"#, r#""kind": "#, 1);
    assert_eq!(code_of_bytes(spaced.as_bytes()), Code::ArtifactMetadataJson);
    let newline = format!("{EXAMPLE}\n");
    assert_eq!(
        code_of_bytes(newline.as_bytes()),
        Code::ArtifactMetadataJson
    );
    assert_eq!(code_of_bytes(b"\xff"), Code::ArtifactMetadataJson);
    assert_eq!(code_of_bytes(b""), Code::ArtifactMetadataJson);
}

#[test]
fn another_integer_format_is_unsupported_before_any_other_check() {
    assert_eq!(
        code_of(&set("compiled_graph_format", Value::Int(2))),
        Code::ArtifactFormatUnsupported
    );
    // Even non-canonical bytes with extra members: the format decides first.
    let skewed = r#"{"compiled_graph_format": 2, "entries": []}"#;
    assert_eq!(
        code_of_bytes(skewed.as_bytes()),
        Code::ArtifactFormatUnsupported
    );
    assert_eq!(format_of(skewed.as_bytes()), Some(2));
    assert_eq!(format_of(EXAMPLE.as_bytes()), Some(1));
}

#[test]
fn the_format_must_be_the_integer_one() {
    assert_eq!(
        code_of(&set("compiled_graph_format", Value::Float(1.0))),
        Code::ArtifactMetadataFormat
    );
    assert_eq!(
        code_of(&set("compiled_graph_format", Value::Bool(true))),
        Code::ArtifactMetadataFormat
    );
    assert_eq!(
        code_of(&set("compiled_graph_format", "1".into())),
        Code::ArtifactMetadataFormat
    );
}

#[test]
fn the_top_level_is_closed() {
    assert_eq!(
        code_of(&set("extra", Value::Null)),
        Code::ArtifactMetadataSchema
    );
    let mut m = example();
    m.remove("sm");
    assert_eq!(code_of(&m), Code::ArtifactMetadataSchema);
    let mut retired = example();
    retired.remove("graph_class");
    retired.insert("entries".into(), Value::Array(vec![]));
    assert_eq!(code_of(&retired), Code::ArtifactMetadataSchema);
    assert_eq!(code_of_bytes(b"[]"), Code::ArtifactMetadataSchema);
}

#[test]
fn kind_and_policy_have_their_codes() {
    assert_eq!(
        code_of(&set("kind", "torchscript".into())),
        Code::ArtifactMetadataKind
    );
    assert_eq!(
        code_of(&set("package_constants_in_so", Value::Bool(true))),
        Code::ArtifactMetadataPolicy
    );
    assert_eq!(
        code_of(&set("constant_folding_fenced", Value::Bool(false))),
        Code::ArtifactMetadataPolicy
    );
}

#[test]
fn sm_and_toolchain_are_schema_checked() {
    assert_eq!(code_of(&set("sm", "".into())), Code::ArtifactMetadataSchema);
    assert_eq!(
        code_of(&set("sm", " sm_89".into())),
        Code::ArtifactMetadataSchema
    );
    assert_eq!(
        code_of(&set("sm", Value::Int(89))),
        Code::ArtifactMetadataSchema
    );
    assert_eq!(
        code_of(&set("toolchain", Value::Object(Map::new()))),
        Code::ArtifactMetadataSchema
    );
    assert_eq!(
        code_of(&set("toolchain", parse(r#"{"torch":1}"#))),
        Code::ArtifactMetadataSchema
    );
}

#[test]
fn host_isa_refusals_are_host_isa_invalid() {
    assert_eq!(
        code_of(&with_isa("extra", "x".into())),
        Code::ArtifactHostIsaInvalid
    );
    assert_eq!(
        code_of(&with_isa("cpp_simdlen", Value::Int(256))),
        Code::ArtifactHostIsaInvalid
    );
    assert_eq!(
        code_of(&with_isa("host_isa_level", "x86-64-v4".into())),
        Code::ArtifactHostIsaInvalid
    );
    assert_eq!(
        code_of(&set("host_isa", Value::Object(Map::new()))),
        Code::ArtifactHostIsaInvalid
    );
    assert_eq!(
        code_of(&set("host_isa", Value::Null)),
        Code::ArtifactHostIsaInvalid
    );
}

#[test]
fn graph_class_shape_and_types_are_schema_checked() {
    assert_eq!(
        code_of(&with_gc(|g| {
            g.remove("constants");
        })),
        Code::ArtifactMetadataSchema
    );
    assert_eq!(
        code_of(&with_gc(|g| {
            g.insert("x".into(), Value::Null);
        })),
        Code::ArtifactMetadataSchema
    );
    assert_eq!(
        code_of(&with_gc(|g| {
            g.insert("name".into(), "".into());
        })),
        Code::ArtifactMetadataSchema
    );
    assert_eq!(
        code_of(&with_gc(|g| {
            g.insert("graph".into(), Value::Object(Map::new()));
        })),
        Code::ArtifactMetadataSchema
    );
    assert_eq!(
        code_of(&with_gc(|g| {
            g.insert("literal_values".into(), Value::Null);
        })),
        Code::ArtifactMetadataSchema
    );
    assert_eq!(
        code_of(&with_gc(|g| {
            g.insert("placement".into(), parse(r#"[" a"]"#));
        })),
        Code::ArtifactMetadataSchema
    );
    assert_eq!(
        code_of(&with_gc(|g| {
            g.insert("fork".into(), parse(r#"[[1,2]]"#));
        })),
        Code::ArtifactMetadataSchema
    );
    assert_eq!(
        code_of(&with_gc(|g| {
            g.insert("class_dims".into(), parse(r#"[["h",1.0]]"#));
        })),
        Code::ArtifactMetadataSchema
    );
    assert_eq!(
        code_of(&with_gc(|g| {
            g.insert("strict".into(), Value::Int(1));
        })),
        Code::ArtifactMetadataSchema
    );
    assert_eq!(
        code_of(&with_gc(|g| {
            g.insert("lora_bucket".into(), Value::Bool(false));
        })),
        Code::ArtifactMetadataSchema
    );
}

#[test]
fn declaration_failures_and_non_canonical_forms_are_declaration_invalid() {
    let err = validate_metadata(
        &tcg_cj::to_canonical(&Value::Object(with_gc(|g| {
            g.insert("graph_witness".into(), "XYZ".into());
        })))
        .unwrap(),
        None,
    )
    .unwrap_err();
    assert_eq!(err.code(), Code::ArtifactDeclarationInvalid);
    assert!(err
        .message()
        .starts_with("graph_class declaration is invalid: "));
    assert_eq!(
        code_of(&with_gc(|g| {
            g.insert("name".into(), " denoiser/h=64,w=64".into());
        })),
        Code::ArtifactDeclarationInvalid
    );
    assert_eq!(
        code_of(&with_gc(|g| {
            g.insert("name".into(), "a/../b".into());
        })),
        Code::ArtifactDeclarationInvalid
    );
    assert_eq!(
        code_of(&with_gc(|g| {
            g.insert("placement".into(), parse(r#"["cuda:0"]"#));
        })),
        Code::ArtifactDeclarationInvalid
    );
}

#[test]
fn a_wrong_class_hash_or_key_is_refused() {
    let err = validate_metadata(
        &tcg_cj::to_canonical(&Value::Object(with_gc(|g| {
            g.insert("class_hash".into(), "0000000000000000".into());
        })))
        .unwrap(),
        None,
    )
    .unwrap_err();
    assert_eq!(err.code(), Code::ArtifactClassHashMismatch);
    assert!(err
        .message()
        .contains("class_hash does not restate its declaration facts"));
    // Renaming changes no fact: the class hash and key still hold.
    let renamed = with_gc(|g| {
        g.insert("name".into(), "other".into());
    });
    validate_metadata(
        &tcg_cj::to_canonical(&Value::Object(renamed)).unwrap(),
        None,
    )
    .unwrap();
    let bad_key = "cg-key-v1-00000000000000000000000000000000000000000000000000000000";
    let err = validate_metadata(
        &tcg_cj::to_canonical(&Value::Object(set("compiled_graph_key", bad_key.into()))).unwrap(),
        None,
    )
    .unwrap_err();
    assert_eq!(err.code(), Code::ArtifactKeyMismatch);
    assert!(err
        .message()
        .contains("compiled_graph_key does not restate artifact facts"));
    assert_eq!(
        code_of(&set("compiled_graph_key", "not-a-key".into())),
        Code::ArtifactKeyMismatch
    );
    assert_eq!(
        code_of(&set("sm", "cpu-x86-64-v3".into())),
        Code::ArtifactKeyMismatch
    );
}

#[test]
fn a_key_shaped_sm_is_an_artifact_error() {
    let key_shaped = "sm-aefe4c6d52d304f8ef7cc6f9ffae296113b1546defe761e1c12ac2cf";
    let err = validate_metadata(
        &tcg_cj::to_canonical(&Value::Object(set("sm", key_shaped.into()))).unwrap(),
        None,
    )
    .unwrap_err();
    assert_eq!(err.code(), Code::ArtifactKeyMismatch);
    assert_eq!(err.kind(), tcg_core::Kind::Artifact);
}

#[test]
fn constant_rows_are_checked() {
    let row = |s: &str| Value::Array(vec![parse(s)]);
    let cases = [
        row(r#"{"dtype":"float32","fqn":"w","shape":[1],"source":"state_dict","x":1}"#),
        row(r#"{"dtype":"float32","fqn":"w","shape":[1],"source":"weights"}"#),
        row(r#"{"dtype":"float32","fqn":"","shape":[1],"source":"state_dict"}"#),
        row(r#"{"dtype":"float32","fqn":"w","shape":[-1],"source":"state_dict"}"#),
        row(r#"{"dtype":"float32","fqn":"w","shape":[1.0],"source":"state_dict"}"#),
        Value::Array(vec![
            parse(r#"{"dtype":"float32","fqn":"w","shape":[1],"source":"state_dict"}"#),
            parse(r#"{"dtype":"float32","fqn":"w","shape":[2],"source":"computed"}"#),
        ]),
        // A literal row without literal_values.
        row(r#"{"dtype":"float32","fqn":"t","shape":[1],"source":"literal"}"#),
    ];
    for (i, c) in cases.into_iter().enumerate() {
        assert_eq!(
            code_of(&with_gc(|g| {
                g.insert("constants".into(), c);
            })),
            Code::ArtifactConstantsInvalid,
            "case {i}"
        );
    }
}

#[test]
fn a_payload_without_literal_rows_is_a_literals_mismatch() {
    let err = validate_metadata(EXAMPLE.as_bytes(), Some(true)).unwrap_err();
    assert_eq!(err.code(), Code::ArtifactLiteralsMismatch);
    assert!(err
        .message()
        .contains("carries a literal payload but declares no literals"));
}
