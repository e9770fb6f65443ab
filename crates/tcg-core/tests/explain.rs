//! Explaining a miss: the fact-by-fact diff (identity) and the stored
//! neighbours with their kept canonical lines (engine), on the reference
//! artifact minted by 0.2.0 and declarations derived from it.

mod common;

use common::*;
use tcg_cas::CasOutcome;
use tcg_cj::{Map, Value};
use tcg_core::artifact::read_metadata;
use tcg_core::engine::{graph_ref, witness_lines_ref, Engine};
use tcg_core::identity::{
    compile_policy_title, derive_key, diff_facts, differing_axes, graph_witness, ingress_digest,
    line_diff, toolchain_axis, GraphClassDeclaration, KeyFacts, WitnessLines, COMPILE_POLICIES,
    LINE_DIFF_MAX_LINES, SETTINGS_DECLARATION, WITNESS_LINES_MAX_LINES,
};

fn reference_facts() -> KeyFacts {
    let md = read_metadata(&reference()).unwrap();
    KeyFacts {
        key: md.key().to_string(),
        declaration: md.declaration().clone(),
        sm: md.sm().to_string(),
        toolchain: md.toolchain().clone(),
        lines: None,
    }
}

/// The reference facts with the declaration's graph_class object edited by `edit`.
fn with_graph_class(base: &KeyFacts, edit: impl FnOnce(&mut Map)) -> KeyFacts {
    let mut gc = match base.declaration.to_value() {
        Value::Object(m) => m,
        _ => unreachable!(),
    };
    edit(&mut gc);
    let declaration = GraphClassDeclaration::from_graph_class_value(&gc).unwrap();
    rekey(KeyFacts {
        declaration,
        ..base.clone()
    })
}

fn rekey(mut f: KeyFacts) -> KeyFacts {
    f.key = derive_key(
        f.declaration.class_hash(),
        &f.sm,
        &toolchain_axis(&f.toolchain),
    )
    .unwrap();
    f
}

fn facts_named(f: &KeyFacts, g: &KeyFacts) -> Vec<String> {
    diff_facts(f, g).into_iter().map(|d| d.fact).collect()
}

fn lines(ops: &[&str]) -> Vec<String> {
    let mut out = vec!["v=1 ir=export".to_string()];
    out.extend(
        ops.iter()
            .enumerate()
            .map(|(i, op)| format!("node {i} {op}")),
    );
    out
}

#[test]
fn equal_facts_have_no_difference() {
    let f = reference_facts();
    assert!(diff_facts(&f, &f).is_empty());
    // The display name is not a fact.
    let renamed = with_graph_class(&f, |m| {
        m.insert("name".into(), "model/renamed".into());
    });
    assert_eq!(renamed.key, f.key);
    assert!(diff_facts(&renamed, &f).is_empty());
}

#[test]
fn one_toolchain_member_is_named_with_both_values() {
    let stored = reference_facts();
    let mut requested = stored.clone();
    requested
        .toolchain
        .insert("torch".into(), "ref-2.15.1+cu132".into());
    // An excluded member never enters the axis, so it is never a difference.
    requested.toolchain.insert("diffusers".into(), "y".into());
    let requested = rekey(requested);
    let diffs = diff_facts(&requested, &stored);
    assert_eq!(diffs.len(), 1, "{diffs:?}");
    assert_eq!(diffs[0].axis, "toolchain");
    assert_eq!(diffs[0].fact, "toolchain.torch");
    assert_eq!(diffs[0].requested, Value::from("ref-2.15.1+cu132"));
    assert_eq!(diffs[0].stored, Value::from("ref-2.15.0+cu132"));
    assert_eq!(differing_axes(&diffs), ["toolchain"]);
    // A member only one side has is reported with null on the other.
    let mut added = stored.clone();
    added
        .toolchain
        .insert("cxx".into(), "0011223344556677".into());
    let d = diff_facts(&rekey(added), &stored);
    assert_eq!(d.len(), 1);
    assert_eq!(
        (d[0].fact.as_str(), &d[0].stored),
        ("toolchain.cxx", &Value::Null)
    );
}

