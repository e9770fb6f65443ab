//! The engine's trust boundary against a hostile local user: nothing verified
//! is re-read from a place someone else can write, the admitted copy is bound
//! to its envelope, races and damage outside the store never quarantine, and
//! destinations and stages are handled safely. Races use real processes.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use tcg_cas::{name_hash, Target};
use tcg_core::engine::{admitted_ref, graph_ref, quarantine_ref, Engine, StoreOutcome};
use tcg_core::{Code, Kind};

const CHILD: &str = "TCG_HARDENING_TEST_CHILD";

fn engine(dir: &Path) -> Engine {
    Engine::open(dir.join("store")).unwrap()
}

fn manifest_of(e: &Engine) -> tcg_cas::Digest {
    e.store().get_ref(&graph_ref(KEY)).unwrap().unwrap().digest
}

fn assert_not_quarantined(e: &Engine) {
    let m = manifest_of(e);
    assert!(
        e.store()
            .get_ref(&quarantine_ref(KEY, &m))
            .unwrap()
            .is_none(),
        "a record with intact stored bytes was quarantined"
    );
}

fn drop_admitted_copy(e: &Engine, m: &tcg_cas::Digest) {
    for member in [
        "record",
        "metadata.json",
        "model.pt2",
        "constants.safetensors",
    ] {
        let name = admitted_ref(KEY, m, member);
        if let Some(t) = e.store().get_ref(&name).unwrap() {
            e.store().compare_and_swap(&name, Some(&t), None).unwrap();
        }
    }
}

fn spawn(test: &str, role: &str, dir: &Path) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, format!("{role}:{}", dir.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn child_role() -> Option<(String, PathBuf)> {
    let v = std::env::var(CHILD).ok()?;
    let (role, dir) = v.split_once(':')?;
    Some((role.to_string(), PathBuf::from(dir)))
}

#[test]
fn a_member_ref_repointed_at_other_bytes_is_never_served() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    e.import_artifact(KEY, &reference()).unwrap();
    let m = manifest_of(&e);
    let want = tree(&members(d.path()));
    // Re-point the admitted model.pt2 ref, through the public CAS, at a
    // well-formed file of other bytes.
    let lease = e.store().lease().unwrap();
    let bogus = e
        .store()
        .ingest_reader(&lease, &b"not the verified package"[..])
        .unwrap();
    let name = admitted_ref(KEY, &m, "model.pt2");
    let current = e.store().get_ref(&name).unwrap().unwrap();
    e.store()
        .compare_and_swap(
            &name,
            Some(&current),
            Some(&Target::manifest(bogus.manifest)),
        )
        .unwrap();
    lease.end().unwrap();
    let out = d.path().join("out");
    e.resolve(KEY, &out).unwrap().unwrap();
    assert_eq!(tree(&out), want, "the re-pointed member was served");
    assert_not_quarantined(&e);
    // The copy was recorded afresh from the envelope and serves again.
    let again = d.path().join("again");
    e.resolve(KEY, &again).unwrap().unwrap();
    assert_eq!(tree(&again), want);

    // A binding record of another key, planted under this key, is not accepted either.
    let (other, other_env) = other_key_envelope(d.path(), "torch-x");
    e.import_artifact(&other, &other_env).unwrap();
    let om = e
        .store()
        .get_ref(&graph_ref(&other))
        .unwrap()
        .unwrap()
        .digest;
    for member in ["record", "model.pt2", "metadata.json"] {
        let theirs = e
            .store()
            .get_ref(&admitted_ref(&other, &om, member))
            .unwrap()
            .unwrap();
        let ours_name = admitted_ref(KEY, &m, member);
        let ours = e.store().get_ref(&ours_name).unwrap();
        e.store()
            .compare_and_swap(&ours_name, ours.as_ref(), Some(&theirs))
            .unwrap();
    }
    let third = d.path().join("third");
    let r = e.resolve(KEY, &third).unwrap().unwrap();
    assert_eq!(r.metadata.key(), KEY);
    assert_eq!(tree(&third), want);
}

