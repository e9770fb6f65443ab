//! Garbage collection by reachability and lease liveness only (SPEC-v1 §9.7),
//! with an optional size budget, and store statistics.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{io_err, Result, StoreError};
use crate::fsutil;
use crate::lease::{is_lease_id, probe_lease, remove_temps_of, LeaseState};
use crate::refs::RefKind;
use crate::{Digest, Store};

/// Options of [`Store::gc`].
#[derive(Clone, Debug, Default)]
pub struct GcOptions {
    /// When set, refs under `evict_prefix` are deleted, least recently used
    /// first (see [`Store::record_use`]), until the bytes reachable from refs
    /// and live leases are at most this many. Refs outside the prefix and
    /// leases are never evicted, so the budget may stay exceeded.
    pub max_bytes: Option<u64>,
    /// The prefix of evictable refs (the engine passes [`crate::GRAPH_REF_PREFIX`]).
    pub evict_prefix: String,
}

/// What a GC pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Objects examined in the sweep.
    pub examined_objects: u64,
    /// Objects kept (reachable or pinned).
    pub kept_objects: u64,
    /// Bytes of the kept objects.
    pub kept_bytes: u64,
    /// Objects deleted.
    pub freed_objects: u64,
    /// Bytes of the deleted objects.
    pub freed_bytes: u64,
    /// Refs read in the mark phase.
    pub refs: u64,
    /// Refs deleted by the size budget, in eviction order.
    pub evicted_refs: Vec<String>,
    /// Live leases whose pins were marked.
    pub live_leases: u64,
    /// Dead leases reaped.
    pub reaped_leases: u64,
    /// Temps of dead leases (or of no lease) removed.
    pub reaped_temps: u64,
    /// Entries removed from `corrupt/`.
    pub corrupt_removed: u64,
    /// Unheld mint lock files removed.
    pub mint_locks_removed: u64,
    /// The ref generation when the pass ended.
    pub ref_generation: u64,
}

/// Counts of [`Store::stats`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Object files.
    pub objects: u64,
    /// Their total length.
    pub object_bytes: u64,
    /// Ref record files.
    pub refs: u64,
    /// Lease files (live, or dead and not yet reaped).
    pub leases: u64,
}

pub(crate) struct Reaped {
    pub(crate) live_ids: HashSet<String>,
    pub(crate) pins: HashSet<Digest>,
    pub(crate) live_leases: u64,
    pub(crate) reaped_leases: u64,
    pub(crate) reaped_temps: u64,
}

fn read_dir_names(dir: &Path) -> Result<Vec<(String, PathBuf, fs::FileType)>> {
    let mut out = Vec::new();
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(io_err("read directory", dir)(e)),
    };
    for e in rd {
        let e = e.map_err(io_err("read directory", dir))?;
        let ft = e.file_type().map_err(io_err("lstat", e.path()))?;
        out.push((e.file_name().to_string_lossy().into_owned(), e.path(), ft));
    }
    Ok(out)
}

/// Every object entry `objects/sha256/<2>/<2>/<name>` (name not validated).
pub(crate) fn walk_objects(store: &Store) -> Result<Vec<(String, PathBuf)>> {
    let mut out = Vec::new();
    for (_, p1, ft1) in read_dir_names(&store.objects_dir())? {
        if !ft1.is_dir() {
            out.push((String::new(), p1));
            continue;
        }
        for (_, p2, ft2) in read_dir_names(&p1)? {
            if !ft2.is_dir() {
                out.push((String::new(), p2));
                continue;
            }
            for (n3, p3, _) in read_dir_names(&p2)? {
                out.push((n3, p3));
            }
        }
    }
    Ok(out)
}

/// The digest an object path should have, if its name and place agree.
pub(crate) fn digest_of_entry(name: &str, path: &Path) -> Option<Digest> {
    let d = Digest::from_hex(name)?;
    let p2 = path.parent()?;
    let p1 = p2.parent()?;
    (p2.file_name()? == &name[2..4] && p1.file_name()? == &name[0..2]).then_some(d)
}

impl Store {
    /// Probe every lease (reaping dead ones and their temps) and remove temps
    /// owned by no live lease. Caller holds the exclusive store lock.
    pub(crate) fn reap_locked(&self) -> Result<Reaped> {
        let mut r = Reaped {
            live_ids: HashSet::new(),
            pins: HashSet::new(),
            live_leases: 0,
            reaped_leases: 0,
            reaped_temps: 0,
        };
        let tmp = self.dir("tmp");
        for (name, path, _) in read_dir_names(&self.dir("leases"))? {
            if !is_lease_id(&name) {
                continue;
            }
            match probe_lease(&path)? {
                LeaseState::Live(pins) => {
                    r.live_leases += 1;
                    r.pins.extend(pins);
                    r.live_ids.insert(name);
                }
                LeaseState::Reaped => {
                    r.reaped_leases += 1;
                    r.reaped_temps += remove_temps_of(&tmp, &name);
                }
                LeaseState::Gone => {}
            }
        }
        for (name, path, ft) in read_dir_names(&tmp)? {
            let owner = name.split('.').next().unwrap_or("");
            if r.live_ids.contains(owner) {
                continue;
            }
            let res = if ft.is_dir() {
                fs::remove_dir_all(&path)
            } else {
                fs::remove_file(&path)
            };
            if res.is_ok() {
                r.reaped_temps += 1;
            }
        }
        Ok(r)
    }