/// The CLI's `explain KEY_A KEY_B` text of two facts.
fn pair_text(a: &KeyFacts, b: &KeyFacts) -> String {
    tcg_core::engine::render_pair(&tcg_core::engine::pair_report(a, b))
}

#[test]
fn two_variants_of_one_graph_are_named_by_their_compile_policies() {
    let mut default = reference_facts();
    default
        .toolchain
        .insert(SETTINGS_DECLARATION.into(), COMPILE_POLICIES[0].0.into());
    let default = rekey(default);
    let mut variant = default.clone();
    variant
        .toolchain
        .insert(SETTINGS_DECLARATION.into(), COMPILE_POLICIES[1].0.into());
    let variant = rekey(variant);
    assert_ne!(default.key, variant.key);
    let diffs = diff_facts(&default, &variant);
    assert_eq!(diffs.len(), 1, "{diffs:?}");
    assert_eq!(diffs[0].fact, "toolchain.settings_declaration");
    let mut policies = Map::new();
    policies.insert("requested".into(), "default policy".into());
    policies.insert("stored".into(), "libtorch-free variant shim-v1".into());
    let mut detail = Map::new();
    detail.insert("policies".into(), Value::Object(policies));
    assert_eq!(diffs[0].detail, Some(Value::Object(detail)));
    assert_eq!(compile_policy_title("0123456789abcdef"), None);
    // The text names both policies, not only two digests.
    let pair = pair_text(&default, &variant);
    assert!(
        pair.contains("compile policy: A default policy vs B libtorch-free variant shim-v1"),
        "{pair}"
    );
    // One side a caller's own digest: named as unknown, the other by its policy.
    let mut own = default.clone();
    own.toolchain
        .insert(SETTINGS_DECLARATION.into(), "0123456789abcdef".into());
    let text = pair_text(&rekey(own), &variant);
    assert!(
        text.contains("compile policy: A a policy this version does not know vs B libtorch-free variant shim-v1"),
        "{text}"
    );
    // Two unknown digests carry no detail (as before variants existed).
    let mut x = default.clone();
    x.toolchain
        .insert(SETTINGS_DECLARATION.into(), "1111111111111111".into());
    let mut y = default.clone();
    y.toolchain
        .insert(SETTINGS_DECLARATION.into(), "2222222222222222".into());
    assert_eq!(diff_facts(&rekey(x), &rekey(y))[0].detail, None);
}

#[test]
fn a_different_cpu_level_is_the_sm_axis_alone() {
    let stored = reference_facts();
    let requested = rekey(KeyFacts {
        sm: "cpu-x86-64-v2".into(),
        ..stored.clone()
    });
    let diffs = diff_facts(&requested, &stored);
    assert_eq!(diffs.len(), 1);
    assert_eq!((diffs[0].axis, diffs[0].fact.as_str()), ("sm", "sm"));
    assert_eq!(diffs[0].requested, Value::from("cpu-x86-64-v2"));
    assert_eq!(diffs[0].stored, Value::from("cpu-avx512"));
}

#[test]
fn a_changed_op_shows_the_first_differing_canonical_lines() {
    let base = reference_facts();
    let old = lines(&["placeholder", "call_function aten.relu", "output"]);
    let new = lines(&["placeholder", "call_function aten.sigmoid", "output"]);
    let mut stored = with_graph_class(&base, |m| {
        m.insert("graph_witness".into(), graph_witness(&old).into());
    });
    stored.lines = Some(WitnessLines::bounded(&old));
    let mut requested = with_graph_class(&base, |m| {
        m.insert("graph_witness".into(), graph_witness(&new).into());
    });
    requested.lines = Some(WitnessLines::bounded(&new));
    let diffs = diff_facts(&requested, &stored);
    assert_eq!(facts_named(&requested, &stored), ["graph_witness"]);
    let detail = diffs[0].detail.as_ref().unwrap().as_object().unwrap();
    assert_eq!(detail["first_line"], Value::Int(2));
    assert_eq!(
        detail["requested"],
        Value::Array(vec![Value::Array(vec![
            Value::Int(2),
            "node 1 call_function aten.sigmoid".into()
        ])])
    );
    assert_eq!(
        detail["stored"],
        Value::Array(vec![Value::Array(vec![
            Value::Int(2),
            "node 1 call_function aten.relu".into()
        ])])
    );
    assert_eq!(detail["complete"], Value::Bool(true));
    // Without the stored lines the witness still differs, and says why there is no line diff.
    stored.lines = None;
    let d = diff_facts(&requested, &stored);
    assert!(d[0]
        .detail
        .as_ref()
        .unwrap()
        .as_object()
        .unwrap()
        .contains_key("unavailable"));
}

