//! The engine's behaviours (SPEC-v1 §10), one test each, on real files with
//! the reference artifact (a real AOTInductor CPU package minted by 0.2.0).

mod common;

use std::cell::Cell;
use std::os::unix::fs::symlink;

use common::*;
use tcg_cas::GRAPH_REF_PREFIX;
use tcg_cj::Value;
use tcg_core::engine::{graph_ref, Engine, EnsureOutcome, Request, StoreOutcome};
use tcg_core::{Code, Kind};

fn engine(dir: &std::path::Path) -> Engine {
    Engine::open(dir.join("store")).unwrap()
}

/// `resolve` quarantines the record with `event`, publishes nothing, and
/// refuses it afterwards as quarantined.
fn assert_resolve_quarantines(e: &Engine, key: &str, out: &std::path::Path, event: Code) {
    let err = e.resolve(key, out).unwrap_err();
    assert_eq!(err.kind(), Kind::Quarantined);
    assert_eq!(err.code(), event);
    assert!(!out.exists() && leftovers(out).is_empty());
    assert_eq!(
        e.resolve(key, out).unwrap_err().code(),
        Code::QuarantinePresent
    );
}

fn request(target: &str) -> Request {
    let md = tcg_core::artifact::read_metadata(&reference()).unwrap();
    Request::new(target, &md.value()["toolchain"]).unwrap()
}

#[test]
fn resolve_misses_cleanly_and_refuses_non_keys() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    assert!(e.resolve(KEY, &d.path().join("out")).unwrap().is_none());
    let unknown_scheme = "cg-key-v9-7692c3ad3540bb803c020b3aee66cd8887123234ea0c6e7143c0add7";
    assert!(e
        .resolve(unknown_scheme, &d.path().join("out"))
        .unwrap()
        .is_none());
    for bad in [
        "",
        "not-a-key",
        "CG-KEY-V1-7692c3ad3540bb803c020b3aee66cd8887123234ea0c6e7143c0add7",
    ] {
        let err = e.resolve(bad, &d.path().join("out")).unwrap_err();
        assert_eq!(err.code(), Code::StoreKeyInvalid);
        assert!(err.message().contains("compiled-graph key"));
    }
    assert!(!d.path().join("out").exists());
}

#[test]
fn import_resolve_and_export_round_trip_the_exact_bytes() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    let r = e.import_artifact(KEY, &reference()).unwrap();
    assert_eq!(r.outcome, StoreOutcome::Stored);
    assert_eq!(
        e.import_artifact(KEY, &reference()).unwrap().outcome,
        StoreOutcome::Present
    );
    let out = d.path().join("graphs/mlp");
    let got = e.resolve(KEY, &out).unwrap().unwrap();
    assert_eq!(got.manifest, r.manifest);
    assert_eq!(tree(&out), tree(&members(d.path())));
    assert!(leftovers(&out).is_empty());
    let exported = d.path().join("export/compiled_graph.tar.gz");
    std::fs::create_dir_all(exported.parent().unwrap()).unwrap();
    e.export_artifact(KEY, &exported).unwrap();
    assert_eq!(
        std::fs::read(&exported).unwrap(),
        std::fs::read(reference()).unwrap()
    );
    // Exporting again to an identical file succeeds.
    e.export_artifact(KEY, &exported).unwrap();
    let stats = e.stats().unwrap();
    assert_eq!(stats.as_object().unwrap()["hits"], Value::Int(1));
}

#[test]
fn import_under_the_wrong_key_is_refused_and_writes_no_ref() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    let other = "cg-key-v1-0000000000000000000000000000000000000000000000000000beef";
    let err = e.import_artifact(other, &reference()).unwrap_err();
    assert_eq!(err.code(), Code::StoreKeyMismatch);
    assert!(e.store().get_ref(&graph_ref(other)).unwrap().is_none());
    assert!(e.resolve(other, &d.path().join("out")).unwrap().is_none());
}

#[test]
fn corrupted_stored_object_is_quarantined_and_a_verified_reimport_repairs_it() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    e.import_artifact(KEY, &reference()).unwrap();
    assert!(corrupt_objects(&d.path().join("store"), 4096) >= 1);
    let out = d.path().join("out");
    // The record stays quarantined: resolve and export both refuse it.
    assert_resolve_quarantines(&e, KEY, &out, Code::QuarantineStoreVerification);
    assert_eq!(
        e.export_artifact(KEY, &d.path().join("x.tar.gz"))
            .unwrap_err()
            .code(),
        Code::QuarantinePresent
    );
    // Only a newly verified publication clears it.
    assert_eq!(
        e.import_artifact(KEY, &reference()).unwrap().outcome,
        StoreOutcome::Repaired
    );
    e.resolve(KEY, &out).unwrap().unwrap();
    assert_eq!(tree(&out), tree(&members(d.path())));
}

