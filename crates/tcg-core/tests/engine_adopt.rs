//! Adopting a store of torch-compiled-graphs 0.2.0 (a HashRepo root): the
//! real root made by the original package, and hostile variants built from it.
//! Each bad graph is refused with its code while the others are adopted, and
//! the old root is never written.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use common::{keygen, other_key_envelope, reference, KEY};
use tcg_cas::{name_hash, Digest, GRAPH_REF_PREFIX, QUARANTINE_REF_PREFIX};
use tcg_core::engine::{AdoptEntry, AdoptStatus, Engine};
use tcg_core::Code;

const REF_FILE: &str = "004e4af47262e2d10d70b5cfe7cb4e54cfe6cdce895d2542deabc3ac64051ea4";
const ENVELOPE_OBJECT: &str = "665737685f80f95db0b57ba53545888576a535c0cfea26450f1729024475cf9c";

/// The real 0.2.0 root, unpacked at `dir/old`.
fn old_root(dir: &Path) -> PathBuf {
    let old = dir.join("old");
    std::fs::create_dir(&old).unwrap();
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/reference-0.2.0/hashrepo-store.tar.gz");
    let ok = std::process::Command::new("tar")
        .arg("xzf")
        .arg(fixture)
        .arg("-C")
        .arg(&old)
        .status()
        .unwrap()
        .success();
    assert!(ok);
    old
}

fn object_path(root: &Path, hex: &str) -> PathBuf {
    root.join("objects/sha256")
        .join(&hex[0..2])
        .join(&hex[2..4])
        .join(hex)
}

/// Write an object the way HashRepo did (no checks: tests build bad ones too).
fn put_object(root: &Path, bytes: &[u8]) -> String {
    let hex = Digest::of(bytes).to_hex();
    let p = object_path(root, &hex);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, bytes).unwrap();
    hex
}