    /// Reap dead leases and orphaned temps only (no marking, no sweep).
    /// Returns (dead leases reaped, temps removed).
    pub fn reap(&self) -> Result<(u64, u64)> {
        self.check_permissions()?;
        let _x = self.exclusive_lock()?;
        let r = self.reap_locked()?;
        Ok((r.reaped_leases, r.reaped_temps))
    }

    /// Refuse network and cluster filesystems (`store.network_filesystem`).
    pub fn check_local_filesystem(&self) -> Result<()> {
        let magic = fsutil::statfs_type(self.root())?;
        if let Some(name) = fsutil::network_filesystem_name(magic) {
            return Err(StoreError::NetworkFilesystem {
                path: self.root().to_owned(),
                magic,
                name,
            });
        }
        Ok(())
    }

    /// One GC pass under the exclusive store lock: mark from every ref (manifests
    /// expanded, parse only) and every live lease's pins, reap dead leases and
    /// their temps, optionally evict refs to meet a size budget, sweep unmarked
    /// objects, empty `corrupt/`, remove unheld mint lock files. If any ref
    /// record or needed manifest cannot be read, nothing is deleted
    /// (`store.gc_aborted`). Never uses mtime, age or any clock.
    pub fn gc(&self, options: &GcOptions) -> Result<GcReport> {
        self.check_local_filesystem()?;
        // Never delete through a symlinked store directory, nor in a store
        // another user could have planted entries in.
        self.check_permissions()?;
        let _x = self.exclusive_lock()?;
        let mut report = GcReport::default();

        // Mark refs first: an unreadable ref aborts before anything is reaped.
        let mut closures: Vec<(String, String, Vec<Digest>)> = Vec::new();
        for (name, path, _) in read_dir_names(&self.dir("refs"))? {
            let abort = |reason: String, e: StoreError| StoreError::GcAborted {
                reason,
                source: Box::new(e),
            };
            let rec = self
                .read_ref_file(&path, &path.display().to_string())
                .map_err(|e| {
                    abort(
                        format!(
                            "ref record {} is unreadable (`fsck --quarantine` moves it aside; \
                             importing the key again then republishes it)",
                            path.display()
                        ),
                        e,
                    )
                })?;
            let Some((ref_name, target)) = rec else {
                continue;
            };
            let mut set = vec![target.digest];
            if target.kind == RefKind::Manifest {
                let m = self
                    .parse_manifest_unverified(&target.digest)
                    .map_err(|e| {
                        abort(
                            format!(
                                "manifest sha256:{} of ref {ref_name:?} is unreadable",
                                target.digest
                            ),
                            e,
                        )
                    })?;
                set.extend(m.chunks.iter().map(|c| c.digest));
            }
            set.sort();
            set.dedup();
            closures.push((ref_name, name, set));
        }
        report.refs = closures.len() as u64;

        let reaped = self.reap_locked()?;
        report.live_leases = reaped.live_leases;
        report.reaped_leases = reaped.reaped_leases;
        report.reaped_temps = reaped.reaped_temps;

        if let Some(max) = options.max_bytes {
            report.evicted_refs =
                self.evict_locked(&mut closures, &reaped.pins, max, &options.evict_prefix)?;
        }

        let mut marked: HashSet<Digest> = reaped.pins;
        for (_, _, set) in &closures {
            marked.extend(set.iter().copied());
        }

        let mut dirty: HashSet<PathBuf> = HashSet::new();
        for (name, path) in walk_objects(self)? {
            let Some(d) = digest_of_entry(&name, &path) else {
                continue; // not an object name: fsck reports it, GC leaves it
            };
            report.examined_objects += 1;
            let len = fs::symlink_metadata(&path).map(|m| m.len()).unwrap_or(0);
            if marked.contains(&d) {
                report.kept_objects += 1;
                report.kept_bytes += len;
                continue;
            }
            match fs::remove_file(&path) {
                Ok(()) => {
                    report.freed_objects += 1;
                    report.freed_bytes += len;
                    dirty.insert(path.parent().expect("object has a parent").to_owned());
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err("unlink", &path)(e)),
            }
        }
        for d in &dirty {
            fsutil::fsync_dir(d)?;
        }

        for (_, path, ft) in read_dir_names(&self.dir("corrupt"))? {
            let res = if ft.is_dir() {
                fs::remove_dir_all(&path)
            } else {
                fs::remove_file(&path)
            };
            res.map_err(io_err("remove", &path))?;
            report.corrupt_removed += 1;
        }
        if report.corrupt_removed > 0 {
            fsutil::fsync_dir(&self.dir("corrupt"))?;
        }

        // Use stamps of refs that no longer exist (record_use is best effort
        // and may race with a delete) are dropped.
        let live_refs: HashSet<&str> = closures.iter().map(|c| c.1.as_str()).collect();
        for (name, path, _) in read_dir_names(&self.dir("uses"))? {
            if !live_refs.contains(name.as_str()) {
                let _ = fs::remove_file(&path);
            }
        }

        for (_, path, ft) in read_dir_names(&self.dir("locks/mint"))? {
            if ft.is_file() && remove_if_unheld(&path)? {
                report.mint_locks_removed += 1;
            }
        }
        report.ref_generation = self.ref_generation()?;
        Ok(report)
    }

