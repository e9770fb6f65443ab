//! Refs: names, records, compare-and-swap outcomes, closure checks.

mod common;

use common::*;
use tcg_cas::{
    name_hash, validate_ref_name, CasOutcome, Digest, Target, GRAPH_REF_PREFIX,
    QUARANTINE_REF_PREFIX,
};

#[test]
fn frozen_ref_prefixes_are_pinned() {
    assert_eq!(GRAPH_REF_PREFIX, "torch-compiled-graphs/v1/graphs/");
    assert_eq!(
        QUARANTINE_REF_PREFIX,
        "torch-compiled-graphs/v1/quarantine/"
    );
    assert_eq!(tcg_cas::MAX_CHUNK_BYTES, 67_108_864);
}

#[test]
fn ref_names_must_be_printable_ascii_without_empty_dot_or_dotdot_components() {
    for ok in [
        "a",
        "a/b",
        "torch-compiled-graphs/v1/graphs/k-1",
        "x y/z",
        "a/.b/..c",
    ] {
        validate_ref_name(ok).unwrap();
    }
    for bad in [
        "", "/a", "a/", "a//b", ".", "a/./b", "a/..", "é", "a\nb", "a\u{7f}",
    ] {
        let e = validate_ref_name(bad).unwrap_err();
        assert_eq!(e.code(), "store.ref_invalid", "{bad:?}");
    }
    assert!(validate_ref_name(&"a".repeat(5000)).is_err());
}

#[test]
fn compare_and_swap_reports_matched_already_equal_and_conflict() {
    let (_d, store) = new_store();
    let lease = store.lease().unwrap();
    let a = Target::object(store.put_bytes(&lease, b"a").unwrap());
    let b = Target::object(store.put_bytes(&lease, b"b").unwrap());
    let name = "test/ref";
    assert_eq!(
        store.compare_and_swap(name, None, Some(&a)).unwrap(),
        CasOutcome::Matched
    );
    assert_eq!(store.get_ref(name).unwrap(), Some(a));
    // Someone else already made the change: AlreadyEqual, not Matched.
    assert_eq!(
        store.compare_and_swap(name, None, Some(&a)).unwrap(),
        CasOutcome::AlreadyEqual
    );
    assert_eq!(
        store.compare_and_swap(name, None, Some(&b)).unwrap(),
        CasOutcome::Conflict(Some(a))
    );
    // expected == current == desired: Matched with nothing written.
    let gen = store.ref_generation().unwrap();
    assert_eq!(
        store.compare_and_swap(name, Some(&a), Some(&a)).unwrap(),
        CasOutcome::Matched
    );
    assert_eq!(store.ref_generation().unwrap(), gen);
    assert_eq!(
        store.compare_and_swap(name, Some(&a), Some(&b)).unwrap(),
        CasOutcome::Matched
    );
    assert!(store.ref_generation().unwrap() > gen);
    // Same digest, other kind: a different target.
    let b_as_manifest = Target::manifest(b.digest);
    assert_eq!(
        store
            .compare_and_swap(name, Some(&b_as_manifest), None)
            .unwrap(),
        CasOutcome::Conflict(Some(b))
    );
    assert_eq!(
        store.compare_and_swap(name, Some(&b), None).unwrap(),
        CasOutcome::Matched
    );
    assert_eq!(store.get_ref(name).unwrap(), None);
    assert_eq!(
        store.compare_and_swap(name, Some(&b), None).unwrap(),
        CasOutcome::AlreadyEqual
    );
}

#[test]
fn ref_record_is_canonical_json_in_a_file_named_by_the_name_hash() {
    let (_d, store) = new_store();
    let lease = store.lease().unwrap();
    let info = store.ingest_reader(&lease, &b"abc"[..]).unwrap();
    let name = format!("{GRAPH_REF_PREFIX}k");
    store
        .compare_and_swap(&name, None, Some(&Target::manifest(info.manifest)))
        .unwrap();
    let raw = std::fs::read(store.root().join("refs").join(name_hash(&name))).unwrap();
    assert_eq!(
        String::from_utf8(raw).unwrap(),
        format!(
            "{{\"format\":1,\"kind\":\"manifest\",\"name\":\"{name}\",\"target\":\"sha256:{}\"}}",
            info.manifest.to_hex()
        )
    );
}

