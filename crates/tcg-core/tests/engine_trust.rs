//! Signed provenance through the engine: mints sign, export writes the
//! `.sig` document, import under a trust policy admits only a trusted
//! signature of that exact envelope, and `sign_stored` signs after the fact.
//! Keys are made by the real `ssh-keygen`, and it verifies what we export.

mod common;

use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::*;
use tcg_core::engine::{
    graph_ref, sig_path, Engine, Request, StoreOutcome, TrustSettings, SIGNATURE_REF_PREFIX,
};
use tcg_core::{Code, Kind};

fn settings() -> TrustSettings {
    TrustSettings::default()
}

fn signing_engine(root: &Path, key: &Path) -> Engine {
    let config = TrustSettings {
        signing_key: Some(key.to_path_buf()),
        ..settings()
    }
    .load()
    .unwrap();
    Engine::open(root).unwrap().with_trust(config)
}

fn trusting_engine(root: &Path, allowed: &Path, revoked: Option<&Path>) -> Engine {
    let config = TrustSettings {
        trust: Some(allowed.to_path_buf()),
        revoked_keys: revoked.map(Path::to_path_buf),
        ..settings()
    }
    .load()
    .unwrap();
    Engine::open(root).unwrap().with_trust(config)
}

fn request() -> Request {
    let md = tcg_core::artifact::read_metadata(&reference()).unwrap();
    Request::new("cpu", &md.value()["toolchain"]).unwrap()
}

/// Mint the reference graph in a store that signs with `key`, export it to
/// `out` (envelope and `.sig`).
fn minted_and_exported(dir: &Path, key: &Path, out: &Path) {
    let e = signing_engine(&dir.join("producer"), key);
    let calls = Cell::new(0);
    let mut mint = counting_mint(&calls, dir);
    e.ensure(KEY, &dir.join("resolved"), &request(), &mut mint)
        .unwrap();
    assert_eq!(calls.get(), 1);
    e.export_artifact(KEY, out).unwrap();
}

fn write(path: &Path, text: &str) -> PathBuf {
    std::fs::write(path, text).unwrap();
    path.to_path_buf()
}

fn assert_refused_and_nothing_published(e: &Engine, path: &Path, code: Code) {
    let err = e.import_artifact(KEY, path).unwrap_err();
    assert_eq!(err.code(), code, "{err}");
    assert_eq!(err.kind(), Kind::Trust);
    assert!(e.store().get_ref(&graph_ref(KEY)).unwrap().is_none());
    assert!(e
        .store()
        .list_refs(SIGNATURE_REF_PREFIX)
        .unwrap()
        .entries
        .is_empty());
}

#[test]
fn a_signed_mint_exports_a_sig_that_ssh_keygen_verifies_and_a_trusting_store_imports() {
    let d = tempfile::tempdir().unwrap();
    let (key, public) = keygen(d.path(), "ci", "ci@a.example");
    let out = d.path().join("graph.tar.gz");
    minted_and_exported(d.path(), &key, &out);
    let sig = sig_path(&out);
    let entries = tcg_trust::parse_document(&std::fs::read(&sig).unwrap()).unwrap();
    assert_eq!(entries.len(), 1);

    // OpenSSH's own verifier accepts the statement and its signature.
    let allowed = write(
        &d.path().join("allowed_signers"),
        &format!("ci@a.example {public}\n"),
    );
    std::fs::write(d.path().join("entry.sig"), &entries[0].sshsig).unwrap();
    let mut child = Command::new("ssh-keygen")
        .args([
            "-Y",
            "verify",
            "-n",
            "torch-compiled-graphs",
            "-I",
            "ci@a.example",
            "-f",
        ])
        .arg(&allowed)
        .arg("-s")
        .arg(d.path().join("entry.sig"))
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(entries[0].statement.as_bytes())
        .unwrap();
    assert!(child.wait().unwrap().success());
    // The statement binds this exact envelope.
    let st = tcg_trust::Statement::parse(entries[0].statement.as_bytes()).unwrap();
    assert_eq!(st.key, KEY);
    assert_eq!(st.producer, "ci@a.example");
    let subject = tcg_core::engine::envelope_subject(&out).unwrap();
    assert_eq!(st.envelope_sha256, subject.envelope_sha256);
    assert_eq!(st.toolchain, subject.toolchain);

    let worker = trusting_engine(&d.path().join("worker"), &allowed, None);
    let r = worker.import_artifact(KEY, &out).unwrap();
    assert_eq!(r.outcome, StoreOutcome::Stored);
    let signers = worker.signers(KEY).unwrap();
    assert_eq!(signers.len(), 1);
    // Re-export from the worker carries the signature on, byte for byte.
    let again = d.path().join("again.tar.gz");
    worker.export_artifact(KEY, &again).unwrap();
    assert_eq!(
        std::fs::read(sig_path(&again)).unwrap(),
        std::fs::read(&sig).unwrap()
    );
}