#[test]
fn a_changed_dynamic_range_is_the_range_digest_with_the_ingress_leaf() {
    let c: Value = tcg_cj::parse_strict(
        &std::fs::read(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../testdata/contracts/graph_class_identity_v3_with_ingress.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let block = c.as_object().unwrap()["block"].as_object().unwrap().clone();
    let decl = |shape: i64| {
        let mut gc = block.clone();
        gc.insert("name".into(), "model/denoiser".into());
        gc.insert("strict".into(), Value::Bool(true));
        gc.insert("lora_bucket".into(), Value::Int(0));
        gc.insert("literal_values".into(), "".into());
        let mut graph = gc["graph"].as_object().unwrap().clone();
        let mut pytree = graph["pytree"].as_object().unwrap().clone();
        let mut ingress = pytree["ingress"].as_object().unwrap().clone();
        let mut inputs = ingress["inputs"].as_array().unwrap().clone();
        let mut row = inputs[0].as_object().unwrap().clone();
        row.insert(
            "shape".into(),
            Value::Array(vec![Value::Int(2), Value::Int(shape)]),
        );
        inputs[0] = Value::Object(row);
        ingress.insert("inputs".into(), Value::Array(inputs));
        let digest = ingress_digest(&Value::Object(ingress.clone())).unwrap();
        pytree.insert("ingress".into(), Value::Object(ingress));
        graph.insert("pytree".into(), Value::Object(pytree));
        gc.insert("graph".into(), Value::Object(graph));
        gc.insert("range_digest".into(), digest.into());
        GraphClassDeclaration::from_graph_class_value(&gc).unwrap()
    };
    let base = reference_facts();
    let stored = rekey(KeyFacts {
        declaration: decl(3),
        ..base.clone()
    });
    let requested = rekey(KeyFacts {
        declaration: decl(4),
        ..base
    });
    let diffs = diff_facts(&requested, &stored);
    assert_eq!(facts_named(&requested, &stored), ["range_digest"]);
    let rows = diffs[0].detail.as_ref().unwrap().as_array().unwrap();
    assert_eq!(rows.len(), 1);
    let row = rows[0].as_object().unwrap();
    assert_eq!(row["path"], Value::from("inputs[0].shape[1]"));
    assert_eq!(
        (&row["requested"], &row["stored"]),
        (&Value::Int(4), &Value::Int(3))
    );
}

#[test]
fn each_graph_fact_is_reported_by_name() {
    let base = reference_facts();
    let cases: Vec<(&str, Edit)> = vec![
        (
            "target",
            Box::new(|m| {
                m.insert("target".into(), "vae".into());
            }),
        ),
        (
            "fork.adapter",
            Box::new(|m| {
                m.insert(
                    "fork".into(),
                    tcg_cj::parse_strict(br#"[["adapter",true]]"#).unwrap(),
                );
            }),
        ),
        (
            "class_dims.height",
            Box::new(|m| {
                m.insert(
                    "class_dims".into(),
                    tcg_cj::parse_strict(br#"[["height",64]]"#).unwrap(),
                );
            }),
        ),
        (
            "strict",
            Box::new(|m| {
                m.insert("strict".into(), Value::Bool(false));
            }),
        ),
        (
            "lora_bucket",
            Box::new(|m| {
                m.insert("lora_bucket".into(), Value::Int(16));
            }),
        ),
        (
            "placement",
            Box::new(|m| {
                m.insert(
                    "placement".into(),
                    tcg_cj::parse_strict(br#"["cuda:0","cuda:1"]"#).unwrap(),
                );
            }),
        ),
        (
            "graph.pytree.in",
            Box::new(|m| {
                let mut g = m["graph"].as_object().unwrap().clone();
                let mut p = g["pytree"].as_object().unwrap().clone();
                p.insert("in".into(), "tuple".into());
                g.insert("pytree".into(), Value::Object(p));
                m.insert("graph".into(), Value::Object(g));
            }),
        ),
    ];
    for (fact, edit) in cases {
        let requested = with_graph_class(&base, |m| edit(m));
        assert_ne!(requested.key, base.key, "{fact}");
        assert_eq!(facts_named(&requested, &base), [fact], "{fact}");
    }
}

#[test]
fn constant_names_added_and_removed() {
    let base = reference_facts();
    let requested = with_graph_class(&base, |m| {
        let mut g = m["graph"].as_object().unwrap().clone();
        g.insert(
            "constant_fqns".into(),
            tcg_cj::parse_strict(br#"["l1.bias","l1.weight","l2.bias","l3.weight"]"#).unwrap(),
        );
        m.insert("graph".into(), Value::Object(g));
    });
    let diffs = diff_facts(&requested, &base);
    assert_eq!(facts_named(&requested, &base), ["graph.constant_fqns"]);
    let detail = diffs[0].detail.as_ref().unwrap().as_object().unwrap();
    assert_eq!(detail["added"], Value::Array(vec!["l3.weight".into()]));
    assert_eq!(detail["removed"], Value::Array(vec!["l2.weight".into()]));
}

#[test]
fn line_diff_is_bounded_and_kept_lines_are_checked() {
    let a: Vec<String> = (0..100).map(|i| format!("node {i} a")).collect();
    let b: Vec<String> = (0..100).map(|i| format!("node {i} b")).collect();
    let d = line_diff(&a, &b);
    let d = d.as_object().unwrap();
    assert_eq!(d["first_line"], Value::Int(0));
    assert_eq!(d["requested_lines"], Value::Int(100));
    assert_eq!(
        d["requested"].as_array().unwrap().len(),
        LINE_DIFF_MAX_LINES
    );

    let witness = graph_witness(&a);
    let kept = WitnessLines::bounded(&a);
    let bytes = kept.to_bytes(&witness, a.len());
    assert_eq!(WitnessLines::from_bytes(&bytes, &witness), Some(kept));
    // Lines that do not hash to the witness, or another witness, are not used.
    let wrong = WitnessLines::bounded(&b).to_bytes(&witness, b.len());
    assert_eq!(WitnessLines::from_bytes(&wrong, &witness), None);
    assert_eq!(WitnessLines::from_bytes(&bytes, &graph_witness(&b)), None);
    assert_eq!(WitnessLines::from_bytes(b"{not json", &witness), None);

    let huge: Vec<String> = (0..WITNESS_LINES_MAX_LINES + 5)
        .map(|i| format!("n{i}"))
        .collect();
    let kept = WitnessLines::bounded(&huge);
    assert!(!kept.complete);
    assert_eq!(kept.lines.len(), WITNESS_LINES_MAX_LINES);
    let w = graph_witness(&huge);
    let back = WitnessLines::from_bytes(&kept.to_bytes(&w, huge.len()), &w).unwrap();
    assert!(!back.complete);
}

/// An edit of a graph_class object.
type Edit = Box<dyn Fn(&mut Map)>;

fn engine(dir: &std::path::Path) -> Engine {
    Engine::open(dir.join("store")).unwrap()
}

#[test]
fn explain_finds_the_stored_neighbour_and_names_the_one_fact() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    let stored = reference_facts();
    e.import_artifact(KEY, &reference()).unwrap();
    let mut requested = stored.clone();
    requested
        .toolchain
        .insert("settings_declaration".into(), "2222222222222222".into());
    let requested = rekey(requested);
    let report = e.explain(&requested, 3).unwrap();
    let r = report.as_object().unwrap();
    assert_eq!(r["present"], Value::Bool(false));
    assert_eq!(r["remote"], Value::Null);
    let n = r["neighbours"].as_array().unwrap();
    assert_eq!(n.len(), 1);
    let n = n[0].as_object().unwrap();
    assert_eq!(n["key"], Value::from(KEY));
    assert_eq!(n["differing_axes"], Value::Array(vec!["toolchain".into()]));
    let diffs = n["differences"].as_array().unwrap();
    assert_eq!(diffs.len(), 1);
    assert_eq!(
        diffs[0].as_object().unwrap()["fact"],
        Value::from("toolchain.settings_declaration")
    );
    // The stored key itself is present and is not its own neighbour.
    let own = e.explain(&stored, 3).unwrap();
    assert_eq!(own.as_object().unwrap()["present"], Value::Bool(true));
    assert!(own.as_object().unwrap()["neighbours"]
        .as_array()
        .unwrap()
        .is_empty());
    // Another class name has no neighbours.
    let other = with_graph_class(&requested, |m| {
        m.insert("name".into(), "model/other".into());
    });
    let r = e.explain(&other, 3).unwrap();
    assert!(r.as_object().unwrap()["neighbours"]
        .as_array()
        .unwrap()
        .is_empty());
    // The text says the same.
    let text = tcg_core::engine::render_explanation(&report);
    assert!(text.contains("not stored here"), "{text}");
    assert!(
        text.contains(
            "toolchain.settings_declaration: requested 2222222222222222, stored 1111111111111111"
        ),
        "{text}"
    );
}

#[test]
fn kept_lines_are_checked_against_the_witness_and_dropped_by_gc_with_their_key() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    e.import_artifact(KEY, &reference()).unwrap();
    let witness = reference_facts().declaration.graph_witness().to_string();
    let wrong = lines(&["output"]);
    assert!(!e.record_witness_lines(KEY, &witness, &wrong).unwrap());
    assert!(e
        .store()
        .get_ref(&witness_lines_ref(KEY))
        .unwrap()
        .is_none());
    // Lines whose witness is not the stored one are kept but never shown for it.
    let other = lines(&["placeholder", "output"]);
    assert!(e
        .record_witness_lines(KEY, &graph_witness(&other), &other)
        .unwrap());
    assert!(e.stored_facts(KEY).unwrap().unwrap().lines.is_none());
    // explain_keys of an absent key names it.
    let absent = "cg-key-v1-00000000000000000000000000000000000000000000000000000000";
    assert_eq!(e.explain_keys(KEY, absent).unwrap().unwrap_err(), absent);
    let same = e.explain_keys(KEY, KEY).unwrap().unwrap();
    assert!(same.as_object().unwrap()["differences"]
        .as_array()
        .unwrap()
        .is_empty());
    // Once the key is gone, GC drops its kept lines.
    let name = graph_ref(KEY);
    let t = e.store().get_ref(&name).unwrap().unwrap();
    assert_eq!(
        e.store().compare_and_swap(&name, Some(&t), None).unwrap(),
        CasOutcome::Matched
    );
    let report = e.gc(None).unwrap();
    assert_eq!(
        report.as_object().unwrap()["stale_witness_lines"],
        Value::Int(1)
    );
    assert!(e
        .store()
        .get_ref(&witness_lines_ref(KEY))
        .unwrap()
        .is_none());
}

#[test]
fn line_diff_of_equal_length_middles_keeps_only_the_differing_lines() {
    let a = lines(&["placeholder", "relu", "output", "range 64"]);
    let b = lines(&["placeholder", "sigmoid", "output", "range 128"]);
    let d = line_diff(&a, &b);
    let d = d.as_object().unwrap();
    assert_eq!(d["first_line"], Value::Int(2));
    assert_eq!(d["requested_lines"], Value::Int(2));
    let shown: Vec<i64> = d["requested"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_array().unwrap()[0].as_i64().unwrap())
        .collect();
    assert_eq!(shown, [2, 4]);
    // Unequal middles (a line inserted) show each side's whole middle.
    let c = lines(&["placeholder", "relu", "relu", "output", "range 64"]);
    let d = line_diff(&c, &a);
    let d = d.as_object().unwrap();
    assert_eq!(d["first_line"], Value::Int(3));
    assert_eq!(d["requested_lines"], Value::Int(3));
    assert_eq!(d["stored_lines"], Value::Int(2));
}
