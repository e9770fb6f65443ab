//! Objects: install, verified reads, refusal of non-regular files.

mod common;

use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};

use common::*;
use tcg_cas::{store_error_of, Digest, Store, StoreError};

#[test]
fn put_bytes_installs_a_read_only_object_named_by_its_sha256() {
    let (_d, store) = new_store();
    let lease = store.lease().unwrap();
    let d = store.put_bytes(&lease, b"hello").unwrap();
    assert_eq!(
        d.to_hex(),
        "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    );
    let p = store.object_path(&d);
    assert!(p.ends_with(
        "objects/sha256/2c/f2/2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    ));
    let md = std::fs::symlink_metadata(&p).unwrap();
    assert_eq!(md.permissions().mode() & 0o777, 0o444);
    assert_eq!(store.read_object(&lease, &d, 100).unwrap(), b"hello");
    assert!(lease.is_pinned(&d));
    // Installing the same bytes again keeps the resident (same inode).
    let ino = md.ino();
    store.put_bytes(&lease, b"hello").unwrap();
    assert_eq!(std::fs::symlink_metadata(&p).unwrap().ino(), ino);
    lease.end().unwrap();
    assert!(dir_entries(&store.root().join("tmp")).is_empty());
    assert!(dir_entries(&store.root().join("leases")).is_empty());
}

#[test]
fn store_root_gets_format_file_and_refuses_other_formats() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("s");
    Store::open(&root).unwrap();
    assert_eq!(
        std::fs::read(root.join("FORMAT")).unwrap(),
        b"torch-compiled-graphs-store 1\n"
    );
    // Reopening is fine.
    Store::open(&root).unwrap();
    let other = dir.path().join("o");
    std::fs::create_dir(&other).unwrap();
    std::fs::write(other.join("FORMAT"), "torch-compiled-graphs-store 2\n").unwrap();
    let e = Store::open(&other).unwrap_err();
    assert_eq!(e.code(), "store.format_unsupported");
    let junk = dir.path().join("j");
    std::fs::create_dir(&junk).unwrap();
    std::fs::write(junk.join("notes.txt"), "x").unwrap();
    assert_eq!(
        Store::open(&junk).unwrap_err().code(),
        "store.format_unsupported"
    );
}

#[test]
fn a_store_of_0_2_0_is_recognised_refused_untouched_and_told_how_to_move_on() {
    let dir = tempfile::tempdir().unwrap();
    let old = dir.path().join("old");
    std::fs::create_dir(&old).unwrap();
    let ok = std::process::Command::new("tar")
        .arg("xzf")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../testdata/reference-0.2.0/hashrepo-store.tar.gz"
        ))
        .arg("-C")
        .arg(&old)
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let before = listing(&old);
    assert!(tcg_cas::is_hashrepo_root(&old));
    let e = Store::open(&old).unwrap_err();
    assert_eq!(e.code(), "store.hashrepo_root");
    let msg = e.to_string();
    assert!(
        msg.contains("0.2.0")
            && msg.contains("adopt --from-hashrepo")
            && msg.contains("--cas-root"),
        "{msg}"
    );
    assert_eq!(listing(&old), before, "the old root was modified");
    // A root that merely has a refs/ directory is not taken for one.
    let junk = dir.path().join("j");
    std::fs::create_dir_all(junk.join("refs")).unwrap();
    assert!(!tcg_cas::is_hashrepo_root(&junk));
    assert_eq!(
        Store::open(&junk).unwrap_err().code(),
        "store.format_unsupported"
    );
}

fn listing(root: &std::path::Path) -> Vec<(std::path::PathBuf, u64)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let md = e.metadata().unwrap();
            if md.is_dir() {
                stack.push(e.path());
            }
            out.push((e.path(), md.len()));
        }
    }
    out.sort();
    out
}

#[test]
fn put_reader_with_wrong_expected_digest_installs_nothing() {
    let (_d, store) = new_store();
    let lease = store.lease().unwrap();
    let wrong = Digest::of(b"other");
    let e = store
        .put_reader(&lease, &b"payload"[..], Some(&wrong))
        .unwrap_err();
    assert_eq!(e.code(), "store.digest_mismatch");
    assert_eq!(store.stats().unwrap().objects, 0);
    assert!(dir_entries(&store.root().join("tmp")).is_empty());
}

