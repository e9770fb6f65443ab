//! Who may write the store: private modes whatever the umask, refusal of a
//! store another user can write, no symlink followed by maintenance, and no
//! store created by a read-only open. Every test here sets umask 000 (this
//! file is its own process, so no other test sees it).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tcg_cas::{FsckOptions, GcOptions, Store, StoreError, Target};

fn umask_000() {
    // SAFETY: umask has no preconditions; every test of this binary wants 000.
    unsafe { libc::umask(0) };
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        out.push(p.clone());
        if std::fs::symlink_metadata(&p).unwrap().is_dir() {
            walk(&p, out);
        }
    }
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
}

/// A store with an object, a manifest, a ref, a use stamp, a lease and a mint lock.
fn populated(root: &Path) -> Store {
    let s = Store::open(root).unwrap();
    let lease = s.lease().unwrap();
    let d = s.put_bytes(&lease, b"hello").unwrap();
    s.compare_and_swap("t/obj", None, Some(&Target::object(d)))
        .unwrap();
    let info = s.ingest_reader(&lease, &b"some file"[..]).unwrap();
    s.compare_and_swap("t/file", None, Some(&Target::manifest(info.manifest)))
        .unwrap();
    s.record_use("t/file").unwrap();
    drop(s.lock_named("k", None).unwrap());
    lease.end().unwrap();
    s
}

#[test]
fn a_store_created_under_umask_000_is_private() {
    umask_000();
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("store");
    let s = populated(&root);
    let _live = s.lease().unwrap();
    assert_eq!(mode(&root), 0o700);
    let mut all = Vec::new();
    walk(&root, &mut all);
    assert!(all.len() > 20, "{all:?}");
    for p in &all {
        let md = std::fs::symlink_metadata(p).unwrap();
        let m = md.mode() & 0o7777;
        assert_eq!(m & 0o022, 0, "{} has mode {m:04o}", p.display());
        if md.is_dir() {
            assert_eq!(m, 0o700, "{}", p.display());
        }
        if p.starts_with(root.join("objects")) && md.is_file() {
            assert_eq!(m, 0o444, "{}", p.display());
        }
    }
    // And it serves.
    assert!(s.get_ref("t/obj").unwrap().is_some());
}

fn assert_insecure<T: std::fmt::Debug>(r: Result<T, StoreError>, path: &Path) {
    match r {
        Err(e @ StoreError::InsecurePermissions { .. }) => {
            assert_eq!(e.code(), "store.insecure_permissions");
            let text = e.to_string();
            assert!(text.contains(&path.display().to_string()), "{text}");
            assert!(text.contains("chmod go-w"), "{text}");
        }
        other => panic!(
            "expected store.insecure_permissions for {}, got {other:?}",
            path.display()
        ),
    }
}

#[test]
fn a_store_another_user_can_write_is_refused() {
    umask_000();
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("store");
    let s = populated(&root);
    // A world-writable directory: open, gc and fsck refuse.
    let refs = root.join("refs");
    std::fs::set_permissions(&refs, std::fs::Permissions::from_mode(0o777)).unwrap();
    assert_insecure(Store::open(&root), &refs);
    assert_insecure(Store::open_existing(&root), &refs);
    assert_insecure(s.gc(&GcOptions::default()), &refs);
    assert_insecure(s.fsck(FsckOptions::default()), &refs);
    std::fs::set_permissions(&refs, std::fs::Permissions::from_mode(0o755)).unwrap();
    Store::open(&root).unwrap();
    // The root itself, group-writable.
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o770)).unwrap();
    assert_insecure(Store::open(&root), &root);
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700)).unwrap();
    // A ref record another user can write is not trusted.
    let rec = std::fs::read_dir(&refs)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    std::fs::set_permissions(&rec, std::fs::Permissions::from_mode(0o666)).unwrap();
    let listing = s.list_refs("t/").unwrap();
    assert_eq!(listing.unreadable.len(), 1);
    std::fs::set_permissions(&rec, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert_eq!(s.list_refs("t/").unwrap().entries.len(), 2);
    // A directory owned by another user (uid 65534), even with mode 0700.
    if unsafe { libc::geteuid() } == 0 {
        let leases = root.join("leases");
        std::os::unix::fs::chown(&leases, Some(65534), Some(65534)).unwrap();
        assert_insecure(Store::open(&root), &leases);
        std::os::unix::fs::chown(&leases, Some(0), Some(0)).unwrap();
    }
    Store::open(&root).unwrap();
}