#[test]
fn a_divergent_second_artifact_never_overwrites_and_later_repairs_a_quarantined_incumbent() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    let first = e.import_artifact(KEY, &reference()).unwrap();
    let other = divergent_envelope(d.path());
    let second = e.import_artifact(KEY, &other).unwrap();
    assert_eq!(second.outcome, StoreOutcome::Divergent);
    assert_ne!(second.manifest, first.manifest);
    let target = e.store().get_ref(&graph_ref(KEY)).unwrap().unwrap();
    assert_eq!(target.digest.to_hex(), first.manifest);
    // Quarantine the incumbent by corrupting its bytes, then publish the candidate again.
    assert!(corrupt_objects(&d.path().join("store"), 100_000) >= 1);
    assert_eq!(
        e.resolve(KEY, &d.path().join("o1")).unwrap_err().kind(),
        Kind::Quarantined
    );
    let again = e.import_artifact(KEY, &other).unwrap();
    assert_eq!(again.outcome, StoreOutcome::Repaired);
    let got = e.resolve(KEY, &d.path().join("o2")).unwrap().unwrap();
    assert_eq!(got.manifest, second.manifest);
}

#[test]
fn occupied_destinations_are_accepted_only_when_identical() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    e.import_artifact(KEY, &reference()).unwrap();
    // Identical: accepted, untouched.
    let same = d.path().join("same");
    std::fs::create_dir(&same).unwrap();
    for (name, bytes) in tree(&members(d.path())) {
        std::fs::write(same.join(name), bytes).unwrap();
    }
    e.resolve(KEY, &same).unwrap().unwrap();
    // Divergent: refused and left alone.
    let other = d.path().join("other");
    std::fs::create_dir(&other).unwrap();
    std::fs::write(other.join("metadata.json"), b"{}").unwrap();
    let err = e.resolve(KEY, &other).unwrap_err();
    assert_eq!(err.code(), Code::IoDestinationOccupied);
    assert_eq!(std::fs::read(other.join("metadata.json")).unwrap(), b"{}");
    assert!(leftovers(&other).is_empty());
    // An empty directory is treated as absent.
    let empty = d.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    e.resolve(KEY, &empty).unwrap().unwrap();
    // A file is not a directory; a symlink is occupied.
    let file = d.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    assert_eq!(
        e.resolve(KEY, &file).unwrap_err().code(),
        Code::IoDestinationNotDirectory
    );
    let link = d.path().join("link");
    symlink(&empty, &link).unwrap();
    assert_eq!(
        e.resolve(KEY, &link).unwrap_err().code(),
        Code::IoDestinationOccupied
    );
    // Nothing was quarantined by any of this.
    let target = e.store().get_ref(&graph_ref(KEY)).unwrap().unwrap();
    assert!(e
        .store()
        .get_ref(&tcg_core::engine::quarantine_ref(KEY, &target.digest))
        .unwrap()
        .is_none());
}

#[test]
fn racing_resolves_onto_one_destination_all_succeed() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    e.import_artifact(KEY, &reference()).unwrap();
    let out = d.path().join("shared");
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| s.spawn(|| e.resolve(KEY, &out).unwrap().unwrap()))
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    });
    assert_eq!(tree(&out), tree(&members(d.path())));
    assert!(leftovers(&out).is_empty());
}

#[test]
fn export_refuses_occupied_divergent_files_absent_keys_and_corrupt_objects() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    assert_eq!(
        e.export_artifact(KEY, &d.path().join("a.tar.gz"))
            .unwrap_err()
            .code(),
        Code::StoreAbsent
    );
    e.import_artifact(KEY, &reference()).unwrap();
    let taken = d.path().join("taken.tar.gz");
    std::fs::write(&taken, b"something else").unwrap();
    assert_eq!(
        e.export_artifact(KEY, &taken).unwrap_err().code(),
        Code::IoDestinationOccupied
    );
    assert_eq!(std::fs::read(&taken).unwrap(), b"something else");
    assert!(corrupt_objects(&d.path().join("store"), 4096) >= 1);
    let dest = d.path().join("b.tar.gz");
    let err = e.export_artifact(KEY, &dest).unwrap_err();
    assert_eq!(err.code(), Code::QuarantineExportVerification);
    assert!(!dest.exists() && leftovers(&dest).is_empty());
    assert_eq!(
        e.resolve(KEY, &d.path().join("o")).unwrap_err().code(),
        Code::QuarantinePresent
    );
}