/// Overwrite the start of every file under every dot-entry of `parent`
/// (the stages and temps beside a destination) until `stop`.
fn tamper(parent: PathBuf, stop: Arc<AtomicBool>) -> u64 {
    let mut hits = 0;
    let garbage = [0x5au8; 4096];
    while !stop.load(Ordering::Relaxed) {
        let Ok(rd) = std::fs::read_dir(&parent) else {
            continue;
        };
        for e in rd.flatten() {
            if !e.file_name().to_string_lossy().starts_with('.') {
                continue;
            }
            let p = e.path();
            let files: Vec<PathBuf> = match std::fs::read_dir(&p) {
                Ok(inner) => inner.flatten().map(|f| f.path()).collect(),
                Err(_) => vec![p.clone()],
            };
            for f in files {
                if let Ok(file) = std::fs::OpenOptions::new().write(true).open(&f) {
                    use std::os::unix::fs::FileExt;
                    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
                    if len > 0
                        && file
                            .write_at(&garbage[..len.min(4096) as usize], len / 2)
                            .is_ok()
                    {
                        hits += 1;
                    }
                }
            }
        }
    }
    hits
}

#[test]
fn tampering_beside_the_destination_never_poisons_the_store_nor_quarantines() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    e.import_artifact(KEY, &reference()).unwrap();
    let m = manifest_of(&e);
    let want = tree(&members(d.path()));
    let outs = d.path().join("outs");
    std::fs::create_dir(&outs).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let tamperer = {
        let (outs, stop) = (outs.clone(), stop.clone());
        std::thread::spawn(move || tamper(outs, stop))
    };
    for i in 0..12 {
        // Half of the resolves read the envelope (no admitted copy), half the copy.
        if i % 2 == 0 {
            drop_admitted_copy(&e, &m);
        }
        match e.resolve(KEY, &outs.join(format!("r{i}"))) {
            Ok(r) => assert!(r.is_some()),
            Err(err) => assert_ne!(err.kind(), Kind::Quarantined, "{err}"),
        }
        match e.export_artifact(KEY, &outs.join(format!("x{i}.tar.gz"))) {
            Ok(_) => {}
            Err(err) => assert_ne!(err.kind(), Kind::Quarantined, "{err}"),
        }
    }
    stop.store(true, Ordering::Relaxed);
    let hits = tamperer.join().unwrap();
    assert!(hits > 0, "the tamperer never reached a stage");
    assert_not_quarantined(&e);
    // What the store admitted is exactly the verified members.
    let clean = d.path().join("clean");
    e.resolve(KEY, &clean).unwrap().unwrap();
    assert_eq!(tree(&clean), want);
    let (report, ok) = e.fsck(false).unwrap();
    assert!(ok, "{report:?}");
}