#[test]
fn maintenance_never_follows_a_symlinked_store_directory() {
    umask_000();
    for dir in ["tmp", "corrupt", "uses", "locks/mint", "refs", "leases"] {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("store");
        let s = populated(&root);
        // A directory outside the store, with a file that looks like store data.
        let outside = d.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        let victim = outside.join("0123456789abcdef0123456789abcdef.0");
        std::fs::write(&victim, b"precious").unwrap();
        let inside = root.join(dir);
        std::fs::rename(&inside, d.path().join("moved")).unwrap();
        std::os::unix::fs::symlink(&outside, &inside).unwrap();
        assert_insecure(s.gc(&GcOptions::default()), &inside);
        assert_insecure(s.fsck(FsckOptions { quarantine: true }), &inside);
        assert_insecure(s.reap(), &inside);
        assert_insecure(Store::open(&root), &inside);
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious", "{dir}");
    }
}

#[test]
fn maintenance_removes_symlink_entries_never_their_targets() {
    umask_000();
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("store");
    let s = populated(&root);
    let victim = d.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let victim_dir = d.path().join("victim-dir");
    std::fs::create_dir(&victim_dir).unwrap();
    std::fs::write(victim_dir.join("f"), b"precious").unwrap();
    let links = [
        root.join("tmp/0123456789abcdef0123456789abcdef.9"),
        root.join("tmp/fedcba9876543210fedcba9876543210.stage-x"),
        root.join("corrupt")
            .join(format!("{}.{}", "ab".repeat(32), "cd".repeat(16))),
        root.join("uses").join("ef".repeat(32)),
        root.join("locks/mint").join("12".repeat(32)),
    ];
    for (i, l) in links.iter().enumerate() {
        let target = if i == 1 { &victim_dir } else { &victim };
        std::os::unix::fs::symlink(target, l).unwrap();
    }
    // The use stamp of a ref, planted as a symlink: never read through.
    let stamp = root.join("uses").join(tcg_cas::name_hash("t/obj"));
    std::fs::remove_file(&stamp).ok();
    std::fs::write(d.path().join("fake-stamp"), b"99999999999999\n").unwrap();
    std::os::unix::fs::symlink(d.path().join("fake-stamp"), &stamp).unwrap();
    assert_eq!(s.last_use("t/obj"), 0);
    s.fsck(FsckOptions { quarantine: true }).unwrap();
    s.gc(&GcOptions::default()).unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert_eq!(std::fs::read(victim_dir.join("f")).unwrap(), b"precious");
    assert_eq!(
        std::fs::read(d.path().join("fake-stamp")).unwrap(),
        b"99999999999999\n"
    );
    // record_use replaces the link, never writes through it.
    s.record_use("t/obj").unwrap();
    assert_eq!(
        std::fs::read(d.path().join("fake-stamp")).unwrap(),
        b"99999999999999\n"
    );
    assert!(s.last_use("t/obj") > 0);
}

#[test]
fn a_read_only_open_creates_nothing() {
    umask_000();
    let d = tempfile::tempdir().unwrap();
    let missing = d.path().join("typo");
    let e = Store::open_existing(&missing).unwrap_err();
    assert_eq!(e.code(), "store.not_found");
    assert!(e.to_string().contains("typo"), "{e}");
    assert!(!missing.exists());
    let empty = d.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    assert_eq!(
        Store::open_existing(&empty).unwrap_err().code(),
        "store.not_found"
    );
    assert_eq!(std::fs::read_dir(&empty).unwrap().count(), 0);
    // A real store opens.
    populated(&d.path().join("store"));
    Store::open_existing(d.path().join("store")).unwrap();
}