#[test]
fn import_under_a_policy_refuses_every_untrusted_case_before_publishing() {
    let d = tempfile::tempdir().unwrap();
    let (key, public) = keygen(d.path(), "ci", "ci@a.example");
    let (_other, other_public) = keygen(d.path(), "other", "other@a.example");
    let out = d.path().join("graph.tar.gz");
    minted_and_exported(d.path(), &key, &out);
    let sig = std::fs::read_to_string(sig_path(&out)).unwrap();
    let trusted = format!("ci@a.example {public}\n");

    let case =
        |name: &str, allowed: &str, revoked: Option<&str>, sig_text: Option<&str>, code: Code| {
            let dir = d.path().join(name);
            std::fs::create_dir(&dir).unwrap();
            let env = dir.join("graph.tar.gz");
            std::fs::copy(&out, &env).unwrap();
            if let Some(s) = sig_text {
                std::fs::write(sig_path(&env), s).unwrap();
            }
            let allowed = write(&dir.join("allowed_signers"), allowed);
            let revoked = revoked.map(|r| write(&dir.join("revoked"), r));
            let e = trusting_engine(&dir.join("store"), &allowed, revoked.as_deref());
            assert_refused_and_nothing_published(&e, &env, code);
        };
    case("unsigned", &trusted, None, None, Code::TrustUnsigned);
    case(
        "untrusted",
        &format!("ci@a.example {other_public}\n"),
        None,
        Some(&sig),
        Code::TrustUntrustedSigner,
    );
    case(
        "principal",
        &format!("ops@a.example {public}\n"),
        None,
        Some(&sig),
        Code::TrustUntrustedSigner,
    );
    case(
        "expired",
        &format!("ci@a.example valid-before=\"20200101Z\" {public}\n"),
        None,
        Some(&sig),
        Code::TrustExpired,
    );
    case(
        "namespace",
        &format!("ci@a.example namespaces=\"git\" {public}\n"),
        None,
        Some(&sig),
        Code::TrustNamespace,
    );
    case(
        "revoked",
        &trusted,
        Some(&format!("{public}\n")),
        Some(&sig),
        Code::TrustRevoked,
    );
    // A statement edited after signing (here: its producer).
    let entries = tcg_trust::parse_document(sig.as_bytes()).unwrap();
    let mut tampered = entries.clone();
    tampered[0].statement = tampered[0]
        .statement
        .replace("ci@a.example", "cj@a.example");
    let tampered = String::from_utf8(tcg_trust::document_bytes(&tampered)).unwrap();
    case(
        "tampered",
        &trusted,
        None,
        Some(&tampered),
        Code::TrustBadSignature,
    );
    case(
        "malformed",
        &trusted,
        None,
        Some("{\"not\":\"a signatures document\"}\n"),
        Code::TrustSignaturesInvalid,
    );

    // A valid signature of another envelope of the same key, beside this one.
    let dir = d.path().join("another");
    std::fs::create_dir(&dir).unwrap();
    let divergent = divergent_envelope(&dir);
    let producer = signing_engine(&dir.join("producer"), &key);
    producer.import_artifact(KEY, &divergent).unwrap();
    producer
        .sign_stored(KEY, &tcg_trust::Signer::from_file(&key).unwrap(), None)
        .unwrap();
    producer
        .export_artifact(KEY, &dir.join("div.tar.gz"))
        .unwrap();
    let other_sig = std::fs::read_to_string(sig_path(&dir.join("div.tar.gz"))).unwrap();
    case(
        "mismatch",
        &trusted,
        None,
        Some(&other_sig),
        Code::TrustStatementMismatch,
    );
}

