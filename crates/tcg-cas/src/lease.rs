//! Leases and pins (SPEC-v1 §9.7).
//!
//! A lease is `leases/<32 hex>`, created exclusively under the shared store
//! lock and held under an exclusive `flock` for its whole life. Pins are
//! appended as `<64 hex>\n` under the shared store lock before the holder
//! relies on an object. GC reaps under the exclusive store lock, so creation
//! (open + flock) is atomic with respect to every reaper.

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{io_err, Result, StoreError};
use crate::fsutil;
use crate::{Digest, Store};

/// A live lease: a GC root for every digest it pins, and the owner of its
/// temps. Ends on [`Lease::end`] or on drop; a killed holder's lease is dead
/// (its `flock` is gone) and is reaped by the next GC.
#[derive(Debug)]
pub struct Lease {
    core: Arc<LeaseCore>,
}

/// The shared part of a lease, so that a writer's helper thread can pin and
/// create temps; the [`Lease`] owner ends it.
#[derive(Debug)]
pub(crate) struct LeaseCore {
    store: Store,
    id: String,
    path: PathBuf,
    file: Mutex<Option<File>>,
    next_temp: AtomicU64,
    pinned: Mutex<HashSet<Digest>>,
}

impl Store {
    /// Start a lease (`leases/<32 hex>`, exclusive `flock` held until it ends).
    pub fn lease(&self) -> Result<Lease> {
        let _shared = self.shared_lock()?;
        let dir = self.dir("leases");
        loop {
            let id = fsutil::random_hex32();
            let path = dir.join(&id);
            // Created, then held read-only: flock needs no write access, and a
            // store with no file open for writing can be remounted read-only.
            let file = match OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o644)
                .open(&path)
            {
                Ok(f) => f,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io_err("create lease", &path)(e)),
            };
            drop(file);
            let file = OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                .open(&path)
                .map_err(io_err("open lease", &path))?;
            if !fsutil::flock(&file, true, true).map_err(io_err("flock", &path))? {
                // Cannot happen under the shared store lock; do not rely on it.
                continue;
            }
            return Ok(Lease {
                core: Arc::new(LeaseCore {
                    store: self.clone(),
                    id,
                    path,
                    file: Mutex::new(Some(file)),
                    next_temp: AtomicU64::new(0),
                    pinned: Mutex::new(HashSet::new()),
                }),
            });
        }
    }
}

impl Lease {
    /// The 32-hex id of this lease.
    pub fn id(&self) -> &str {
        &self.core.id
    }

    /// The store this lease belongs to.
    pub fn store(&self) -> &Store {
        &self.core.store
    }

    /// Pin digests (GC roots while this lease lives). Takes the shared store lock.
    pub fn pin(&self, digests: &[Digest]) -> Result<()> {
        self.core.pin(digests)
    }

    /// Whether this lease has pinned `digest`.
    pub fn is_pinned(&self, digest: &Digest) -> bool {
        self.core
            .pinned
            .lock()
            .expect("pin set poisoned")
            .contains(digest)
    }

    pub(crate) fn core(&self) -> &Arc<LeaseCore> {
        &self.core
    }

    pub(crate) fn create_temp(&self) -> Result<TempFile> {
        self.core.create_temp()
    }

    /// End the lease: remove its file (still under its lock) and any temps it
    /// left behind. Equivalent to dropping it, but reports errors.
    pub fn end(self) -> Result<()> {
        self.core.end()
    }
}

impl LeaseCore {
    pub(crate) fn pin(&self, digests: &[Digest]) -> Result<()> {
        let _shared = self.store.shared_lock()?;
        for d in digests {
            self.pin_locked(d)?;
        }
        Ok(())
    }