#[test]
fn installing_over_a_corrupt_resident_moves_it_to_corrupt_and_links_good_bytes() {
    let (_d, store) = new_store();
    let lease = store.lease().unwrap();
    let data = bytes(1, 5000);
    let d = store.put_bytes(&lease, &data).unwrap();
    let p = store.object_path(&d);
    let mut bad = data.clone();
    bad[10] ^= 1;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::write(&p, &bad).unwrap();
    store.put_bytes(&lease, &data).unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), data);
    let corrupt = dir_entries(&store.root().join("corrupt"));
    assert_eq!(corrupt.len(), 1);
    assert!(corrupt[0].starts_with(&d.to_hex()));
    assert_eq!(
        std::fs::read(store.root().join("corrupt").join(&corrupt[0])).unwrap(),
        bad
    );
}

#[test]
fn installing_over_a_planted_symlink_replaces_the_link_without_following_it() {
    let (d0, store) = new_store();
    let lease = store.lease().unwrap();
    let data = b"real bytes".to_vec();
    let d = Digest::of(&data);
    let p = store.object_path(&d);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    let victim = d0.path().join("victim");
    std::fs::write(&victim, b"do not touch").unwrap();
    std::os::unix::fs::symlink(&victim, &p).unwrap();
    store.put_bytes(&lease, &data).unwrap();
    assert!(std::fs::symlink_metadata(&p).unwrap().file_type().is_file());
    assert_eq!(std::fs::read(&victim).unwrap(), b"do not touch");
}

#[test]
fn verified_reader_fails_at_the_end_on_a_bit_flip_and_carries_the_typed_error() {
    let (_d, store) = new_store();
    let lease = store.lease().unwrap();
    let data = bytes(2, 3 << 20);
    let d = store.put_bytes(&lease, &data).unwrap();
    let p = store.object_path(&d);
    let mut bad = data.clone();
    bad[(3 << 20) - 1] ^= 0x80;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::write(&p, &bad).unwrap();
    let mut r = store
        .open_object(&lease, &d, Some(data.len() as u64), true)
        .unwrap();
    let mut out = Vec::new();
    let err = r.read_to_end(&mut out).unwrap_err();
    assert_eq!(
        store_error_of(&err).unwrap().code(),
        "store.digest_mismatch"
    );
    // The final bytes are withheld: the corrupt tail is never served.
    assert!(out.len() < data.len());
    let typed = StoreError::from_io(err, "read", "x");
    assert!(typed.is_bad_stored_bytes());
    // Unverified reading serves what is there (caller's choice).
    let mut r = store.open_object(&lease, &d, None, false).unwrap();
    let mut all = Vec::new();
    r.read_to_end(&mut all).unwrap();
    assert_eq!(all, bad);
}

#[test]
fn reads_refuse_symlinks_fifos_directories_and_sockets_without_blocking() {
    let (d0, store) = new_store();
    let lease = store.lease().unwrap();
    let kinds = ["symlink", "fifo", "directory", "socket"];
    let mut _keep = Vec::new();
    for (i, kind) in kinds.iter().enumerate() {
        let d = Digest::of(format!("planted {i}").as_bytes());
        let p = store.object_path(&d);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        match *kind {
            "symlink" => {
                let t = d0.path().join("target");
                std::fs::write(&t, format!("planted {i}")).unwrap();
                std::os::unix::fs::symlink(&t, &p).unwrap();
            }
            "fifo" => {
                let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
                assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
            }
            "directory" => std::fs::create_dir(&p).unwrap(),
            _ => _keep.push(std::os::unix::net::UnixListener::bind(&p).unwrap()),
        }
        let e = store.open_object(&lease, &d, None, true).unwrap_err();
        assert_eq!(e.code(), "store.not_regular_file", "{kind}: {e}");
        let e = store.read_object(&lease, &d, 1 << 20).unwrap_err();
        assert_eq!(e.code(), "store.not_regular_file", "{kind}: {e}");
        assert_eq!(
            store.object_len(&d).unwrap_err().code(),
            "store.not_regular_file"
        );
    }
}

#[test]
fn reading_an_absent_object_is_object_missing() {
    let (_d, store) = new_store();
    let lease = store.lease().unwrap();
    let d = Digest::of(b"never stored");
    let e = store.open_object(&lease, &d, None, true).unwrap_err();
    assert_eq!(e.code(), "store.object_missing");
    assert_eq!(store.object_len(&d).unwrap(), None);
}