#[test]
fn sign_stored_signs_after_the_fact_and_import_without_policy_keeps_only_valid_signatures() {
    let d = tempfile::tempdir().unwrap();
    let (key, public) = keygen(d.path(), "ops", "ops@a.example");
    let plain = Engine::open(d.path().join("plain")).unwrap();
    plain.import_artifact(KEY, &reference()).unwrap();
    assert!(plain.signers(KEY).unwrap().is_empty());
    let unsigned = d.path().join("unsigned.tar.gz");
    plain.export_artifact(KEY, &unsigned).unwrap();
    assert!(!sig_path(&unsigned).exists(), "no signature, no .sig");

    let signer = tcg_trust::Signer::from_file(&key).unwrap();
    let summary = plain.sign_stored(KEY, &signer, Some("release")).unwrap();
    assert_eq!(
        summary.as_object().unwrap()["producer"].as_str(),
        Some("release")
    );
    // Signing twice with the same key keeps the first record.
    plain.sign_stored(KEY, &signer, Some("release")).unwrap();
    assert_eq!(plain.signers(KEY).unwrap().len(), 1);
    let signed = d.path().join("signed.tar.gz");
    plain.export_artifact(KEY, &signed).unwrap();

    // A .sig with one good and one tampered entry: without a policy only the
    // good one is kept; with a policy the good one admits.
    let mut entries =
        tcg_trust::parse_document(&std::fs::read(sig_path(&signed)).unwrap()).unwrap();
    let mut bad = entries[0].clone();
    bad.statement = bad.statement.replace("release", "relea5e");
    entries.push(bad);
    std::fs::write(sig_path(&signed), tcg_trust::document_bytes(&entries)).unwrap();
    let other = Engine::open(d.path().join("other")).unwrap();
    other.import_artifact(KEY, &signed).unwrap();
    assert_eq!(other.signers(KEY).unwrap().len(), 1);
    let allowed = write(&d.path().join("allowed"), &format!("release {public}\n"));
    let worker = trusting_engine(&d.path().join("worker"), &allowed, None);
    assert_eq!(
        worker.import_artifact(KEY, &signed).unwrap().outcome,
        StoreOutcome::Stored
    );

    // An existing, different .sig at the export destination is never overwritten.
    let dest = d.path().join("occupied.tar.gz");
    std::fs::write(sig_path(&dest), b"someone else's\n").unwrap();
    let err = plain.export_artifact(KEY, &dest).unwrap_err();
    assert_eq!(err.code(), Code::IoDestinationOccupied);
    assert_eq!(std::fs::read(sig_path(&dest)).unwrap(), b"someone else's\n");
}

#[test]
fn trust_settings_refuse_unusable_files_with_codes() {
    let d = tempfile::tempdir().unwrap();
    let (key, public) = keygen(d.path(), "k", "k@x");
    let ca = write(
        &d.path().join("ca"),
        &format!("* cert-authority {public}\n"),
    );
    let err = TrustSettings {
        trust: Some(ca),
        ..settings()
    }
    .load()
    .unwrap_err();
    assert_eq!(err.code(), Code::TrustCertAuthorityUnsupported);
    let revoked_alone = TrustSettings {
        revoked_keys: Some(d.path().join("r")),
        ..settings()
    };
    assert_eq!(
        revoked_alone.load().unwrap_err().code(),
        Code::TrustAllowedSignersInvalid
    );
    let missing = TrustSettings {
        trust: Some(d.path().join("absent")),
        ..settings()
    };
    assert_eq!(missing.load().unwrap_err().code(), Code::IoError);
    // The public key is not a private key.
    let not_private = TrustSettings {
        signing_key: Some(PathBuf::from(format!("{}.pub", key.display()))),
        ..settings()
    };
    let err = not_private.load().unwrap_err();
    assert_eq!(err.code(), Code::TrustSigningKeyInvalid, "{err}");
}

