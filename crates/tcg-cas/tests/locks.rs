//! Named (mint) locks: exclusive, timed waits, released when the holder dies.

mod common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use common::*;
use tcg_cas::{name_hash, Store};

const CHILD_ENV: &str = "TCG_CAS_LOCK_CHILD_ROOT";

/// Child mode: take the named lock and hold it until killed.
#[test]
fn child_holds_the_named_lock_until_killed() {
    let Ok(root) = std::env::var(CHILD_ENV) else {
        return;
    };
    let store = Store::open(PathBuf::from(root)).unwrap();
    let _g = store.lock_named("key-1", None).unwrap();
    println!("LOCKED");
    std::thread::sleep(Duration::from_secs(600));
}

#[test]
fn mint_lock_is_released_when_its_holder_is_sigkilled() {
    let (_d, store) = new_store();
    let mut c = child("child_holds_the_named_lock_until_killed")
        .env(CHILD_ENV, store.root())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(c.stdout.take().unwrap()).lines();
    // The harness prints "test <name> ... " before the child's own output.
    while !lines
        .next()
        .expect("child output")
        .unwrap()
        .contains("LOCKED")
    {}
    let e = store
        .lock_named("key-1", Some(Duration::from_millis(30)))
        .unwrap_err();
    assert_eq!(e.code(), "store.mint_lock_timeout");
    // Another name is independent.
    drop(store.lock_named("key-2", Some(Duration::ZERO)).unwrap());
    c.kill().unwrap();
    c.wait().unwrap();
    let g = store.lock_named("key-1", None).unwrap();
    assert!(g
        .path()
        .ends_with(format!("locks/mint/{}", name_hash("key-1"))));
}

#[test]
fn named_lock_is_exclusive_between_threads_and_survives_gc_removing_its_file() {
    let (_d, store) = new_store();
    let g = store.lock_named("k", None).unwrap();
    let s2 = store.clone();
    let waiter = std::thread::spawn(move || {
        let g2 = s2.lock_named("k", None).unwrap();
        g2.path().to_owned()
    });
    std::thread::sleep(Duration::from_millis(20));
    assert!(!waiter.is_finished());
    // GC cannot remove a held lock file.
    assert_eq!(store.gc(&Default::default()).unwrap().mint_locks_removed, 0);
    drop(g);
    waiter.join().unwrap();
    assert_eq!(store.gc(&Default::default()).unwrap().mint_locks_removed, 1);
    drop(store.lock_named("k", Some(Duration::ZERO)).unwrap());
}