    /// Append a pin; the caller holds the shared store lock.
    pub(crate) fn pin_locked(&self, d: &Digest) -> Result<()> {
        let mut set = self.pinned.lock().expect("pin set poisoned");
        if set.contains(d) {
            return Ok(());
        }
        let line = format!("{}\n", d.to_hex());
        // One write(2) of a whole line on an O_APPEND descriptor; opened per pin
        // so that no store file stays open for writing between operations.
        let mut f = OpenOptions::new()
            .append(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&self.path)
            .map_err(io_err("open lease", &self.path))?;
        f.write_all(line.as_bytes())
            .map_err(io_err("append pin", &self.path))?;
        set.insert(*d);
        Ok(())
    }

    /// Create an exclusive temp `tmp/<id>.<n>` owned by this lease.
    pub(crate) fn create_temp(&self) -> Result<TempFile> {
        loop {
            let n = self.next_temp.fetch_add(1, Ordering::Relaxed);
            let path = self.store.dir("tmp").join(format!("{}.{}", self.id, n));
            match OpenOptions::new()
                .write(true)
                .read(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
            {
                Ok(file) => {
                    return Ok(TempFile {
                        path,
                        file: Some(file),
                    })
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io_err("create temp", &path)(e)),
            }
        }
    }

    fn end(&self) -> Result<()> {
        let Some(file) = self.file.lock().expect("lease file poisoned").take() else {
            return Ok(());
        };
        let res = match fs::remove_file(&self.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err("remove lease", &self.path)(e)),
        };
        remove_temps_of(&self.store.dir("tmp"), &self.id);
        drop(file);
        res
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let _ = self.core.end();
    }
}

/// Remove `tmp/<id>.*` (best effort).
pub(crate) fn remove_temps_of(tmp: &Path, id: &str) -> u64 {
    let mut n = 0;
    let Ok(rd) = fs::read_dir(tmp) else { return 0 };
    let prefix = format!("{id}.");
    for e in rd.flatten() {
        if e.file_name().to_string_lossy().starts_with(&prefix) && fs::remove_file(e.path()).is_ok()
        {
            n += 1;
        }
    }
    n
}

/// A temp file removed on drop unless [`TempFile::keep`] was called.
#[derive(Debug)]
pub(crate) struct TempFile {
    pub(crate) path: PathBuf,
    pub(crate) file: Option<File>,
}

impl TempFile {
    pub(crate) fn file(&mut self) -> &mut File {
        self.file.as_mut().expect("temp file open")
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        self.file.take();
        let _ = fs::remove_file(&self.path);
    }
}

/// The liveness of one lease file, decided by trying its `flock`.
pub(crate) enum LeaseState {
    /// Held by a live process; its pins.
    Live(Vec<Digest>),
    /// Dead; the file was removed (with the lock held).
    Reaped,
    /// Vanished meanwhile.
    Gone,
}

/// Check a lease file; reap it when dead. Call under the exclusive store lock.
pub(crate) fn probe_lease(path: &Path) -> Result<LeaseState> {
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(LeaseState::Gone),
        Err(e) => return Err(io_err("open lease", path)(e)),
    };
    if fsutil::flock(&file, true, true).map_err(io_err("flock", path))? {
        match fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(LeaseState::Gone),
            Err(e) => return Err(io_err("remove lease", path)(e)),
        }
        return Ok(LeaseState::Reaped);
    }
    // Read through the descriptor just probed, not the path: a holder may end
    // its lease (unlink the file, drop the lock) at any moment, and the pins
    // read here then belong to a lease that was live when probed (keeping
    // them one more pass is safe; failing the pass is not).
    let mut text = Vec::new();
    (&file)
        .read_to_end(&mut text)
        .map_err(io_err("read lease", path))?;
    let mut pins = Vec::new();
    for line in text.split(|b| *b == b'\n') {
        if let Some(d) = std::str::from_utf8(line).ok().and_then(Digest::from_hex) {
            pins.push(d);
        }
    }
    Ok(LeaseState::Live(pins))
}

pub(crate) fn is_lease_id(name: &str) -> bool {
    tcg_cj::is_hex(name, 32)
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn f<T: Send + Sync>() {}
    f::<Lease>();
    f::<Store>();
    f::<StoreError>();
}