#[test]
fn gc_eviction_keeps_signature_records_and_a_reimport_finds_them_again() {
    let d = tempfile::tempdir().unwrap();
    let (key, _public) = keygen(d.path(), "ops", "ops@a.example");
    let e = Engine::open(d.path().join("store")).unwrap();
    e.import_artifact(KEY, &reference()).unwrap();
    let signer = tcg_trust::Signer::from_file(&key).unwrap();
    e.sign_stored(KEY, &signer, Some("release")).unwrap();
    let sig_refs = || {
        e.store()
            .list_refs(SIGNATURE_REF_PREFIX)
            .unwrap()
            .entries
            .into_iter()
            .map(|r| (r.name, r.target.digest))
            .collect::<Vec<_>>()
    };
    let before = sig_refs();
    assert_eq!(before.len(), 1);

    // A zero budget evicts the graph; the signature record stays (docs/trust.md).
    let report = e.gc(Some(0)).unwrap();
    let evicted = report.as_object().unwrap()["evicted_keys"].clone();
    assert!(evicted
        .as_array()
        .unwrap()
        .iter()
        .any(|k| k.as_str() == Some(KEY)));
    assert!(e.store().get_ref(&graph_ref(KEY)).unwrap().is_none());
    assert_eq!(sig_refs(), before);
    let (fsck, clean) = e.fsck(false).unwrap();
    assert!(clean, "{fsck:?}");

    // The same envelope, imported again without a .sig, is signed again.
    e.import_artifact(KEY, &reference()).unwrap();
    assert_eq!(e.signers(KEY).unwrap().len(), 1);
}

#[test]
fn a_signing_failure_after_publication_still_returns_the_stored_mint() {
    let d = tempfile::tempdir().unwrap();
    let (key, _) = keygen(d.path(), "id_ed25519", "ci@example");
    // Learn the signature ref this mint will take (mints are deterministic).
    let a = signing_engine(&d.path().join("a"), &key);
    let calls = Cell::new(0);
    let mut mint = counting_mint(&calls, d.path());
    a.ensure(KEY, &d.path().join("ga"), &request(), &mut mint)
        .unwrap();
    let names = a.store().list_refs(SIGNATURE_REF_PREFIX).unwrap().entries;
    assert_eq!(names.len(), 1);
    // In a second store that ref's file is a directory: signing must fail.
    let root = d.path().join("b");
    let b = signing_engine(&root, &key);
    let blocked = root.join("refs").join(tcg_cas::name_hash(&names[0].name));
    std::fs::create_dir_all(&blocked).unwrap();
    let calls = Cell::new(0);
    let mut mint = counting_mint(&calls, d.path());
    let got = b
        .ensure(KEY, &d.path().join("gb"), &request(), &mut mint)
        .unwrap();
    assert_eq!(calls.get(), 1);
    assert_eq!(got.outcome, tcg_core::engine::EnsureOutcome::Minted);
    assert!(d.path().join("gb/model.pt2").exists());
    assert!(b.store().get_ref(&graph_ref(KEY)).unwrap().is_some());
    let stats = b.stats().unwrap();
    assert_eq!(
        stats.as_object().unwrap()["signing_failures"],
        tcg_cj::Value::Int(1)
    );
}