#[test]
fn an_inadmissible_artifact_is_refused_before_any_ref_or_destination_and_never_quarantined() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    let (key, foreign) = foreign_host_envelope(d.path());
    let err = e.import_artifact(&key, &foreign).unwrap_err();
    assert_eq!(err.kind(), Kind::Admission);
    assert_eq!(err.code(), Code::AdmissionHostMachine);
    assert!(e.store().get_ref(&graph_ref(&key)).unwrap().is_none());
    // Planted directly in the store (as another host would), resolve refuses it
    // with AdmissionError, publishes nothing and quarantines nothing.
    let manifest = plant(&e, &key, &foreign);
    let out = d.path().join("out");
    let err = e.resolve(&key, &out).unwrap_err();
    assert_eq!(err.code(), Code::AdmissionHostMachine);
    assert!(!out.exists() && leftovers(&out).is_empty());
    assert!(e
        .store()
        .get_ref(&tcg_core::engine::quarantine_ref(&key, &manifest))
        .unwrap()
        .is_none());
    assert!(e.store().list_refs(GRAPH_REF_PREFIX).unwrap().entries.len() == 1);
}

#[test]
fn ensure_reuses_without_minting_and_refuses_runtime_mismatches_without_minting() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    e.import_artifact(KEY, &reference()).unwrap();
    let calls = Cell::new(0);
    let mut mint = counting_mint(&calls, d.path());
    let r = e
        .ensure(KEY, &d.path().join("a"), &request("cpu"), &mut mint)
        .unwrap();
    assert_eq!(r.outcome, EnsureOutcome::Reused);
    assert!(r.publication.is_none());
    let err = e
        .ensure(KEY, &d.path().join("b"), &request("sm_90"), &mut mint)
        .unwrap_err();
    assert_eq!(err.code(), Code::AdmissionTargetMismatch);
    let md = tcg_core::artifact::read_metadata(&reference()).unwrap();
    let mut other_toolchain = md.value()["toolchain"].as_object().unwrap().clone();
    other_toolchain.insert("torch".into(), "another-torch".into());
    let req = Request::new("cpu", &Value::Object(other_toolchain)).unwrap();
    let err = e
        .ensure(KEY, &d.path().join("c"), &req, &mut mint)
        .unwrap_err();
    assert_eq!(err.code(), Code::AdmissionToolchainMismatch);
    assert_eq!(calls.get(), 0);
    assert!(!d.path().join("b").exists() && !d.path().join("c").exists());
    let bad = Request::new(" ", &md.value()["toolchain"]).unwrap_err();
    assert_eq!(bad.code(), Code::AdmissionRequestInvalid);
}

#[test]
fn ensure_mints_once_on_a_miss_and_then_reuses() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    let calls = Cell::new(0);
    let mut mint = counting_mint(&calls, d.path());
    let r = e
        .ensure(KEY, &d.path().join("a"), &request("cpu"), &mut mint)
        .unwrap();
    assert_eq!(r.outcome, EnsureOutcome::Minted);
    assert_eq!(r.publication.unwrap().outcome, StoreOutcome::Stored);
    let r = e
        .ensure(KEY, &d.path().join("b"), &request("cpu"), &mut mint)
        .unwrap();
    assert_eq!(r.outcome, EnsureOutcome::Reused);
    assert_eq!(calls.get(), 1);
    assert_eq!(tree(&d.path().join("a")), tree(&d.path().join("b")));
}

#[test]
fn ensure_refuses_a_recipe_that_derives_another_key() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    let other = "cg-key-v1-0000000000000000000000000000000000000000000000000000beef";
    let mut mint = || Ok(reference_mint(d.path()));
    let err = e
        .ensure(other, &d.path().join("a"), &request("cpu"), &mut mint)
        .unwrap_err();
    assert_eq!(err.code(), Code::AdmissionRecipeKeyMismatch);
    assert!(e.store().get_ref(&graph_ref(other)).unwrap().is_none());
}

#[test]
fn a_corrupt_record_is_a_miss_for_ensure_which_repairs_it_by_minting() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    e.import_artifact(KEY, &reference()).unwrap();
    corrupt_objects(&d.path().join("store"), 4096);
    let calls = Cell::new(0);
    let mut mint = counting_mint(&calls, d.path());
    let r = e
        .ensure(KEY, &d.path().join("a"), &request("cpu"), &mut mint)
        .unwrap();
    assert_eq!(calls.get(), 1);
    assert_eq!(r.outcome, EnsureOutcome::Minted);
    assert_eq!(r.publication.unwrap().outcome, StoreOutcome::Repaired);
    e.resolve(KEY, &d.path().join("b")).unwrap().unwrap();
}

