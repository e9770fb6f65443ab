//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::Path;
use std::process::Command;

use tcg_cas::{FsckOptions, Store, StoreOptions};

/// A small chunk length so that multi-chunk manifests stay cheap in tests.
pub const SMALL_CHUNK: u64 = 16 * 1024;

pub fn new_store() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path().join("store")).expect("open store");
    (dir, store)
}

pub fn small_store(root: &Path) -> Store {
    Store::open_with(
        root,
        StoreOptions {
            chunk_bytes: SMALL_CHUNK,
        },
    )
    .expect("open small-chunk store")
}

/// Deterministic pseudo-random bytes (xorshift64*).
pub fn bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.truncate(n);
    out
}

/// A cheap random generator for kill points and sizes (not for content identity).
pub struct Rng(pub u64);

impl Rng {
    pub fn seeded() -> Rng {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        Rng(t | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Re-run this test binary as a child running only `test` (exact name).
pub fn child(test: &str) -> Command {
    let mut c = Command::new(std::env::current_exe().expect("current exe"));
    c.args([test, "--exact", "--nocapture", "--test-threads=1"]);
    c
}

/// fsck finds nothing corrupt and every ref closed.
pub fn assert_fsck_clean(store: &Store) {
    let r = store.fsck(FsckOptions::default()).expect("fsck runs");
    assert!(
        r.corrupt.is_empty(),
        "fsck found corrupt objects: {:?}",
        r.corrupt
    );
    assert!(
        r.dangling_refs.is_empty(),
        "fsck found dangling refs: {:?}",
        r.dangling_refs
    );
}

pub fn dir_entries(p: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(p)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}
