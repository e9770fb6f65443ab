//! The weights contract travels in the package annex: written at mint,
//! verified on every read, readable from a resolved package, and ignored by
//! the metadata and the key.

mod common;

use std::collections::BTreeSet;

use common::*;
use tcg_cj::{Map, Value};
use tcg_core::artifact::envelope::envelope_bytes;
use tcg_core::artifact::package::{append_annex, needed_libraries, weights_contract, Package};
use tcg_core::artifact::weights::{ConstantKind, WeightsContract, ANNEX_FILE};
use tcg_core::artifact::{pack, read_metadata};
use tcg_core::engine::{Engine, EnsureOutcome, Request};
use tcg_core::Code;

fn facts(kinds: &[(&str, &str)], groups: &[&[&str]]) -> Value {
    let mut k = Map::new();
    for (n, kind) in kinds {
        k.insert((*n).into(), Value::Str((*kind).into()));
    }
    let mut m = Map::new();
    m.insert("kinds".into(), Value::Object(k));
    m.insert(
        "alias_groups".into(),
        Value::Array(
            groups
                .iter()
                .map(|g| Value::Array(g.iter().map(|s| Value::Str((*s).into())).collect()))
                .collect(),
        ),
    );
    Value::Object(m)
}

const KINDS: &[(&str, &str)] = &[
    ("l1.bias", "parameter"),
    ("l1.weight", "parameter"),
    ("l2.bias", "parameter"),
    ("l2.weight", "parameter"),
];

fn request() -> Request {
    let md = read_metadata(&reference()).unwrap();
    Request::new("cpu", &md.value()["toolchain"]).unwrap()
}

#[test]
fn a_mint_writes_the_contract_into_the_package_and_resolve_reads_it_back() {
    let d = tempfile::tempdir().unwrap();
    let e = Engine::open(d.path().join("store")).unwrap();
    let mut mint = || {
        let mut m = reference_mint(d.path());
        m.weights = Some(facts(KINDS, &[&["l1.bias", "l2.bias"]]));
        Ok(m)
    };
    let r = e
        .ensure(KEY, &d.path().join("out"), &request(), &mut mint)
        .unwrap();
    assert_eq!(r.outcome, EnsureOutcome::Minted);
    // The key and the metadata are those of the 0.2.0 reference: the annex enters neither.
    assert_eq!(r.resolved.metadata.key(), KEY);
    let reference_md = read_metadata(&reference()).unwrap();
    assert_eq!(r.resolved.metadata.bytes(), reference_md.bytes());
    let package = d.path().join("out/model.pt2");
    let pkg = Package::open(&package).unwrap();
    assert!(pkg.names().contains(&format!("model/{ANNEX_FILE}")));
    let c = weights_contract(&package, &r.resolved.metadata).unwrap();
    assert!(c.recorded());
    assert_eq!(c.kind("l1.weight"), Some(ConstantKind::Parameter));
    assert_eq!(c.aliases("l2.bias"), vec!["l1.bias"]);
    // A checkpoint that names only one of the group binds both rows from it.
    let plan = c.plan(["l1.weight", "l2.weight", "l1.bias"]).unwrap();
    assert!(plan.bind.contains(&("l2.bias".into(), "l1.bias".into())));
    // A fresh resolve verifies the annex again (a second store, the same envelope).
    let exported = d.path().join("graph.tar.gz");
    e.export_artifact(KEY, &exported).unwrap();
    let other = Engine::open(d.path().join("store2")).unwrap();
    other.import_artifact(KEY, &exported).unwrap();
    let again = other.resolve(KEY, &d.path().join("out2")).unwrap().unwrap();
    assert_eq!(
        weights_contract(&again.destination.join("model.pt2"), &again.metadata).unwrap(),
        c
    );
}

#[test]
fn a_package_without_an_annex_gets_the_contract_its_metadata_implies() {
    let d = tempfile::tempdir().unwrap();
    let e = Engine::open(d.path().join("store")).unwrap();
    e.import_artifact(KEY, &reference()).unwrap();
    let r = e.resolve(KEY, &d.path().join("out")).unwrap().unwrap();
    let c = weights_contract(&d.path().join("out/model.pt2"), &r.metadata).unwrap();
    assert!(!c.recorded());
    assert_eq!(c.kind("l1.weight"), Some(ConstantKind::Unknown));
    assert!(c.dropped().is_empty());
    let e = c.plan(["l1.weight", "l2.weight", "l1.bias"]).unwrap_err();
    assert_eq!(e.code(), Code::RunConstantMissing);
    assert!(e.message().contains("l2.bias"), "{e}");
}

#[test]
fn an_annex_that_contradicts_the_metadata_refuses_the_envelope() {
    let d = tempfile::tempdir().unwrap();
    let parts = reference_parts(d.path());
    // A contract written for a declaration with one more constant than the metadata's.
    let mut declared: BTreeSet<String> = KINDS.iter().map(|(n, _)| (*n).to_owned()).collect();
    declared.insert("ghost".into());
    let mut kinds = KINDS.to_vec();
    kinds.push(("ghost", "buffer"));
    let c = WeightsContract::from_facts(&facts(&kinds, &[]), &declared, &parts.rows).unwrap();
    assert_eq!(
        c.dropped().iter().collect::<Vec<_>>(),
        vec!["ghost"],
        "a declared name the table does not bind is dropped"
    );
    append_annex(&parts.package, &c).unwrap();
    // Appending twice is refused: one annex per package.
    assert_eq!(
        append_annex(&parts.package, &c).unwrap_err().code(),
        Code::ArtifactPackageLayout
    );
    // The packer verifies what it packs: it refuses.
    let envelope = d.path().join("bad.tar.gz");
    let err = pack(
        &parts.package,
        &Value::Object(parts.metadata.value().clone()),
        None,
        &envelope,
    )
    .unwrap_err();
    assert_eq!(err.code(), Code::ArtifactAnnexInvalid, "{err}");
    // An envelope written by other means is refused on import, and nothing is stored.
    let bytes = envelope_bytes(
        parts.metadata.bytes(),
        &std::fs::read(&parts.package).unwrap(),
        None,
    )
    .unwrap();
    std::fs::write(&envelope, bytes).unwrap();
    let e = Engine::open(d.path().join("store")).unwrap();
    let err = e.import_artifact(KEY, &envelope).unwrap_err();
    assert_eq!(err.code(), Code::ArtifactAnnexInvalid, "{err}");
    assert!(e.resolve(KEY, &d.path().join("out")).unwrap().is_none());
}

#[test]
fn the_reference_so_names_the_shared_cxx_runtime() {
    let d = tempfile::tempdir().unwrap();
    let parts = reference_parts(d.path());
    let needed = needed_libraries(&parts.package, parts.metadata.name()).unwrap();
    assert!(needed.iter().any(|n| n == "libstdc++.so.6"), "{needed:?}");
    tcg_core::artifact::package::check_torch_loader(&parts.package, parts.metadata.name()).unwrap();
}