#[test]
fn the_admitted_copy_serves_resolves_and_a_corrupt_copy_falls_back_to_the_envelope() {
    use tcg_core::engine::{admitted_ref, ADMITTED_REF_PREFIX};
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    let r = e.import_artifact(KEY, &reference()).unwrap();
    let m = tcg_cas::Digest::from_hex(&r.manifest).unwrap();
    let pkg = e
        .store()
        .get_ref(&admitted_ref(KEY, &m, "model.pt2"))
        .unwrap()
        .unwrap();
    assert!(e
        .store()
        .get_ref(&admitted_ref(KEY, &m, "metadata.json"))
        .unwrap()
        .is_some());
    e.resolve(KEY, &d.path().join("a")).unwrap().unwrap();
    // Corrupt only the admitted copy of model.pt2 (its single chunk).
    let lease = e.store().lease().unwrap();
    let man = e.store().load_manifest(&lease, &pkg.digest).unwrap();
    lease.end().unwrap();
    let chunk = e.store().object_path(&man.chunks[0].digest);
    let mut bytes = std::fs::read(&chunk).unwrap();
    bytes[1000] ^= 1;
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = |m| std::fs::Permissions::from_mode(m);
        std::fs::set_permissions(&chunk, mode(0o644)).unwrap();
        std::fs::write(&chunk, bytes).unwrap();
        std::fs::set_permissions(&chunk, mode(0o444)).unwrap();
    }
    // The envelope is intact: resolve still serves the right bytes, quarantines nothing.
    e.resolve(KEY, &d.path().join("b")).unwrap().unwrap();
    assert_eq!(tree(&d.path().join("b")), tree(&members(d.path())));
    assert!(e
        .store()
        .get_ref(&tcg_core::engine::quarantine_ref(KEY, &m))
        .unwrap()
        .is_none());
    e.resolve(KEY, &d.path().join("c")).unwrap().unwrap();
    assert_eq!(tree(&d.path().join("c")), tree(&members(d.path())));
    // A divergent candidate gets no admitted copy; a replaced record's copy is dropped by gc.
    let other = divergent_envelope(d.path());
    let div = e.import_artifact(KEY, &other).unwrap();
    let dm = tcg_cas::Digest::from_hex(&div.manifest).unwrap();
    assert!(e
        .store()
        .get_ref(&admitted_ref(KEY, &dm, "model.pt2"))
        .unwrap()
        .is_none());
    let report = e.gc(None).unwrap();
    assert_eq!(
        report.as_object().unwrap()["stale_admitted_copies"],
        Value::Int(0)
    );
    assert_eq!(
        e.store()
            .list_refs(ADMITTED_REF_PREFIX)
            .unwrap()
            .entries
            .len(),
        3,
        "metadata, package and the binding record"
    );
}

#[test]
fn gc_under_a_budget_drops_admitted_copies_then_evicts_the_least_recently_resolved_key() {
    use tcg_core::engine::ADMITTED_REF_PREFIX;
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    let (older, older_env) = other_key_envelope(d.path(), "torch-a");
    let (newer, newer_env) = other_key_envelope(d.path(), "torch-b");
    assert_ne!(older, newer);
    e.import_artifact(&older, &older_env).unwrap();
    e.import_artifact(&newer, &newer_env).unwrap();
    e.resolve(&older, &d.path().join("o1")).unwrap().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    e.resolve(&newer, &d.path().join("n1")).unwrap().unwrap();
    // Nothing to evict without a budget; both keys keep their admitted copies.
    let report = e.gc(None).unwrap();
    assert_eq!(
        report.as_object().unwrap()["evicted_keys"],
        Value::Array(vec![])
    );
    assert_eq!(
        e.store()
            .list_refs(ADMITTED_REF_PREFIX)
            .unwrap()
            .entries
            .len(),
        6
    );
    // A budget that fits one envelope: the admitted copies go first, then the
    // least recently resolved key.
    let one = std::fs::metadata(&newer_env).unwrap().len() + 4096;
    let report = e.gc(Some(one)).unwrap();
    let evicted = report.as_object().unwrap()["evicted_keys"].clone();
    assert_eq!(evicted, Value::Array(vec![Value::from(older.as_str())]));
    assert!(e
        .store()
        .list_refs(ADMITTED_REF_PREFIX)
        .unwrap()
        .entries
        .is_empty());
    assert!(e.resolve(&older, &d.path().join("o2")).unwrap().is_none());
    let kept = e.resolve(&newer, &d.path().join("n2")).unwrap().unwrap();
    assert_eq!(kept.metadata.key(), newer);
    assert!(
        std::fs::read(d.path().join("n2/model.pt2")).unwrap()
            == std::fs::read(members(d.path()).join("model.pt2")).unwrap()
    );
}

#[test]
fn a_record_whose_bytes_state_another_key_is_quarantined() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    // The reference envelope planted under another key's graph ref.
    let other = "cg-key-v1-0000000000000000000000000000000000000000000000000000beef";
    plant(&e, other, &reference());
    assert_resolve_quarantines(
        &e,
        other,
        &d.path().join("out"),
        Code::QuarantineKeyMismatch,
    );
}
