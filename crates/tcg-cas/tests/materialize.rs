//! Materialization: own inode, no clobber, verified mode.

mod common;

use std::io::Write;
use std::os::unix::fs::MetadataExt;

use common::*;
use tcg_cas::MaterializeMethod;

#[test]
fn materialize_writes_the_bytes_into_a_new_inode_never_shared_with_objects() {
    let dir = tempfile::tempdir().unwrap();
    let store = small_store(&dir.path().join("s"));
    let lease = store.lease().unwrap();
    for (i, size) in [0usize, 1, 16 * 1024, 50_000].into_iter().enumerate() {
        let data = bytes(20 + i as u64, size);
        let info = store.ingest_reader(&lease, &data[..]).unwrap();
        let m = store.load_manifest(&lease, &info.manifest).unwrap();
        for verify in [false, true] {
            let dest = dir.path().join(format!("out-{i}-{verify}"));
            let r = store
                .materialize(&lease, &info.manifest, &dest, verify)
                .unwrap();
            assert_eq!(std::fs::read(&dest).unwrap(), data);
            assert_eq!(r.size, size as u64);
            assert_eq!(r.file_digest, info.file_digest);
            if size == 0 {
                assert_eq!(r.method, MaterializeMethod::Empty);
            } else if verify {
                assert_eq!(r.method, MaterializeMethod::Verified);
            }
            let md = std::fs::metadata(&dest).unwrap();
            assert_eq!(md.nlink(), 1);
            for c in &m.chunks {
                let om = std::fs::metadata(store.object_path(&c.digest)).unwrap();
                assert_ne!(om.ino(), md.ino());
                assert_eq!(om.nlink(), 1, "object must not gain links");
            }
            // The destination is writable by its owner, unlike objects.
            std::fs::OpenOptions::new()
                .append(true)
                .open(&dest)
                .unwrap()
                .write_all(b"x")
                .unwrap();
        }
    }
    // No temp left in the destination directory.
    assert!(dir_entries(dir.path()).iter().all(|n| !n.starts_with('.')));
    assert_fsck_clean(&store);
}

#[test]
fn materialize_never_clobbers_an_existing_destination() {
    let dir = tempfile::tempdir().unwrap();
    let store = small_store(&dir.path().join("s"));
    let lease = store.lease().unwrap();
    let info = store.ingest_reader(&lease, &b"stored"[..]).unwrap();
    let dest = dir.path().join("taken");
    std::fs::write(&dest, b"someone else's").unwrap();
    let e = store
        .materialize(&lease, &info.manifest, &dest, false)
        .unwrap_err();
    assert_eq!(e.code(), "io.destination_occupied");
    assert_eq!(std::fs::read(&dest).unwrap(), b"someone else's");
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(dir.path().join("nowhere"), &link).unwrap();
    let e = store
        .materialize(&lease, &info.manifest, &link, false)
        .unwrap_err();
    assert_eq!(e.code(), "io.destination_occupied");
    assert!(!dir.path().join("nowhere").exists());
    assert!(dir_entries(dir.path()).iter().all(|n| !n.starts_with('.')));
}

#[test]
fn verified_materialize_of_a_corrupt_chunk_fails_typed_and_publishes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = small_store(&dir.path().join("s"));
    let lease = store.lease().unwrap();
    let info = store.ingest_reader(&lease, &bytes(30, 40_000)[..]).unwrap();
    let m = store.load_manifest(&lease, &info.manifest).unwrap();
    let p = store.object_path(&m.chunks[2].digest);
    let mut bad = std::fs::read(&p).unwrap();
    bad[0] ^= 1;
    std::fs::remove_file(&p).unwrap();
    std::fs::write(&p, &bad).unwrap();
    let dest = dir.path().join("out");
    let e = store
        .materialize(&lease, &info.manifest, &dest, true)
        .unwrap_err();
    assert_eq!(e.code(), "store.digest_mismatch");
    assert!(!dest.exists());
    assert!(dir_entries(dir.path()).iter().all(|n| !n.starts_with('.')));
}

fn open_rw(path: &std::path::Path) -> std::fs::File {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .unwrap()
}

#[test]
fn a_verified_kernel_copy_writes_exactly_the_stored_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let store = small_store(&dir.path().join("s"));
    let lease = store.lease().unwrap();
    // Many chunks, so that the read-back verification spreads over workers.
    let data = bytes(31, 100_000);
    let info = store.ingest_reader(&lease, &data[..]).unwrap();
    assert!(
        store
            .load_manifest(&lease, &info.manifest)
            .unwrap()
            .chunks
            .len()
            > 4
    );
    let dest = dir.path().join("out");
    let n = store
        .copy_verified_into(&lease, &info.manifest, &open_rw(&dest), &dest)
        .unwrap();
    assert_eq!(n, data.len() as u64);
    assert_eq!(std::fs::read(&dest).unwrap(), data);
    // An empty file copies to an empty file.
    let empty = store.ingest_reader(&lease, &b""[..]).unwrap();
    let dest = dir.path().join("empty");
    assert_eq!(
        store
            .copy_verified_into(&lease, &empty.manifest, &open_rw(&dest), &dest)
            .unwrap(),
        0
    );
    assert_eq!(std::fs::metadata(&dest).unwrap().len(), 0);
}

#[test]
fn a_verified_kernel_copy_of_a_corrupt_or_short_chunk_is_bad_stored_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let store = small_store(&dir.path().join("s"));
    let lease = store.lease().unwrap();
    let info = store.ingest_reader(&lease, &bytes(32, 60_000)[..]).unwrap();
    let m = store.load_manifest(&lease, &info.manifest).unwrap();
    let last = m.chunks.len() - 1;
    // A flipped bit in the last chunk (the copy itself succeeds; the read-back catches it).
    let p = store.object_path(&m.chunks[last].digest);
    let mut bad = std::fs::read(&p).unwrap();
    bad[7] ^= 0x40;
    std::fs::remove_file(&p).unwrap();
    std::fs::write(&p, &bad).unwrap();
    let dest = dir.path().join("flipped");
    let e = store
        .copy_verified_into(&lease, &info.manifest, &open_rw(&dest), &dest)
        .unwrap_err();
    assert!(e.is_bad_stored_bytes(), "{e}");
    assert_eq!(e.code(), "store.digest_mismatch");
    // A truncated chunk.
    let p = store.object_path(&m.chunks[1].digest);
    let short = std::fs::read(&p).unwrap();
    std::fs::remove_file(&p).unwrap();
    std::fs::write(&p, &short[..short.len() - 1]).unwrap();
    let dest = dir.path().join("short");
    let e = store
        .copy_verified_into(&lease, &info.manifest, &open_rw(&dest), &dest)
        .unwrap_err();
    assert!(e.is_bad_stored_bytes(), "{e}");
}
