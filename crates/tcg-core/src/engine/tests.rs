//! Quarantine generations (SPEC-v1 §10.4–§10.5), tested through the engine's
//! internal steps so that the interleavings are exact.

use tcg_cas::Target;

use super::*;

const KEY: &str = "cg-key-v1-ddd506362c49696787e3eb3d0e44c08b00a6358015d9004ba1cd363a";

fn reference() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/reference-0.2.0/mlp-cpu.tar.gz")
}

#[test]
fn each_quarantine_creates_a_new_marker_generation() {
    let d = tempfile::tempdir().unwrap();
    let e = Engine::open(d.path()).unwrap();
    let r = e.import_artifact(KEY, &reference()).unwrap();
    let m = Digest::from_hex(&r.manifest).unwrap();
    let lease = e.store.lease().unwrap();
    e.quarantine(&lease, KEY, &m, Code::QuarantineArtifactVerification)
        .unwrap();
    let first = e.quarantine_marker(KEY, &m).unwrap().unwrap();
    e.quarantine(&lease, KEY, &m, Code::QuarantineArtifactVerification)
        .unwrap();
    let second = e.quarantine_marker(KEY, &m).unwrap().unwrap();
    assert_ne!(first, second);
    // The marker is CJ of the frozen shape.
    let bytes = e.store.read_object(&lease, &second.digest, 4096).unwrap();
    let text = String::from_utf8(bytes).unwrap();
    assert!(text.starts_with(&format!(
        "{{\"format\":1,\"key\":\"{KEY}\",\"manifest\":\"sha256:{}\",\"marker\":\"",
        m.to_hex()
    )));
    lease.end().unwrap();
}

#[test]
fn a_stale_repair_cannot_clear_a_newer_quarantine() {
    let d = tempfile::tempdir().unwrap();
    let e = Engine::open(d.path()).unwrap();
    let r = e.import_artifact(KEY, &reference()).unwrap();
    let m = Digest::from_hex(&r.manifest).unwrap();
    let lease = e.store.lease().unwrap();
    e.quarantine(&lease, KEY, &m, Code::QuarantineArtifactVerification)
        .unwrap();
    // A repairer observes generation 1 ...
    let observed: Target = e.quarantine_marker(KEY, &m).unwrap().unwrap();
    // ... a newer quarantine lands meanwhile ...
    e.quarantine(&lease, KEY, &m, Code::QuarantineStoreVerification)
        .unwrap();
    // ... and the stale retirement is refused; the record stays quarantined.
    let err = e.retire(KEY, &m, &observed).unwrap_err();
    assert_eq!(err.code(), Code::QuarantineConcurrent);
    assert!(e.quarantine_marker(KEY, &m).unwrap().is_some());
    let out = tempfile::tempdir().unwrap();
    assert_eq!(
        e.resolve(KEY, &out.path().join("out")).unwrap_err().code(),
        Code::QuarantinePresent
    );
    lease.end().unwrap();
}

#[test]
fn frozen_ref_names_are_wire_identity() {
    let m = Digest::from_hex(&"ab".repeat(32)).unwrap();
    assert_eq!(
        graph_ref(KEY),
        format!("torch-compiled-graphs/v1/graphs/{KEY}")
    );
    assert_eq!(
        quarantine_ref(KEY, &m),
        format!(
            "torch-compiled-graphs/v1/quarantine/{KEY}/{}",
            "ab".repeat(32)
        )
    );
}