#[test]
fn resolving_while_another_process_evicts_never_quarantines() {
    if let Some((role, dir)) = child_role() {
        if role == "gc" {
            // Evict everything evictable, at irregular intervals, until told to stop.
            let e = engine(&dir);
            let mut n = 0u64;
            while !dir.join("stop").exists() {
                e.gc(Some(1)).unwrap();
                n += 1;
                std::thread::sleep(Duration::from_millis((n * 337) % 1200));
            }
        }
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    let mut gc = spawn(
        "resolving_while_another_process_evicts_never_quarantines",
        "gc",
        d.path(),
    );
    let start = Instant::now();
    let (mut served, mut moved, mut i) = (0, 0, 0);
    while start.elapsed() < Duration::from_secs(10) || served < 3 || moved < 1 {
        i += 1;
        if e.store().get_ref(&graph_ref(KEY)).unwrap().is_none() {
            e.import_artifact(KEY, &reference()).unwrap();
        }
        match e.resolve(KEY, &d.path().join(format!("out{i}"))) {
            Ok(Some(_)) => served += 1,
            Ok(None) => {}
            Err(err) => {
                assert_ne!(err.kind(), Kind::Quarantined, "{err}");
                assert_eq!(err.code(), Code::StoreRefMoved, "{err}");
                moved += 1;
            }
        }
        if start.elapsed() > Duration::from_secs(120) {
            break;
        }
    }
    std::fs::write(d.path().join("stop"), b"").unwrap();
    assert!(gc.wait().unwrap().success());
    eprintln!("{i} resolves: {served} served, {moved} saw their record evicted meanwhile");
    assert!(served > 0, "no resolve was served");
    let listing = e.store().list_refs(tcg_cas::QUARANTINE_REF_PREFIX).unwrap();
    assert!(listing.entries.is_empty(), "{:?}", listing.entries);
}

#[test]
fn an_unreadable_graph_ref_is_repaired_by_import_and_moved_aside_by_fsck() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    e.import_artifact(KEY, &reference()).unwrap();
    let rec = d.path().join("store/refs").join(name_hash(&graph_ref(KEY)));
    let truncate = || {
        let bytes = std::fs::read(&rec).unwrap();
        std::fs::write(&rec, &bytes[..bytes.len() / 2]).unwrap();
    };
    truncate();
    let err = e.gc(None).unwrap_err();
    assert_eq!(err.code(), Code::StoreGcAborted);
    assert!(err.message().contains("fsck --quarantine"), "{err}");
    // Importing the valid envelope repairs the key.
    let r = e.import_artifact(KEY, &reference()).unwrap();
    assert_eq!(r.outcome, StoreOutcome::Repaired);
    e.resolve(KEY, &d.path().join("a")).unwrap().unwrap();
    e.gc(None).unwrap();
    // fsck --quarantine moves an unreadable record aside, after which GC runs.
    truncate();
    let (report, clean) = e.fsck(true).unwrap();
    assert!(!clean);
    let text = tcg_cj::to_canonical_string(&report).unwrap();
    assert!(text.contains("store.ref_invalid"), "{text}");
    e.gc(None).unwrap();
    assert_eq!(
        e.resolve(KEY, &d.path().join("b")).unwrap().map(|_| ()),
        None
    );
    assert_eq!(
        e.import_artifact(KEY, &reference()).unwrap().outcome,
        StoreOutcome::Stored
    );
}

#[test]
fn destinations_inside_the_store_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    e.import_artifact(KEY, &reference()).unwrap();
    let root = d.path().join("store");
    for dest in [
        root.join("objects/sha256/model"),
        root.join("objects/sha256/ab/new/x"),
        root.join("out"),
        d.path().join("store/../store/tmp/x"),
    ] {
        let err = e.resolve(KEY, &dest).unwrap_err();
        assert_eq!(
            err.code(),
            Code::StoreDestinationInStore,
            "{}",
            dest.display()
        );
        assert!(!dest.exists());
    }
    let err = e
        .export_artifact(KEY, &root.join("objects/x.tar.gz"))
        .unwrap_err();
    assert_eq!(err.code(), Code::StoreDestinationInStore);
    // A symlink from outside into the store is resolved before the check.
    let link = d.path().join("link");
    std::os::unix::fs::symlink(root.join("objects"), &link).unwrap();
    let err = e.resolve(KEY, &link.join("m")).unwrap_err();
    assert_eq!(err.code(), Code::StoreDestinationInStore);
    e.gc(None).unwrap();
    let (_, clean) = e.fsck(false).unwrap();
    assert!(clean);
}