/// Issue 25: a store remembers which records were admitted under which
/// policy. A record an untrusting engine imported is no local hit for a
/// trusting engine over the same store; a trusting `ensure` replaces it with
/// its own mint (trusted by the minting store); a record admitted under one
/// policy is re-checked under another (a revoked key admits nothing more).
#[test]
fn a_trusting_engine_never_serves_what_an_untrusting_one_brought_in() {
    use tcg_core::engine::ADMISSION_REF_PREFIX;
    let d = tempfile::tempdir().unwrap();
    let (key, public) = keygen(d.path(), "ci", "ci@a.example");
    let allowed = write(
        &d.path().join("allowed_signers"),
        &format!("ci@a.example {public}\n"),
    );
    let revoked = write(&d.path().join("revoked"), &format!("{public}\n"));

    // Unsigned, imported without a policy: the trusting engine misses.
    let store = d.path().join("store");
    let plain = Engine::open(&store).unwrap();
    assert_eq!(
        plain.import_artifact(KEY, &reference()).unwrap().outcome,
        StoreOutcome::Stored
    );
    let t = trusting_engine(&store, &allowed, None);
    let dest = d.path().join("g1");
    assert!(t.resolve(KEY, &dest).unwrap().is_none());
    assert!(!dest.exists());
    assert!(plain.resolve(KEY, &d.path().join("g2")).unwrap().is_some());
    // Its ensure mints (the incumbent gives way) and serves its own mint.
    let calls = Cell::new(0);
    let mut mint = counting_mint(&calls, d.path());
    let r = t
        .ensure(KEY, &d.path().join("g3"), &request(), &mut mint)
        .unwrap();
    assert_eq!(calls.get(), 1);
    assert_eq!(r.resolved.source, tcg_core::engine::Source::Compiled);
    let names: Vec<String> = t
        .store()
        .list_refs(ADMISSION_REF_PREFIX)
        .unwrap()
        .entries
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
    assert!(
        names[0].ends_with(&format!("{}/minted", r.resolved.manifest)),
        "{names:?}"
    );
    assert!(t.resolve(KEY, &d.path().join("g4")).unwrap().is_some());

    // Signed, imported without a policy: admitted on first use from the
    // local signature records, recorded under that policy's digest.
    let out = d.path().join("signed.tar.gz");
    minted_and_exported(&d.path().join("p"), &key, &out);
    let store2 = d.path().join("store2");
    Engine::open(&store2)
        .unwrap()
        .import_artifact(KEY, &out)
        .unwrap();
    let t1 = trusting_engine(&store2, &allowed, None);
    assert!(t1.resolve(KEY, &d.path().join("g5")).unwrap().is_some());
    let names = t1.store().list_refs(ADMISSION_REF_PREFIX).unwrap().entries;
    assert_eq!(names.len(), 1);
    assert!(names[0].name.contains("/policy-"), "{}", names[0].name);
    // Another policy (the key revoked) does not inherit that admission.
    let t2 = trusting_engine(&store2, &allowed, Some(&revoked));
    assert!(t2.resolve(KEY, &d.path().join("g6")).unwrap().is_none());
    assert!(t1.resolve(KEY, &d.path().join("g7")).unwrap().is_some());
    // A forged admission record (a ref re-pointed at another object) admits nothing.
    let store3 = d.path().join("store3");
    let plain3 = Engine::open(&store3).unwrap();
    plain3.import_artifact(KEY, &reference()).unwrap();
    let m = plain3
        .store()
        .get_ref(&graph_ref(KEY))
        .unwrap()
        .unwrap()
        .digest;
    let lease = plain3.store().lease().unwrap();
    let junk = plain3.store().put_bytes(&lease, b"{}").unwrap();
    let name = tcg_core::engine::admission_ref(KEY, &m, &tcg_core::engine::Basis::Minted);
    plain3
        .store()
        .compare_and_swap(&name, None, Some(&tcg_cas::Target::object(junk)))
        .unwrap();
    lease.end().unwrap();
    let t3 = trusting_engine(&store3, &allowed, None);
    assert!(t3.resolve(KEY, &d.path().join("g8")).unwrap().is_none());
}

/// Issue 25: `verify --trust` decides on the bytes it verified. The digest
/// comes from the one handle the verifier read: replacing the file at the
/// path after it was opened changes nothing, and the digest is the one the
/// original's signature states.
#[test]
fn verify_binds_trust_to_the_bytes_read_through_one_handle() {
    use sha2::{Digest as _, Sha256};
    let d = tempfile::tempdir().unwrap();
    let (key, public) = keygen(d.path(), "ci", "ci@a.example");
    let signed = d.path().join("signed.tar.gz");
    minted_and_exported(&d.path().join("p"), &key, &signed);
    let original = std::fs::read(&signed).unwrap();
    let path = d.path().join("graph.tar.gz");
    std::fs::write(&path, &original).unwrap();
    let handle = std::fs::File::open(&path).unwrap();
    // Swapped after open: another valid envelope of the same key.
    let other = d.path().join("other.tar.gz");
    std::fs::copy(reference(), &other).unwrap();
    std::fs::rename(&other, &path).unwrap();
    let report = tcg_core::artifact::verify_file(handle, false).unwrap();
    let want = hex::encode(Sha256::digest(&original));
    assert_eq!(report.envelope_sha256.to_hex(), want);
    assert_ne!(
        tcg_core::engine::envelope_subject(&path)
            .unwrap()
            .envelope_sha256,
        want,
        "the path now names other bytes"
    );
    // The signature of the original admits the subject of what was verified.
    let entries = tcg_trust::parse_document(&std::fs::read(sig_path(&signed)).unwrap()).unwrap();
    let allowed = write(
        &d.path().join("allowed_signers"),
        &format!("ci@a.example {public}\n"),
    );
    let policy = tcg_trust::TrustPolicy::load(&allowed, None).unwrap();
    let subject = tcg_core::engine::subject_of(&report.envelope.metadata, &report.envelope_sha256);
    policy
        .admit(&entries, &subject, tcg_trust::unix_now())
        .unwrap();
}
