//! GC: reachability and lease liveness only; size budget; stats.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::Stdio;

use common::*;
use tcg_cas::{network_filesystem_name, GcOptions, Store, Target, GRAPH_REF_PREFIX};

#[test]
fn gc_frees_unreachable_objects_and_keeps_ref_closures_and_live_pins() {
    let dir = tempfile::tempdir().unwrap();
    let store = small_store(&dir.path().join("s"));
    let w = store.lease().unwrap();
    let kept = store.ingest_reader(&w, &bytes(1, 40_000)[..]).unwrap();
    let garbage = store.ingest_reader(&w, &bytes(2, 40_000)[..]).unwrap();
    let marker = store.put_bytes(&w, b"marker").unwrap();
    store
        .compare_and_swap("g/kept", None, Some(&Target::manifest(kept.manifest)))
        .unwrap();
    store
        .compare_and_swap("q/marker", None, Some(&Target::object(marker)))
        .unwrap();
    w.end().unwrap();
    let holder = store.lease().unwrap();
    let pinned = store.put_bytes(&holder, b"pinned by a live lease").unwrap();
    let before = store.stats().unwrap();
    let r = store.gc(&GcOptions::default()).unwrap();
    // kept manifest + 3 chunks, marker, pinned object; garbage manifest + 3 chunks freed
    assert_eq!(r.kept_objects, 6, "{r:?}");
    assert_eq!(r.freed_objects, 4, "{r:?}");
    assert_eq!(r.examined_objects, before.objects);
    assert_eq!(r.kept_bytes + r.freed_bytes, before.object_bytes);
    assert_eq!(r.live_leases, 1);
    assert!(store.object_len(&pinned).unwrap().is_some());
    assert!(store.object_len(&garbage.manifest).unwrap().is_none());
    assert_fsck_clean(&store);
    holder.end().unwrap();
    let r = store.gc(&GcOptions::default()).unwrap();
    assert_eq!(r.freed_objects, 1);
    assert!(store.object_len(&pinned).unwrap().is_none());
}

#[test]
fn gc_deletes_nothing_when_a_ref_record_is_unreadable() {
    let (_d, store) = new_store();
    let w = store.lease().unwrap();
    store.put_bytes(&w, b"garbage").unwrap();
    w.end().unwrap();
    std::fs::write(
        store.root().join("refs").join(tcg_cas::name_hash("x")),
        "junk",
    )
    .unwrap();
    let e = store.gc(&GcOptions::default()).unwrap_err();
    assert_eq!(e.code(), "store.gc_aborted");
    assert_eq!(store.stats().unwrap().objects, 1);
}

#[test]
fn gc_deletes_nothing_when_a_refs_manifest_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let store = small_store(&dir.path().join("s"));
    let w = store.lease().unwrap();
    let info = store.ingest_reader(&w, &bytes(3, 20_000)[..]).unwrap();
    store
        .compare_and_swap("g", None, Some(&Target::manifest(info.manifest)))
        .unwrap();
    store.put_bytes(&w, b"garbage").unwrap();
    w.end().unwrap();
    std::fs::remove_file(store.object_path(&info.manifest)).unwrap();
    let e = store.gc(&GcOptions::default()).unwrap_err();
    assert_eq!(e.code(), "store.gc_aborted");
    assert_eq!(store.stats().unwrap().objects, 3);
}