    fn evict_locked(
        &self,
        closures: &mut Vec<(String, String, Vec<Digest>)>,
        pins: &HashSet<Digest>,
        max: u64,
        prefix: &str,
    ) -> Result<Vec<String>> {
        let mut size: HashMap<Digest, u64> = HashMap::new();
        let mut count: HashMap<Digest, u64> = HashMap::new();
        let all = closures.iter().flat_map(|c| c.2.iter()).chain(pins.iter());
        for d in all {
            *count.entry(*d).or_default() += 1;
            if !size.contains_key(d) {
                let l = self.object_len(d).ok().flatten().unwrap_or(0);
                size.insert(*d, l);
            }
        }
        let mut reachable: u64 = size.values().sum();
        let mut order: Vec<(u64, String, usize)> = closures
            .iter()
            .enumerate()
            .filter(|(_, c)| c.0.starts_with(prefix))
            .map(|(i, c)| (self.last_use_by_hash(&c.1), c.0.clone(), i))
            .collect();
        order.sort();
        let mut evicted = Vec::new();
        let mut gone = HashSet::new();
        for (_, name, i) in order {
            if reachable <= max {
                break;
            }
            self.delete_ref_locked(&closures[i].1)?;
            for d in &closures[i].2 {
                let c = count.get_mut(d).expect("counted above");
                *c -= 1;
                if *c == 0 {
                    reachable -= size[d];
                }
            }
            gone.insert(i);
            evicted.push(name);
        }
        if !evicted.is_empty() {
            self.bump_ref_generation()?;
            let mut i = 0;
            closures.retain(|_| {
                let keep = !gone.contains(&i);
                i += 1;
                keep
            });
        }
        Ok(evicted)
    }

    /// Object, ref and lease counts (walks the store; no lock).
    pub fn stats(&self) -> Result<StoreStats> {
        let mut s = StoreStats::default();
        for (name, path) in walk_objects(self)? {
            if digest_of_entry(&name, &path).is_some() {
                s.objects += 1;
                s.object_bytes += fs::symlink_metadata(&path).map(|m| m.len()).unwrap_or(0);
            }
        }
        s.refs = read_dir_names(&self.dir("refs"))?.len() as u64;
        s.leases = read_dir_names(&self.dir("leases"))?
            .iter()
            .filter(|e| is_lease_id(&e.0))
            .count() as u64;
        Ok(s)
    }

    /// Approximate bytes held by objects (a walk without locks; racing writers
    /// and GC make it approximate).
    pub fn approximate_size(&self) -> u64 {
        self.stats().map_or(0, |s| s.object_bytes)
    }
}

/// Remove a lock file if its `flock` can be taken without waiting and the path
/// still names the locked inode.
pub(crate) fn remove_if_unheld(path: &Path) -> Result<bool> {
    let f = match fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        // Swapped for a symlink or a FIFO meanwhile: not a lock file of ours.
        Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP) | Some(libc::ENXIO)) => {
            return Ok(false)
        }
        Err(e) => return Err(io_err("open lock", path)(e)),
    };
    if !fsutil::flock(&f, true, true).map_err(io_err("flock", path))? {
        return Ok(false);
    }
    let held = f.metadata().map_err(io_err("fstat", path))?;
    match fs::symlink_metadata(path) {
        Ok(now) if now.ino() == held.ino() && now.dev() == held.dev() => {
            fs::remove_file(path).map_err(io_err("unlink", path))?;
            Ok(true)
        }
        _ => Ok(false),
    }
}
