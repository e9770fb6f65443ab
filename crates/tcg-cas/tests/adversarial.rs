//! Adversarial store contents: every planted defect is reported with a typed
//! error and never served.

mod common;

use std::io::Read;

use common::*;
use tcg_cas::{name_hash, store_error_of, Digest, FsckOptions, Store, Target};

struct Planted {
    _dir: tempfile::TempDir,
    store: Store,
    /// (ref name, manifest digest, chunk digests)
    refs: Vec<(String, Digest, Vec<Digest>)>,
}

fn planted() -> Planted {
    let dir = tempfile::tempdir().unwrap();
    let store = small_store(&dir.path().join("s"));
    let lease = store.lease().unwrap();
    let mut refs = Vec::new();
    for i in 0..4u64 {
        let info = store
            .ingest_reader(&lease, &bytes(40 + i, 20_000)[..])
            .unwrap();
        let m = store.load_manifest(&lease, &info.manifest).unwrap();
        let name = format!("adv/{i}");
        store
            .compare_and_swap(&name, None, Some(&Target::manifest(info.manifest)))
            .unwrap();
        refs.push((
            name,
            info.manifest,
            m.chunks.iter().map(|c| c.digest).collect(),
        ));
    }
    lease.end().unwrap();
    Planted {
        _dir: dir,
        store,
        refs,
    }
}

fn replace(path: &std::path::Path, bytes: &[u8]) {
    std::fs::remove_file(path).unwrap();
    std::fs::write(path, bytes).unwrap();
}

/// Read a ref's file through the verified reader; the typed code of the failure.
fn read_code(store: &Store, name: &str) -> Option<&'static str> {
    let lease = store.lease().unwrap();
    let t = match store.pin_ref(&lease, name) {
        Ok(Some(t)) => t,
        Ok(None) => return Some("absent"),
        Err(e) => return Some(e.code()),
    };
    let mut r = match store.open_file(&lease, &t.digest, true) {
        Ok(r) => r,
        Err(e) => return Some(e.code()),
    };
    let mut out = Vec::new();
    match r.read_to_end(&mut out) {
        Ok(_) => None,
        Err(e) => Some(store_error_of(&e).map_or("io.error", |s| s.code())),
    }
}

#[test]
fn planted_defects_are_reported_typed_by_fsck_and_never_served() {
    let p = planted();
    let s = &p.store;
    // 1. bit-flipped chunk of ref 0
    let c0 = s.object_path(&p.refs[0].2[0]);
    let mut b = std::fs::read(&c0).unwrap();
    b[100] ^= 0x10;
    replace(&c0, &b);
    // 2. truncated chunk of ref 1
    let c1 = s.object_path(&p.refs[1].2[1]);
    let b = std::fs::read(&c1).unwrap();
    replace(&c1, &b[..b.len() - 1]);
    // 3. a symlink in place of ref 2's manifest
    let m2 = s.object_path(&p.refs[2].1);
    let copy = s.root().join("../outside");
    std::fs::copy(&m2, &copy).unwrap();
    std::fs::remove_file(&m2).unwrap();
    std::os::unix::fs::symlink(&copy, &m2).unwrap();
    // 4. a FIFO in place of ref 3's first chunk
    let c3 = s.object_path(&p.refs[3].2[0]);
    std::fs::remove_file(&c3).unwrap();
    let cs = std::ffi::CString::new(c3.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(cs.as_ptr(), 0o644) }, 0);
    // 5. a ref to a missing object
    let lease = s.lease().unwrap();
    let gone = s.put_bytes(&lease, b"soon gone").unwrap();
    s.compare_and_swap("adv/missing", None, Some(&Target::object(gone)))
        .unwrap();
    lease.end().unwrap();
    std::fs::remove_file(s.object_path(&gone)).unwrap();
    // 6. a malformed ref record
    std::fs::write(
        s.root().join("refs").join(name_hash("adv/bad")),
        b"{\"format\":1}",
    )
    .unwrap();

    assert_eq!(read_code(s, "adv/0"), Some("store.digest_mismatch"));
    assert_eq!(read_code(s, "adv/1"), Some("store.digest_mismatch"));
    assert_eq!(read_code(s, "adv/2"), Some("store.not_regular_file"));
    assert_eq!(read_code(s, "adv/3"), Some("store.not_regular_file"));
    assert_eq!(read_code(s, "adv/bad"), Some("store.ref_invalid"));
    let lease = s.lease().unwrap();
    let e = s.open_object(&lease, &gone, None, true).unwrap_err();
    assert_eq!(e.code(), "store.object_missing");
    drop(lease);

    let r = s.fsck(FsckOptions::default()).unwrap();
    let mut codes: Vec<(String, &str)> = r
        .corrupt
        .iter()
        .map(|c| (c.digest.unwrap().to_hex(), c.error.code()))
        .collect();
    codes.sort();
    let mut want = vec![
        (p.refs[0].2[0].to_hex(), "store.digest_mismatch"),
        (p.refs[1].2[1].to_hex(), "store.digest_mismatch"),
        (p.refs[2].1.to_hex(), "store.not_regular_file"),
        (p.refs[3].2[0].to_hex(), "store.not_regular_file"),
    ];
    want.sort();
    assert_eq!(codes, want);
    assert!(r.corrupt.iter().all(|c| c.moved_to.is_none()));
    let mut dangling: Vec<String> = r
        .dangling_refs
        .iter()
        .map(|d| d.error.code().to_string())
        .collect();
    dangling.sort();
    // ref 2 (manifest is a symlink), ref 3 (chunk is a fifo), adv/missing: closure;
    // adv/bad: invalid record. Refs 0 and 1 are closed by lstat (content is fsck's job)
    // except ref 1 whose truncated chunk has the wrong length.
    assert_eq!(
        dangling,
        [
            "store.closure_missing",
            "store.closure_missing",
            "store.closure_missing",
            "store.closure_missing",
            "store.ref_invalid"
        ]
    );
    // fsck never deletes.
    assert!(std::fs::symlink_metadata(&c0).is_ok());

    // Quarantine moves the bad objects aside; a good object is untouched.
    let r = s.fsck(FsckOptions { quarantine: true }).unwrap();
    assert_eq!(r.corrupt.iter().filter(|c| c.moved_to.is_some()).count(), 4);
    // The malformed ref record is bad stored bytes too: moved aside, not deleted.
    let moved: Vec<_> = r
        .dangling_refs
        .iter()
        .filter_map(|d| d.moved_to.clone())
        .collect();
    assert_eq!(moved.len(), 1, "{:?}", r.dangling_refs);
    assert_eq!(std::fs::read(&moved[0]).unwrap(), b"{\"format\":1}");
    assert_eq!(s.get_ref("adv/bad").unwrap(), None);
    assert_eq!(dir_entries(&s.root().join("corrupt")).len(), 5);
    assert!(std::fs::symlink_metadata(&c0).is_err());
    assert!(
        std::fs::read(&copy).is_ok(),
        "a symlink target outside is never touched"
    );
    let r = s.fsck(FsckOptions::default()).unwrap();
    assert!(r.corrupt.is_empty());
}
