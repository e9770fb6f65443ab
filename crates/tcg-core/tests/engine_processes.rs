//! Engine behaviours across real processes: single-flight minting, a killed
//! minter, and a full filesystem at the destination.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use tcg_core::engine::{graph_ref, quarantine_ref, Engine, EnsureOutcome, Request};
use tcg_core::Code;

const CHILD: &str = "TCG_ENGINE_TEST_CHILD";

fn request() -> Request {
    let md = tcg_core::artifact::read_metadata(&reference()).unwrap();
    Request::new("cpu", &md.value()["toolchain"]).unwrap()
}

fn spawn(test: &str, role: &str, dir: &Path, index: usize) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, format!("{role}:{}:{index}", dir.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

/// In a child: run `ensure`, counting mints in `dir/mints` (one line each).
fn child_ensure(dir: &Path, index: usize, hold: Duration) {
    let e = Engine::open(dir.join("store")).unwrap();
    let mut mint = || {
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("mints"))
            .unwrap();
        std::io::Write::write_all(&mut log, format!("{index}\n").as_bytes()).unwrap();
        std::fs::write(dir.join("minting"), b"").unwrap();
        std::thread::sleep(hold);
        Ok(reference_mint(&dir.join(format!("work{index}"))))
    };
    let out = dir.join(format!("out{index}"));
    let r = e.ensure(KEY, &out, &request(), &mut mint).unwrap();
    std::fs::write(dir.join(format!("done{index}")), r.outcome.as_str()).unwrap();
}

fn child_role() -> Option<(String, PathBuf, usize)> {
    let v = std::env::var(CHILD).ok()?;
    let mut parts = v.splitn(3, ':');
    let role = parts.next()?.to_string();
    let dir = PathBuf::from(parts.next()?);
    let index = parts.next()?.parse().ok()?;
    Some((role, dir, index))
}

#[test]
fn eight_processes_ensuring_one_key_compile_once_and_get_identical_directories() {
    if let Some((role, dir, index)) = child_role() {
        if role == "ensure" {
            child_ensure(&dir, index, Duration::from_millis(500));
        }
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let children: Vec<Child> = (0..8)
        .map(|i| {
            spawn(
                "eight_processes_ensuring_one_key_compile_once_and_get_identical_directories",
                "ensure",
                d.path(),
                i,
            )
        })
        .collect();
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
    let mints = std::fs::read_to_string(d.path().join("mints")).unwrap();
    assert_eq!(mints.lines().count(), 1, "minted more than once: {mints:?}");
    let first = tree(&d.path().join("out0"));
    let mut outcomes = Vec::new();
    for i in 0..8 {
        assert_eq!(tree(&d.path().join(format!("out{i}"))), first);
        outcomes.push(std::fs::read_to_string(d.path().join(format!("done{i}"))).unwrap());
    }
    assert_eq!(outcomes.iter().filter(|o| *o == "MINTED").count(), 1);
    assert_eq!(outcomes.iter().filter(|o| *o == "REUSED").count(), 7);
}

#[test]
fn a_minter_killed_with_sigkill_releases_the_lock_and_the_next_ensure_mints() {
    if let Some((role, dir, index)) = child_role() {
        if role == "hang" {
            child_ensure(&dir, index, Duration::from_secs(600));
        }
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let mut child = spawn(
        "a_minter_killed_with_sigkill_releases_the_lock_and_the_next_ensure_mints",
        "hang",
        d.path(),
        0,
    );
    let started = Instant::now();
    while !d.path().join("minting").exists() {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the child never started minting"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: plain kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    child.wait().unwrap();
    let e = Engine::open(d.path().join("store"))
        .unwrap()
        .with_lock_timeout(Some(Duration::from_secs(30)));
    let mut called = 0;
    let mut mint = || {
        called += 1;
        Ok(reference_mint(&d.path().join("parent")))
    };
    let r = e
        .ensure(KEY, &d.path().join("out"), &request(), &mut mint)
        .unwrap();
    assert_eq!(r.outcome, EnsureOutcome::Minted);
    assert_eq!(called, 1);
}

struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(path: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(path).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(path)
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "this test needs `mount -t tmpfs` (run as root)");
        Tmpfs(path.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn a_full_disk_at_the_destination_is_an_io_error_and_never_quarantines() {
    let d = tempfile::tempdir().unwrap();
    let e = Engine::open(d.path().join("store")).unwrap();
    e.import_artifact(KEY, &reference()).unwrap();
    let small = Tmpfs::mount(&d.path().join("small"), "512k");
    let out = small.0.join("out");
    let err = e.resolve(KEY, &out).unwrap_err();
    assert_eq!(err.code(), Code::IoError, "{err}");
    assert_eq!(err.errno(), Some(libc::ENOSPC));
    assert!(!out.exists() && leftovers(&out).is_empty());
    let target = e.store().get_ref(&graph_ref(KEY)).unwrap().unwrap();
    assert!(e
        .store()
        .get_ref(&quarantine_ref(KEY, &target.digest))
        .unwrap()
        .is_none());
    let err = e.export_artifact(KEY, &small.0.join("x.tar.gz"));
    // The export fits in 512 KiB; a resolve (1.6 MiB unpacked) does not.
    assert!(err.is_ok(), "{err:?}");
    e.resolve(KEY, &d.path().join("elsewhere"))
        .unwrap()
        .unwrap();
    drop(small);
    let tiny = Tmpfs::mount(&d.path().join("tiny"), "64k");
    let err = e
        .export_artifact(KEY, &tiny.0.join("y.tar.gz"))
        .unwrap_err();
    assert_eq!(err.errno(), Some(libc::ENOSPC), "{err}");
    assert!(!tiny.0.join("y.tar.gz").exists() && leftovers(&tiny.0.join("y.tar.gz")).is_empty());
    assert!(e
        .store()
        .get_ref(&quarantine_ref(KEY, &target.digest))
        .unwrap()
        .is_none());
}