#[test]
fn setting_a_ref_to_an_absent_object_or_incomplete_manifest_is_closure_missing() {
    let dir = tempfile::tempdir().unwrap();
    let store = small_store(&dir.path().join("s"));
    let lease = store.lease().unwrap();
    let absent = Target::object(Digest::of(b"absent"));
    let e = store
        .compare_and_swap("r", None, Some(&absent))
        .unwrap_err();
    assert_eq!(e.code(), "store.closure_missing");
    let info = store.ingest_reader(&lease, &bytes(4, 40_000)[..]).unwrap();
    let m = store.load_manifest(&lease, &info.manifest).unwrap();
    std::fs::remove_file(store.object_path(&m.chunks[1].digest)).unwrap();
    let e = store
        .compare_and_swap("r", None, Some(&Target::manifest(info.manifest)))
        .unwrap_err();
    assert_eq!(e.code(), "store.closure_missing");
    // A chunk of the wrong length is missing too (lstat, no rehash).
    let p = store.object_path(&m.chunks[1].digest);
    std::fs::write(&p, b"short").unwrap();
    let e = store
        .compare_and_swap("r", None, Some(&Target::manifest(info.manifest)))
        .unwrap_err();
    assert_eq!(e.code(), "store.closure_missing");
    // A plain object is not a manifest.
    let o = store.put_bytes(&lease, b"plain").unwrap();
    let e = store
        .compare_and_swap("r", None, Some(&Target::manifest(o)))
        .unwrap_err();
    assert_eq!(e.code(), "store.closure_missing");
    assert_eq!(store.get_ref("r").unwrap(), None);
}

#[test]
fn a_record_naming_another_ref_or_malformed_is_ref_invalid() {
    let (_d, store) = new_store();
    let lease = store.lease().unwrap();
    let a = Target::object(store.put_bytes(&lease, b"a").unwrap());
    store.compare_and_swap("one", None, Some(&a)).unwrap();
    let one = store.root().join("refs").join(name_hash("one"));
    let two = store.root().join("refs").join(name_hash("two"));
    std::fs::copy(&one, &two).unwrap();
    assert_eq!(
        store.get_ref("two").unwrap_err().code(),
        "store.ref_invalid"
    );
    assert_eq!(
        store
            .compare_and_swap("two", None, Some(&a))
            .unwrap_err()
            .code(),
        "store.ref_invalid"
    );
    let text = std::fs::read_to_string(&one).unwrap();
    for bad in [
        text.replace(",\"kind\"", ", \"kind\""),
        text.replace("\"object\"", "\"blob\""),
        text.replace("sha256:", "sha1:"),
        text.replace("\"format\":1,", ""),
        "garbage".to_string(),
    ] {
        std::fs::write(&one, &bad).unwrap();
        assert_eq!(
            store.get_ref("one").unwrap_err().code(),
            "store.ref_invalid",
            "{bad}"
        );
    }
    std::fs::write(&one, text.replace("\"format\":1", "\"format\":2")).unwrap();
    assert_eq!(
        store.get_ref("one").unwrap_err().code(),
        "store.format_unsupported"
    );
    // An unreadable record can be removed explicitly and then replaced.
    assert!(store.remove_unreadable_ref("one").unwrap());
    assert_eq!(
        store.compare_and_swap("one", None, Some(&a)).unwrap(),
        CasOutcome::Matched
    );
    assert!(!store.remove_unreadable_ref("one").unwrap());
}

#[test]
fn list_refs_filters_by_prefix_and_reports_unreadable_records() {
    let (_d, store) = new_store();
    let lease = store.lease().unwrap();
    let a = Target::object(store.put_bytes(&lease, b"a").unwrap());
    for n in ["p/b", "p/a", "q/c"] {
        store.compare_and_swap(n, None, Some(&a)).unwrap();
    }
    std::fs::write(store.root().join("refs").join(name_hash("p/z")), "junk").unwrap();
    let l = store.list_refs("p/").unwrap();
    let names: Vec<_> = l.entries.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["p/a", "p/b"]);
    assert_eq!(l.unreadable.len(), 1);
    assert_eq!(l.unreadable[0].1.code(), "store.ref_invalid");
    assert_eq!(store.list_refs("").unwrap().entries.len(), 3);
}

#[test]
fn pin_ref_pins_the_whole_closure_of_the_current_target() {
    let dir = tempfile::tempdir().unwrap();
    let store = small_store(&dir.path().join("s"));
    let w = store.lease().unwrap();
    let info = store.ingest_reader(&w, &bytes(5, 50_000)[..]).unwrap();
    let t = Target::manifest(info.manifest);
    store.compare_and_swap("g", None, Some(&t)).unwrap();
    w.end().unwrap();
    let r = store.lease().unwrap();
    assert_eq!(store.pin_ref(&r, "g").unwrap(), Some(t));
    let m = store.load_manifest(&r, &info.manifest).unwrap();
    assert!(r.is_pinned(&info.manifest));
    assert!(m.chunks.iter().all(|c| r.is_pinned(&c.digest)));
    assert_eq!(store.pin_ref(&r, "absent").unwrap(), None);
}
