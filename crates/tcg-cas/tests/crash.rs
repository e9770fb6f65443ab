//! Crash matrix: a child process writing objects, chunked manifests and ref
//! CAS (and running GC) in a loop is SIGKILLed at hundreds of points spread
//! over its phases. After every kill the store is consistent.

mod common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use common::*;
use tcg_cas::{CasOutcome, GcOptions, Target};

const ROOT_ENV: &str = "TCG_CAS_CRASH_ROOT";
const SEED_ENV: &str = "TCG_CAS_CRASH_SEED";
const PHASES: usize = 5;
const KILLS: usize = 250;

/// Child mode: write forever, announcing each phase on stdout before entering it.
#[test]
fn child_writes_objects_manifests_refs_and_collects_in_a_loop() {
    let Ok(root) = std::env::var(ROOT_ENV) else {
        return;
    };
    let seed: u64 = std::env::var(SEED_ENV).unwrap().parse().unwrap();
    let store = small_store(&PathBuf::from(root));
    let mut rng = Rng(seed | 1);
    let say = |p: usize| println!("PHASE {p}");
    for i in 0u64.. {
        let lease = store.lease().unwrap();
        say(0);
        let n = rng.below(40_000) as usize;
        store.put_bytes(&lease, &bytes(rng.next(), n)).unwrap();
        say(1);
        let n = rng.below(6 * SMALL_CHUNK) as usize;
        let info = store
            .ingest_reader(&lease, &bytes(rng.next(), n)[..])
            .unwrap();
        say(2);
        let name = format!("crash/{}", i % 3);
        let t = Target::manifest(info.manifest);
        let cur = store.get_ref(&name).unwrap();
        assert_eq!(
            store
                .compare_and_swap(&name, cur.as_ref(), Some(&t))
                .unwrap(),
            CasOutcome::Matched
        );
        say(3);
        if rng.below(3) == 0 {
            store.compare_and_swap(&name, Some(&t), None).unwrap();
        }
        lease.end().unwrap();
        say(4);
        store.gc(&GcOptions::default()).unwrap();
    }
}

#[test]
fn sigkill_at_any_point_leaves_no_corrupt_object_no_dangling_ref_and_reapable_temps() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("s");
    let store = small_store(&root);
    let mut rng = Rng::seeded();
    let mut per_phase = [0usize; PHASES];
    for k in 0..KILLS {
        let target = k % PHASES;
        let mut c = child("child_writes_objects_manifests_refs_and_collects_in_a_loop")
            .env(ROOT_ENV, &root)
            .env(SEED_ENV, rng.next().to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(c.stdout.take().unwrap()).lines();
        let phase_of = |l: &str| {
            l.split_once("PHASE ")
                .map(|(_, p)| p.trim().parse::<usize>().unwrap())
        };
        // Skip 0-2 iterations of the target phase, then kill after a random delay.
        let mut skip = rng.below(3);
        let mut last;
        loop {
            let l = lines.next().expect("child alive").unwrap();
            if let Some(p) = phase_of(&l) {
                last = Some(p);
                if p == target {
                    if skip == 0 {
                        break;
                    }
                    skip -= 1;
                }
            }
        }
        // Half the kills land right after the announcement (short phases),
        // the rest anywhere in the next few milliseconds (long phases).
        if rng.below(2) == 0 {
            std::thread::sleep(Duration::from_micros(rng.below(3000)));
        }
        c.kill().unwrap();
        let status = c.wait().unwrap();
        assert!(
            !status.success(),
            "child must have been killed, not finished"
        );
        for l in lines {
            if let Some(p) = l.ok().as_deref().and_then(phase_of) {
                last = Some(p);
            }
        }
        per_phase[last.unwrap()] += 1;

        assert_fsck_clean(&store);
        for e in store.list_refs("crash/").unwrap().entries {
            let lease = store.lease().unwrap();
            let mut r = store.open_file(&lease, &e.target.digest, true).unwrap();
            std::io::copy(&mut r, &mut std::io::sink()).unwrap();
        }
        // fsck's reap pass removed the dead child's lease and temps.
        assert!(dir_entries(&root.join("tmp")).is_empty(), "kill {k}");
        assert!(dir_entries(&root.join("leases")).is_empty(), "kill {k}");
        if k % 10 == 9 {
            store.gc(&GcOptions::default()).unwrap();
            assert_fsck_clean(&store);
        }
    }
    eprintln!("kills per phase: {per_phase:?}");
    assert!(
        per_phase.iter().all(|n| *n >= 5),
        "kills per phase: {per_phase:?}"
    );
}
