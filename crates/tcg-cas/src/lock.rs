//! Named single-flight locks (SPEC-v1 §10.8).

use std::fs::{self, File};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::thread::sleep;
use std::time::{Duration, Instant};

use crate::digest::name_hash;
use crate::error::{io_err, Result, StoreError};
use crate::fsutil;
use crate::Store;

/// An exclusive `flock` on `locks/mint/<hex64(sha256(name))>`. Released when
/// dropped, or by the kernel when the holder dies.
#[derive(Debug)]
pub struct NamedLock {
    _file: File,
    path: PathBuf,
}

impl NamedLock {
    /// The lock file.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }
}

impl Store {
    /// Take the named lock, waiting forever (`None`) or up to `timeout`
    /// (`store.mint_lock_timeout`). After acquiring, the holder checks that the
    /// path still names the locked inode (GC may have removed the file) and
    /// retries if not. Correctness never depends on this lock.
    pub fn lock_named(&self, name: &str, timeout: Option<Duration>) -> Result<NamedLock> {
        let path = self.dir("locks/mint").join(name_hash(name));
        let start = Instant::now();
        let mut nap = Duration::from_millis(1);
        loop {
            let file = fsutil::open_lock_file(&path)?;
            let got = match timeout {
                None => fsutil::flock(&file, true, false).map_err(io_err("flock", &path))?,
                Some(_) => fsutil::flock(&file, true, true).map_err(io_err("flock", &path))?,
            };
            if got {
                let held = file.metadata().map_err(io_err("fstat", &path))?;
                match fs::symlink_metadata(&path) {
                    Ok(now) if now.ino() == held.ino() && now.dev() == held.dev() => {
                        return Ok(NamedLock { _file: file, path });
                    }
                    _ => continue, // removed by GC meanwhile: lock the new file
                }
            }
            drop(file);
            let limit = timeout.expect("blocking flock always acquires");
            let waited = start.elapsed();
            if waited >= limit {
                return Err(StoreError::MintLockTimeout {
                    name: name.to_string(),
                    waited,
                });
            }
            sleep(nap.min(limit - waited));
            nap = (nap * 2).min(Duration::from_millis(50));
        }
    }
}