#[test]
fn a_pre_created_empty_directory_keeps_its_mode() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    e.import_artifact(KEY, &reference()).unwrap();
    let m = manifest_of(&e);
    for (i, via_envelope) in [(0, true), (1, false), (2, true)] {
        if via_envelope {
            drop_admitted_copy(&e, &m);
        }
        let dest = d.path().join(format!("private{i}"));
        std::fs::create_dir(&dest).unwrap();
        let mode = if i == 2 { 0o750 } else { 0o700 };
        std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(mode)).unwrap();
        e.resolve(KEY, &dest).unwrap().unwrap();
        assert_eq!(std::fs::metadata(&dest).unwrap().mode() & 0o7777, mode);
        assert!(dest.join("model.pt2").exists());
    }
    // A fresh destination is published 0755 & ~umask, never the stage's 0700.
    let fresh = d.path().join("fresh");
    e.resolve(KEY, &fresh).unwrap().unwrap();
    // SAFETY: reading the umask by setting it back at once.
    let umask = unsafe {
        let u = libc::umask(0o022);
        libc::umask(u);
        u
    };
    assert_eq!(
        std::fs::metadata(&fresh).unwrap().mode() & 0o7777,
        0o755 & !(umask as u32)
    );
}

#[test]
fn a_killed_resolve_leaves_a_stage_that_the_next_resolve_removes() {
    if let Some((role, dir)) = child_role() {
        if role == "resolve" {
            let e = engine(&dir);
            let dest = dir.join("outs/dest");
            loop {
                e.resolve(KEY, &dest).unwrap().unwrap();
                std::fs::remove_dir_all(&dest).unwrap();
            }
        }
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    e.import_artifact(KEY, &reference()).unwrap();
    let outs = d.path().join("outs");
    std::fs::create_dir(&outs).unwrap();
    let dest = outs.join("dest");
    let mut left = Vec::new();
    for _attempt in 0..40 {
        let mut child = spawn(
            "a_killed_resolve_leaves_a_stage_that_the_next_resolve_removes",
            "resolve",
            d.path(),
        );
        let start = Instant::now();
        loop {
            let staged = std::fs::read_dir(&outs)
                .unwrap()
                .flatten()
                .any(|e| e.file_name().to_string_lossy().contains(".tcg-stage."));
            if staged || start.elapsed() > Duration::from_secs(30) {
                break;
            }
        }
        // SAFETY: killing our own child by its pid.
        unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
        child.wait().unwrap();
        left = leftovers(&dest);
        if !left.is_empty() {
            break;
        }
        let _ = std::fs::remove_dir_all(&dest);
    }
    assert!(
        !left.is_empty(),
        "no resolve was killed while its stage existed"
    );
    // The next resolve to that destination removes the dead stage.
    let _ = std::fs::remove_dir_all(&dest);
    e.resolve(KEY, &dest).unwrap().unwrap();
    assert!(leftovers(&dest).is_empty(), "dead stages stayed: {left:?}");
    // A live stage (its creator alive) is left alone: hold one ourselves.
    let live = tcg_core::artifact::publish::Temp::stage_dir(&dest).unwrap();
    std::fs::remove_dir_all(&dest).unwrap();
    e.resolve(KEY, &dest).unwrap().unwrap();
    let now = leftovers(&dest);
    assert_eq!(now, vec![live.path().to_path_buf()]);
    drop(live);
    assert!(leftovers(&dest).is_empty());
}

#[test]
fn the_counter_file_is_never_written_through_a_symlink() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(d.path());
    let victim = d.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let stats = d.path().join("store/stats");
    let _ = std::fs::remove_file(&stats);
    std::os::unix::fs::symlink(&victim, &stats).unwrap();
    assert!(e.resolve(KEY, &d.path().join("out")).unwrap().is_none());
    e.stats().unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
}

#[test]
fn a_read_only_open_of_a_mistyped_root_creates_nothing() {
    let d = tempfile::tempdir().unwrap();
    let typo = d.path().join("stroe");
    let err = Engine::open_existing(&typo).unwrap_err();
    assert_eq!(err.code(), Code::StoreNotFound);
    assert!(!typo.exists());
}