#[test]
fn wrong_length_is_refused_before_reading() {
    let (_d, store) = new_store();
    let lease = store.lease().unwrap();
    let d = store.put_bytes(&lease, b"12345").unwrap();
    let e = store.open_object(&lease, &d, Some(4), true).unwrap_err();
    assert_eq!(e.code(), "store.digest_mismatch");
    assert!(matches!(e, StoreError::LengthMismatch { .. }));
}

#[test]
fn error_codes_are_stable() {
    use std::path::PathBuf;
    let p = PathBuf::from("/x");
    let cases: Vec<(StoreError, &str)> = vec![
        (
            StoreError::DigestMismatch {
                path: p.clone(),
                expected: "a".into(),
                actual: "b".into(),
            },
            "store.digest_mismatch",
        ),
        (
            StoreError::ObjectMissing {
                digest: "a".into(),
                path: p.clone(),
            },
            "store.object_missing",
        ),
        (
            StoreError::NotRegularFile {
                path: p.clone(),
                found: "fifo",
            },
            "store.not_regular_file",
        ),
        (
            StoreError::RefInvalid {
                name: "n".into(),
                reason: "r".into(),
            },
            "store.ref_invalid",
        ),
        (
            StoreError::ClosureMissing {
                name: "n".into(),
                digest: "d".into(),
                reason: "r".into(),
            },
            "store.closure_missing",
        ),
        (
            StoreError::FormatUnsupported {
                path: p.clone(),
                found: "f".into(),
            },
            "store.format_unsupported",
        ),
        (
            StoreError::RecordFormatUnsupported {
                digest: "d".into(),
                format: 2,
            },
            "store.format_unsupported",
        ),
        (
            StoreError::ManifestInvalid {
                digest: "d".into(),
                reason: "r".into(),
            },
            "store.manifest_invalid",
        ),
        (
            StoreError::HashRepoRoot { path: p.clone() },
            "store.hashrepo_root",
        ),
        (
            StoreError::NetworkFilesystem {
                path: p.clone(),
                magic: 0x6969,
                name: "nfs",
            },
            "store.network_filesystem",
        ),
        (
            StoreError::MintLockTimeout {
                name: "k".into(),
                waited: std::time::Duration::ZERO,
            },
            "store.mint_lock_timeout",
        ),
        (
            StoreError::DestinationOccupied { path: p.clone() },
            "io.destination_occupied",
        ),
        (
            StoreError::InsecurePermissions {
                path: p.clone(),
                reason: "r".into(),
            },
            "store.insecure_permissions",
        ),
        (
            StoreError::NotFound {
                path: p.clone(),
                reason: "r".into(),
            },
            "store.not_found",
        ),
        (
            StoreError::Io {
                op: "write",
                path: p.clone(),
                source: std::io::Error::from_raw_os_error(libc::ENOSPC),
            },
            "io.error",
        ),
    ];
    for (e, code) in cases {
        assert_eq!(e.code(), code);
        let msg = e.to_string();
        assert_eq!(
            msg.chars().next().unwrap(),
            msg.chars().next().unwrap().to_ascii_lowercase()
        );
    }
    let enospc = StoreError::Io {
        op: "write",
        path: p,
        source: std::io::Error::from_raw_os_error(libc::ENOSPC),
    };
    assert_eq!(enospc.raw_os_error(), Some(libc::ENOSPC));
    assert!(!enospc.is_bad_stored_bytes());
}

#[test]
fn concurrent_first_opens_of_an_empty_root_all_succeed() {
    for _ in 0..20 {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("s");
        std::fs::create_dir(&root).unwrap();
        let handles: Vec<_> = (0..6)
            .map(|_| {
                let root = root.clone();
                std::thread::spawn(move || Store::open(&root).map(|_| ()))
            })
            .collect();
        for h in handles {
            h.join().unwrap().unwrap();
        }
        assert_eq!(
            std::fs::read(root.join("FORMAT")).unwrap(),
            b"torch-compiled-graphs-store 1\n"
        );
        assert!(dir_entries(&root)
            .iter()
            .all(|n| !n.starts_with(".FORMAT.")));
    }
}