#[test]
fn gc_with_max_bytes_evicts_least_recently_used_refs_under_the_prefix_first() {
    let dir = tempfile::tempdir().unwrap();
    let store = small_store(&dir.path().join("s"));
    let w = store.lease().unwrap();
    let mut names = Vec::new();
    for i in 0..4u64 {
        let info = store.ingest_reader(&w, &bytes(10 + i, 10_000)[..]).unwrap();
        let name = format!("{GRAPH_REF_PREFIX}k{i}");
        store
            .compare_and_swap(&name, None, Some(&Target::manifest(info.manifest)))
            .unwrap();
        names.push(name);
    }
    let other = store.put_bytes(&w, &bytes(99, 10_000)).unwrap();
    store
        .compare_and_swap("elsewhere/x", None, Some(&Target::object(other)))
        .unwrap();
    w.end().unwrap();
    // Use order: k2 oldest, then k0, k3, k1 (k1 most recent).
    for i in [2, 0, 3, 1] {
        store.record_use(&names[i]).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let total = store.stats().unwrap().object_bytes;
    let per_ref = (total - 10_000) / 4;
    let r = store
        .gc(&GcOptions {
            max_bytes: Some(total - per_ref - 1),
            evict_prefix: GRAPH_REF_PREFIX.into(),
        })
        .unwrap();
    assert_eq!(r.evicted_refs, vec![names[2].clone(), names[0].clone()]);
    assert_eq!(store.get_ref(&names[2]).unwrap(), None);
    assert!(store.get_ref(&names[1]).unwrap().is_some());
    // A budget below what the prefix can free never touches other refs.
    let r = store
        .gc(&GcOptions {
            max_bytes: Some(0),
            evict_prefix: GRAPH_REF_PREFIX.into(),
        })
        .unwrap();
    assert_eq!(r.evicted_refs, vec![names[3].clone(), names[1].clone()]);
    assert!(store.get_ref("elsewhere/x").unwrap().is_some());
    assert_eq!(store.stats().unwrap().object_bytes, 10_000);
    assert_fsck_clean(&store);
    // Stamps of refs that no longer exist are dropped.
    store.record_use("never/set").unwrap();
    store.gc(&GcOptions::default()).unwrap();
    assert!(dir_entries(&store.root().join("uses")).is_empty());
}

#[test]
fn gc_empties_corrupt_and_removes_only_unheld_mint_locks() {
    let (_d, store) = new_store();
    std::fs::write(store.root().join("corrupt").join("x.y"), "bad").unwrap();
    let held = store.lock_named("held", None).unwrap();
    drop(store.lock_named("free", None).unwrap());
    let r = store.gc(&GcOptions::default()).unwrap();
    assert_eq!(r.corrupt_removed, 1);
    assert_eq!(r.mint_locks_removed, 1);
    assert!(held.path().exists());
    assert!(dir_entries(&store.root().join("corrupt")).is_empty());
    drop(held);
    // The lock works again after its file was removed.
    drop(store.lock_named("free", None).unwrap());
}

#[test]
fn network_filesystem_types_are_recognised_by_statfs_magic() {
    assert_eq!(network_filesystem_name(0x6969), Some("nfs"));
    assert_eq!(network_filesystem_name(0xff53_4d42), Some("cifs"));
    assert_eq!(network_filesystem_name(0xfe53_4d42), Some("smb2"));
    assert_eq!(network_filesystem_name(0x517b), Some("smb"));
    assert_eq!(network_filesystem_name(0x0bd0_0bd0), Some("lustre"));
    assert_eq!(network_filesystem_name(0x4750_4653), Some("gpfs"));
    assert_eq!(network_filesystem_name(0x00c3_6400), Some("cephfs"));
    assert_eq!(network_filesystem_name(0xef53), None); // ext4
    assert_eq!(network_filesystem_name(0x0102_1994), None); // tmpfs
    let (_d, store) = new_store();
    store.check_local_filesystem().unwrap();
}

#[test]
fn stats_count_objects_refs_and_leases() {
    let (_d, store) = new_store();
    let w = store.lease().unwrap();
    let a = store.put_bytes(&w, b"12345").unwrap();
    store.put_bytes(&w, b"678").unwrap();
    store
        .compare_and_swap("r", None, Some(&Target::object(a)))
        .unwrap();
    let s = store.stats().unwrap();
    assert_eq!((s.objects, s.object_bytes, s.refs, s.leases), (2, 8, 1, 1));
    assert_eq!(store.approximate_size(), 8);
}

const CHILD_ENV: &str = "TCG_CAS_GC_CHILD_ROOT";

/// Child mode: hold a lease with a pin and a half-written temp until killed.
#[test]
fn child_holds_a_lease_with_a_pin_and_a_temp_until_killed() {
    let Ok(root) = std::env::var(CHILD_ENV) else {
        return;
    };
    let store = small_store(&PathBuf::from(root));
    let lease = store.lease().unwrap();
    let d = store.put_bytes(&lease, b"pinned by the child").unwrap();
    let mut w = store.chunked_writer(&lease);
    w.write_all(&bytes(6, 20_000)).unwrap();
    w.flush().unwrap();
    println!("READY {}", d.to_hex());
    std::thread::sleep(std::time::Duration::from_secs(600));
    drop(w);
}

#[test]
fn a_lease_is_live_while_its_process_lives_and_reaped_with_its_temps_after_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("s");
    let store: Store = small_store(&root);
    let mut c = child("child_holds_a_lease_with_a_pin_and_a_temp_until_killed")
        .env(CHILD_ENV, &root)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(c.stdout.take().unwrap()).lines();
    let digest = loop {
        let l = lines.next().expect("child output").unwrap();
        // The harness prints "test <name> ... " before the child's own output.
        if let Some((_, h)) = l.split_once("READY ") {
            break tcg_cas::Digest::from_hex(h.trim()).unwrap();
        }
    };
    let r = store.gc(&GcOptions::default()).unwrap();
    assert_eq!(r.live_leases, 1);
    assert_eq!(r.reaped_leases, 0);
    assert!(store.object_len(&digest).unwrap().is_some());
    assert!(!dir_entries(&root.join("tmp")).is_empty());
    c.kill().unwrap();
    c.wait().unwrap();
    let r = store.gc(&GcOptions::default()).unwrap();
    assert_eq!(r.reaped_leases, 1);
    assert!(r.reaped_temps >= 1);
    assert!(store.object_len(&digest).unwrap().is_none());
    assert!(dir_entries(&root.join("tmp")).is_empty());
    assert!(dir_entries(&root.join("leases")).is_empty());
}