fn put_ref(root: &Path, name: &str, target: &str) -> String {
    let file = name_hash(name);
    let record = format!(r#"{{"format":1,"name":"{name}","target":"sha256:{target}"}}"#);
    std::fs::write(root.join("refs").join(&file), record).unwrap();
    file
}

/// Add a graph to a HashRepo root: the envelope in `chunks` (lengths), or as
/// one object; `whole` overrides the manifest's whole-file digest.
fn add_graph(root: &Path, key: &str, envelope: &[u8], chunks: &[usize], whole: Option<&str>) {
    let digest = whole
        .map(str::to_string)
        .unwrap_or_else(|| Digest::of(envelope).to_hex());
    let mut file = format!(
        r#"{{"path":"compiled_graph.tar.gz","size_bytes":{},"digest":"sha256:{digest}""#,
        envelope.len()
    );
    if chunks.is_empty() {
        put_object(root, envelope);
    } else {
        let mut at = 0;
        let mut list = Vec::new();
        for &len in chunks {
            let hex = put_object(root, &envelope[at..at + len]);
            list.push(format!(r#"{{"digest":"sha256:{hex}","len":{len}}}"#));
            at += len;
        }
        assert_eq!(at, envelope.len());
        file.push_str(&format!(r#","chunks":[{}]"#, list.join(",")));
    }
    file.push('}');
    let manifest = format!(r#"{{"format":1,"files":[{file}]}}"#);
    let m = put_object(root, manifest.as_bytes());
    put_ref(root, &format!("{GRAPH_REF_PREFIX}{key}"), &m);
}

/// Every path under `root` with its type, mode and bytes (links by target).
fn snapshot(root: &Path) -> BTreeMap<PathBuf, (String, u32, Vec<u8>)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let md = std::fs::symlink_metadata(&p).unwrap();
            let mode = md.permissions().mode();
            let entry = if md.file_type().is_symlink() {
                (
                    "link".into(),
                    mode,
                    std::fs::read_link(&p)
                        .unwrap()
                        .into_os_string()
                        .into_encoded_bytes(),
                )
            } else if md.is_dir() {
                stack.push(p.clone());
                ("dir".into(), mode, vec![])
            } else {
                ("file".into(), mode, std::fs::read(&p).unwrap())
            };
            out.insert(p, entry);
        }
    }
    out
}

fn adopt(engine: &Engine, old: &Path) -> Vec<AdoptEntry> {
    let before = snapshot(old);
    let mut calls = 0;
    let entries = engine
        .adopt_hashrepo(old, &mut |done, total, _| {
            calls += 1;
            assert!(done <= total);
        })
        .unwrap();
    assert_eq!(calls, entries.len());
    assert_eq!(snapshot(old), before, "adopt wrote to the old root");
    entries
}

fn by_key<'a>(entries: &'a [AdoptEntry], key: &str) -> &'a AdoptEntry {
    entries
        .iter()
        .find(|e| e.key.as_deref() == Some(key))
        .unwrap_or_else(|| panic!("no entry for {key}: {entries:?}"))
}

fn refused_with(entries: &[AdoptEntry], key: &str, code: Code) {
    let e = by_key(entries, key);
    assert_eq!(e.status, AdoptStatus::Refused, "{e:?}");
    assert_eq!(e.error.as_ref().unwrap().code(), code, "{e:?}");
}

/// The second, good graph beside each bad one: it must always be adopted.
fn with_other_graph(dir: &Path, old: &Path) -> String {
    let (other, env) = other_key_envelope(dir, "other-2.0");
    add_graph(old, &other, &std::fs::read(env).unwrap(), &[], None);
    other
}

fn assert_adopted(engine: &Engine, entries: &[AdoptEntry], key: &str, dir: &Path) {
    assert_eq!(by_key(entries, key).status, AdoptStatus::Imported);
    let out = dir.join(format!("resolved-{key}"));
    assert!(engine.resolve(key, &out).unwrap().is_some());
}

#[test]
fn the_real_0_2_0_root_is_adopted_with_the_exact_envelope_then_reported_present() {
    let d = tempfile::tempdir().unwrap();
    let old = old_root(d.path());
    let engine = Engine::open(d.path().join("new")).unwrap();
    let entries = adopt(&engine, &old);
    assert_eq!(entries.len(), 1);
    let e = &entries[0];
    assert_eq!(
        (e.key.as_deref(), e.ref_file.as_str(), e.status),
        (Some(KEY), REF_FILE, AdoptStatus::Imported)
    );
    let exported = d.path().join("exported.tar.gz");
    engine.export_artifact(KEY, &exported).unwrap();
    assert_eq!(
        std::fs::read(&exported).unwrap(),
        std::fs::read(reference()).unwrap()
    );
    assert!(engine.resolve(KEY, &d.path().join("r")).unwrap().is_some());
    let again = adopt(&engine, &old);
    assert_eq!(again[0].status, AdoptStatus::Present);
    let json = tcg_cj::to_canonical_string(&again[0].to_value()).unwrap();
    assert!(json.contains(r#""status":"present""#), "{json}");
}

#[test]
fn a_flipped_object_byte_is_refused_as_a_digest_mismatch_while_the_other_graph_adopts() {
    let d = tempfile::tempdir().unwrap();
    let old = old_root(d.path());
    let other = with_other_graph(d.path(), &old);
    let p = object_path(&old, ENVELOPE_OBJECT);
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut bytes = std::fs::read(&p).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x01;
    std::fs::write(&p, bytes).unwrap();
    let engine = Engine::open(d.path().join("new")).unwrap();
    let entries = adopt(&engine, &old);
    refused_with(&entries, KEY, Code::StoreDigestMismatch);
    assert!(engine.resolve(KEY, &d.path().join("r")).unwrap().is_none());
    assert_adopted(&engine, &entries, &other, d.path());
}

#[test]
fn a_chunked_envelope_adopts_and_a_wrong_whole_file_digest_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let envelope = std::fs::read(reference()).unwrap();
    let (a, b) = (150_000, 150_000);
    let chunks = [a, b, envelope.len() - a - b];

    // Re-chunked into three objects with the right digests: adopted, same bytes.
    let old = old_root(d.path());
    std::fs::remove_file(old.join("refs").join(REF_FILE)).unwrap();
    add_graph(&old, KEY, &envelope, &chunks, None);
    let engine = Engine::open(d.path().join("new")).unwrap();
    let entries = adopt(&engine, &old);
    assert_eq!(by_key(&entries, KEY).status, AdoptStatus::Imported);
    let exported = d.path().join("exported.tar.gz");
    engine.export_artifact(KEY, &exported).unwrap();
    assert_eq!(std::fs::read(&exported).unwrap(), envelope);

    // Every chunk intact, but the manifest's whole-file digest is another file's.
    let d2 = tempfile::tempdir().unwrap();
    let old = old_root(d2.path());
    let other = with_other_graph(d2.path(), &old);
    std::fs::remove_file(old.join("refs").join(REF_FILE)).unwrap();
    let wrong = Digest::of(b"another file").to_hex();
    add_graph(&old, KEY, &envelope, &chunks, Some(&wrong));
    let engine = Engine::open(d2.path().join("new")).unwrap();
    let entries = adopt(&engine, &old);
    refused_with(&entries, KEY, Code::StoreDigestMismatch);
    let msg = by_key(&entries, KEY)
        .error
        .as_ref()
        .unwrap()
        .message()
        .to_string();
    assert!(msg.contains(&wrong), "{msg}");
    assert!(engine.resolve(KEY, &d2.path().join("r")).unwrap().is_none());
    assert_adopted(&engine, &entries, &other, d2.path());
}

#[test]
fn a_ref_whose_name_does_not_hash_to_its_file_name_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let old = old_root(d.path());
    let other = with_other_graph(d.path(), &old);
    // The record of KEY moved under the file name of another ref name.
    let record = std::fs::read(old.join("refs").join(REF_FILE)).unwrap();
    std::fs::remove_file(old.join("refs").join(REF_FILE)).unwrap();
    let elsewhere = name_hash("torch-compiled-graphs/v1/graphs/cg-key-v1-something-else");
    std::fs::write(old.join("refs").join(&elsewhere), record).unwrap();
    let engine = Engine::open(d.path().join("new")).unwrap();
    let entries = adopt(&engine, &old);
    let e = entries.iter().find(|e| e.ref_file == elsewhere).unwrap();
    assert_eq!(e.status, AdoptStatus::Refused);
    assert_eq!(e.error.as_ref().unwrap().code(), Code::StoreRefInvalid);
    assert!(engine.resolve(KEY, &d.path().join("r")).unwrap().is_none());
    assert_adopted(&engine, &entries, &other, d.path());
}

#[test]
fn a_key_quarantined_in_the_old_store_is_reported_and_not_adopted() {
    let d = tempfile::tempdir().unwrap();
    let old = old_root(d.path());
    let other = with_other_graph(d.path(), &old);
    let marker = put_object(&old, br#"{"format":1,"marker":"x"}"#);
    put_ref(
        &old,
        &format!("{QUARANTINE_REF_PREFIX}{KEY}/{ENVELOPE_OBJECT}"),
        &marker,
    );
    let engine = Engine::open(d.path().join("new")).unwrap();
    let entries = adopt(&engine, &old);
    let e = by_key(&entries, KEY);
    assert_eq!(e.status, AdoptStatus::Quarantined, "{e:?}");
    assert_eq!(e.error.as_ref().unwrap().code(), Code::QuarantinePresent);
    assert!(engine.resolve(KEY, &d.path().join("r")).unwrap().is_none());
    assert_adopted(&engine, &entries, &other, d.path());
}

#[test]
fn symlinks_in_the_old_tree_are_never_followed() {
    // The envelope object replaced by a link to a copy of the right bytes.
    let d = tempfile::tempdir().unwrap();
    let old = old_root(d.path());
    let other = with_other_graph(d.path(), &old);
    let p = object_path(&old, ENVELOPE_OBJECT);
    let outside = d.path().join("outside");
    std::fs::copy(&p, &outside).unwrap();
    std::fs::remove_file(&p).unwrap();
    std::os::unix::fs::symlink(&outside, &p).unwrap();
    let engine = Engine::open(d.path().join("new")).unwrap();
    let entries = adopt(&engine, &old);
    refused_with(&entries, KEY, Code::StoreNotRegularFile);
    assert_adopted(&engine, &entries, &other, d.path());

    // A directory on the way to the manifest object replaced by a link.
    let d = tempfile::tempdir().unwrap();
    let old = old_root(d.path());
    let other = with_other_graph(d.path(), &old);
    let dir = old.join("objects/sha256/86");
    let moved = d.path().join("moved-86");
    std::fs::rename(&dir, &moved).unwrap();
    std::os::unix::fs::symlink(&moved, &dir).unwrap();
    let engine = Engine::open(d.path().join("new")).unwrap();
    let entries = adopt(&engine, &old);
    refused_with(&entries, KEY, Code::StoreNotRegularFile);
    assert_adopted(&engine, &entries, &other, d.path());

    // A ref record that is a link.
    let d = tempfile::tempdir().unwrap();
    let old = old_root(d.path());
    let other = with_other_graph(d.path(), &old);
    let r = old.join("refs").join(REF_FILE);
    let outside = d.path().join("ref-outside");
    std::fs::rename(&r, &outside).unwrap();
    std::os::unix::fs::symlink(&outside, &r).unwrap();
    let engine = Engine::open(d.path().join("new")).unwrap();
    let entries = adopt(&engine, &old);
    let e = entries.iter().find(|e| e.ref_file == REF_FILE).unwrap();
    assert_eq!(e.status, AdoptStatus::Refused);
    assert_eq!(e.error.as_ref().unwrap().code(), Code::StoreNotRegularFile);
    assert_adopted(&engine, &entries, &other, d.path());
}

#[test]
fn hostile_manifests_and_records_are_refused_with_their_codes() {
    let d = tempfile::tempdir().unwrap();
    let old = old_root(d.path());
    let envelope = std::fs::read(reference()).unwrap();
    // A ref under a key the envelope does not state: full verification refuses it.
    let (wrong_key, _) = other_key_envelope(d.path(), "not-this-one");
    let m = std::fs::read_dir(old.join("refs")).unwrap().count();
    assert_eq!(m, 1);
    let manifest_hex = "86786f90f482bcb9988391c7d83f28bb6447fc334f0fb4ebc65612b0d7ae1e0f";
    put_ref(
        &old,
        &format!("{GRAPH_REF_PREFIX}{wrong_key}"),
        manifest_hex,
    );
    // A manifest whose chunk lengths do not sum to its size.
    let bad = format!(
        r#"{{"format":1,"files":[{{"path":"compiled_graph.tar.gz","size_bytes":{},"digest":"sha256:{ENVELOPE_OBJECT}","chunks":[{{"digest":"sha256:{ENVELOPE_OBJECT}","len":5}}]}}]}}"#,
        envelope.len()
    );
    let bad_m = put_object(&old, bad.as_bytes());
    let (k2, _) = other_key_envelope(d.path(), "k2");
    put_ref(&old, &format!("{GRAPH_REF_PREFIX}{k2}"), &bad_m);
    // A ref naming a manifest object that is not there.
    let (k3, _) = other_key_envelope(d.path(), "k3");
    put_ref(
        &old,
        &format!("{GRAPH_REF_PREFIX}{k3}"),
        &Digest::of(b"absent").to_hex(),
    );
    // A ref record that is not JSON.
    std::fs::write(old.join("refs").join(name_hash("junk")), b"{not json").unwrap();
    // A graph ref whose name is not a key.
    put_ref(&old, &format!("{GRAPH_REF_PREFIX}not-a-key"), manifest_hex);

    let engine = Engine::open(d.path().join("new")).unwrap();
    let entries = adopt(&engine, &old);
    assert_eq!(by_key(&entries, KEY).status, AdoptStatus::Imported);
    refused_with(&entries, &wrong_key, Code::StoreKeyMismatch);
    refused_with(&entries, &k2, Code::StoreManifestInvalid);
    refused_with(&entries, &k3, Code::StoreObjectMissing);
    refused_with(&entries, "not-a-key", Code::StoreKeyInvalid);
    let junk = entries
        .iter()
        .find(|e| e.ref_file == name_hash("junk"))
        .unwrap();
    assert_eq!(junk.error.as_ref().unwrap().code(), Code::StoreRefInvalid);
    assert_eq!(entries.len(), 6);
}

#[test]
fn a_root_that_is_not_a_hashrepo_root_is_refused_as_a_whole() {
    let d = tempfile::tempdir().unwrap();
    let engine = Engine::open(d.path().join("new")).unwrap();
    let err = engine
        .adopt_hashrepo(&d.path().join("new"), &mut |_, _, _| {})
        .unwrap_err();
    assert_eq!(err.code(), Code::StoreFormatUnsupported);
    let empty = d.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let err = engine
        .adopt_hashrepo(&empty, &mut |_, _, _| {})
        .unwrap_err();
    assert_eq!(err.code(), Code::StoreFormatUnsupported);
    // And the engine refuses to open a 0.2.0 root in place, saying how to move on.
    let old = old_root(d.path());
    let err = Engine::open(&old).unwrap_err();
    assert_eq!(err.code(), Code::StoreHashrepoRoot);
    assert!(
        err.message().contains("adopt --from-hashrepo"),
        "{}",
        err.message()
    );
}

#[test]
fn under_a_trust_policy_each_unsigned_graph_is_refused_and_nothing_is_published() {
    let d = tempfile::tempdir().unwrap();
    let old = old_root(d.path());
    let (_, public) = keygen(d.path(), "id", "ci@example");
    let allowed = d.path().join("allowed_signers");
    std::fs::write(&allowed, format!("ci@example {public}")).unwrap();
    let trust = tcg_core::engine::TrustSettings {
        trust: Some(allowed),
        ..Default::default()
    }
    .load()
    .unwrap();
    let engine = Engine::open(d.path().join("new"))
        .unwrap()
        .with_trust(trust);
    let entries = adopt(&engine, &old);
    refused_with(&entries, KEY, Code::TrustUnsigned);
    assert!(engine
        .store()
        .get_ref(&format!("{GRAPH_REF_PREFIX}{KEY}"))
        .unwrap()
        .is_none());
    // The operator vouching for its own old store adopts without a policy.
    let vouched = Engine::open(d.path().join("new")).unwrap();
    assert_adopted(&vouched, &adopt(&vouched, &old), KEY, d.path());
}

/// Issue 25: a new store root inside the old root (which adoption never
/// writes), an old root inside the new store root, or the same directory:
/// refused as a whole with `store.adopt_overlap` before anything is written,
/// also through a symlink.
#[test]
fn overlapping_roots_are_refused_before_anything_is_written() {
    let d = tempfile::tempdir().unwrap();
    let old = old_root(d.path());
    let before = snapshot(&old);
    for new in [old.join("cas"), old.join("sub/deeper/cas")] {
        let err = tcg_core::engine::check_adopt_layout(&old, &new).unwrap_err();
        assert_eq!(err.code(), Code::StoreAdoptOverlap, "{err}");
        assert!(err.message().contains("inside the old root"), "{err}");
    }
    // Through a symlink to the old root.
    let link = d.path().join("link");
    std::os::unix::fs::symlink(&old, &link).unwrap();
    let err = tcg_core::engine::check_adopt_layout(&old, &link.join("cas")).unwrap_err();
    assert_eq!(err.code(), Code::StoreAdoptOverlap);
    // The engine refuses too (an engine opened elsewhere, pointed at an old
    // root inside its own root).
    let new = d.path().join("new");
    let engine = Engine::open(&new).unwrap();
    let inner = new.join("old-inside");
    std::fs::rename(&old, &inner).unwrap();
    let inner_before = snapshot(&inner);
    let err = engine
        .adopt_hashrepo(&inner, &mut |_, _, _| {})
        .unwrap_err();
    assert_eq!(err.code(), Code::StoreAdoptOverlap, "{err}");
    assert!(err.message().contains("inside the new store root"), "{err}");
    assert_eq!(snapshot(&inner), inner_before);
    assert!(engine
        .store()
        .list_refs(GRAPH_REF_PREFIX)
        .unwrap()
        .entries
        .is_empty());
    std::fs::rename(&inner, &old).unwrap();
    assert_eq!(snapshot(&old), before);
    // Siblings are fine.
    tcg_core::engine::check_adopt_layout(&old, &d.path().join("sibling")).unwrap();
}
