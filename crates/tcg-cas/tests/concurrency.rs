//! Several processes ingest identical and different content and race on one
//! ref while a GC process collects concurrently.

mod common;

use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Stdio};

use common::*;
use tcg_cas::{CasOutcome, Digest, GcOptions, Store, Target};

const ROOT_ENV: &str = "TCG_CAS_RACE_ROOT";
const ID_ENV: &str = "TCG_CAS_RACE_ID";
const WRITERS: u64 = 4;
const ITERATIONS: u64 = 20;
const SHARED: &str = "race/shared";

fn shared_content(i: u64) -> Vec<u8> {
    bytes(500 + i % 3, 40_000)
}

fn own_content(w: u64, i: u64) -> Vec<u8> {
    bytes(1000 * (w + 1) + i, 20_000 + (i as usize) * 100)
}

/// Read a ref's file the way a reader must: pin the closure, then stream verified.
fn read_ref(store: &Store, name: &str) -> Option<Vec<u8>> {
    let lease = store.lease().unwrap();
    let t = store.pin_ref(&lease, name).unwrap()?;
    let mut out = Vec::new();
    store
        .open_file(&lease, &t.digest, true)
        .unwrap()
        .read_to_end(&mut out)
        .unwrap();
    Some(out)
}

/// Child mode: one writer.
#[test]
fn child_writer_ingests_and_races_on_the_shared_ref() {
    let Ok(root) = std::env::var(ROOT_ENV) else {
        return;
    };
    let w: u64 = std::env::var(ID_ENV).unwrap().parse().unwrap();
    let store = small_store(&PathBuf::from(root));
    for i in 0..ITERATIONS {
        let lease = store.lease().unwrap();
        let shared = store.ingest_reader(&lease, &shared_content(i)[..]).unwrap();
        let own_data = own_content(w, i);
        let own = store.ingest_reader(&lease, &own_data[..]).unwrap();
        let t = Target::manifest(shared.manifest);
        loop {
            let cur = store.get_ref(SHARED).unwrap();
            match store
                .compare_and_swap(SHARED, cur.as_ref(), Some(&t))
                .unwrap()
            {
                CasOutcome::Matched | CasOutcome::AlreadyEqual => break,
                CasOutcome::Conflict(_) => continue,
            }
        }
        let name = format!("race/w{w}");
        let cur = store.get_ref(&name).unwrap();
        assert_eq!(
            store
                .compare_and_swap(&name, cur.as_ref(), Some(&Target::manifest(own.manifest)))
                .unwrap(),
            CasOutcome::Matched
        );
        // Everything this lease pinned is still there despite the GC process.
        for d in [shared.manifest, own.manifest] {
            let m = store.load_manifest(&lease, &d).unwrap();
            for c in m.chunks {
                assert_eq!(store.object_len(&c.digest).unwrap(), Some(c.len));
            }
        }
        lease.end().unwrap();
        // Reachable from refs: readable after the lease ended.
        assert_eq!(read_ref(&store, &name).unwrap(), own_data);
        let got = read_ref(&store, SHARED).unwrap();
        assert!((0..3).any(|j| got == shared_content(j)));
    }
    println!("WRITER DONE");
}

/// Child mode: collect until told to stop.
#[test]
fn child_collector_runs_gc_until_stopped() {
    let Ok(root) = std::env::var(ROOT_ENV) else {
        return;
    };
    let root = PathBuf::from(root);
    let store = small_store(&root);
    let stop = root.join("../stop");
    std::fs::write(root.join("../gc-ready"), b"").unwrap();
    let mut passes = 0u64;
    loop {
        store.gc(&GcOptions::default()).unwrap();
        passes += 1;
        if stop.exists() {
            break;
        }
    }
    std::fs::write(root.join("../gc-passes"), passes.to_string()).unwrap();
}

fn spawn(test: &str, root: &std::path::Path, id: u64) -> Child {
    child(test)
        .env(ROOT_ENV, root)
        .env(ID_ENV, id.to_string())
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

#[test]
fn concurrent_writers_and_gc_never_lose_a_referenced_or_pinned_object() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("s");
    let store = small_store(&root);
    for round in 0..3 {
        let _ = std::fs::remove_file(dir.path().join("stop"));
        let _ = std::fs::remove_file(dir.path().join("gc-ready"));
        let gc = spawn("child_collector_runs_gc_until_stopped", &root, 0);
        while !dir.path().join("gc-ready").exists() {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let writers: Vec<Child> = (0..WRITERS)
            .map(|w| spawn("child_writer_ingests_and_races_on_the_shared_ref", &root, w))
            .collect();
        for mut w in writers {
            assert!(
                w.wait().unwrap().success(),
                "a writer failed in round {round}"
            );
        }
        std::fs::write(dir.path().join("stop"), b"").unwrap();
        let mut gc = gc;
        assert!(
            gc.wait().unwrap().success(),
            "the collector failed in round {round}"
        );
        let passes: u64 = std::fs::read_to_string(dir.path().join("gc-passes"))
            .unwrap()
            .parse()
            .unwrap();
        eprintln!("round {round}: {passes} gc passes ran alongside the writers");
        assert!(passes >= 1);

        assert_fsck_clean(&store);
        let got = read_ref(&store, SHARED).unwrap();
        assert!((0..3).any(|j| got == shared_content(j)));
        for w in 0..WRITERS {
            let got = read_ref(&store, &format!("race/w{w}")).unwrap();
            assert_eq!(
                Digest::of(&got),
                Digest::of(&own_content(w, ITERATIONS - 1))
            );
        }
        let r = store.gc(&GcOptions::default()).unwrap();
        assert_eq!(r.live_leases, 0);
        // Only ref closures remain: shared (manifest + 3 chunks) and per writer.
        assert_eq!(r.kept_objects, r.examined_objects - r.freed_objects);
        assert_fsck_clean(&store);
        assert!(dir_entries(&root.join("tmp")).is_empty());
    }
}
