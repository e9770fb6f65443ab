//! Scrub: rehash every object and check every ref's closure (SPEC-v1 §9.2).

use std::fs;
use std::path::PathBuf;

use crate::error::{Result, StoreError};
use crate::gc::{digest_of_entry, walk_objects};
use crate::object::verify_object;
use crate::{Digest, Store};

/// Options of [`Store::fsck`].
#[derive(Clone, Copy, Debug, Default)]
pub struct FsckOptions {
    /// Move objects that fail verification to `corrupt/` (never deleted).
    pub quarantine: bool,
}

/// One object (or stray entry under `objects/`) that failed verification.
#[derive(Debug)]
pub struct CorruptObject {
    /// The digest its name claims, when the name is a valid object name.
    pub digest: Option<Digest>,
    /// Where it was found.
    pub path: PathBuf,
    /// Why it failed (typed: digest mismatch, not a regular file, ...).
    pub error: StoreError,
    /// Where it was moved, with [`FsckOptions::quarantine`].
    pub moved_to: Option<PathBuf>,
}

/// A ref whose record is unreadable or whose closure is incomplete or corrupt.
#[derive(Debug)]
pub struct DanglingRef {
    /// The ref name, or the record path when the record is unreadable.
    pub name: String,
    /// Why.
    pub error: StoreError,
    /// Where an unreadable record was moved, with [`FsckOptions::quarantine`]
    /// (a malformed record is proof of bad stored bytes; it then no longer
    /// blocks GC, and the next import of the key publishes afresh).
    pub moved_to: Option<PathBuf>,
}

/// What [`Store::fsck`] found.
#[derive(Debug, Default)]
pub struct FsckReport {
    /// Objects rehashed.
    pub objects_checked: u64,
    /// Bytes rehashed.
    pub bytes_checked: u64,
    /// Objects that failed.
    pub corrupt: Vec<CorruptObject>,
    /// Refs checked.
    pub refs_checked: u64,
    /// Refs that do not reach a complete, readable closure.
    pub dangling_refs: Vec<DanglingRef>,
    /// Dead leases reaped at the end.
    pub reaped_leases: u64,
    /// Orphaned temps removed at the end.
    pub reaped_temps: u64,
}

impl FsckReport {
    /// No corrupt object and no dangling ref.
    pub fn is_clean(&self) -> bool {
        self.corrupt.is_empty() && self.dangling_refs.is_empty()
    }
}

impl Store {
    /// Rehash every object and report failures (moving them to `corrupt/` only
    /// with `quarantine`); check every ref's closure; then reap dead leases'
    /// temps. Never deletes stored data. I/O errors abort with `io.error`.
    pub fn fsck(&self, options: FsckOptions) -> Result<FsckReport> {
        let mut report = FsckReport::default();
        self.check_permissions()?;
        {
            let _shared = self.shared_lock()?;
            for (name, path) in walk_objects(self)? {
                let digest = digest_of_entry(&name, &path);
                let res = match &digest {
                    Some(d) => verify_object(&path, d, None),
                    None => Err(StoreError::NotRegularFile {
                        path: path.clone(),
                        found: "stray entry (not an object name)",
                    }),
                };
                match res {
                    Ok(()) => {
                        report.objects_checked += 1;
                        report.bytes_checked += fs::symlink_metadata(&path).map_or(0, |m| m.len());
                    }
                    Err(e @ StoreError::Io { .. }) => return Err(e),
                    Err(error) => {
                        report.objects_checked += 1;
                        let mut moved_to = None;
                        if let (true, Some(d)) = (options.quarantine, &digest) {
                            let _stripe = self.object_stripe(d)?;
                            // Re-check under the stripe lock: an installer may have replaced it.
                            if let Err(e) = verify_object(&path, d, None) {
                                if e.is_bad_stored_bytes() && fs::symlink_metadata(&path).is_ok() {
                                    moved_to = Some(self.move_to_corrupt(&path, d)?);
                                }
                            }
                        }
                        report.corrupt.push(CorruptObject {
                            digest,
                            path,
                            error,
                            moved_to,
                        });
                    }
                }
            }
            let refs_dir = self.dir("refs");
            let mut entries: Vec<_> = fs::read_dir(&refs_dir)
                .map_err(crate::error::io_err("read directory", &refs_dir))?
                .flatten()
                .map(|e| e.path())
                .collect();
            entries.sort();
            for path in entries {
                report.refs_checked += 1;
                let label = path.display().to_string();
                match self.read_ref_file(&path, &label) {
                    Ok(Some((name, target))) => {
                        if let Err(error) = self.check_closure(&name, &target) {
                            report.dangling_refs.push(DanglingRef {
                                name,
                                error,
                                moved_to: None,
                            });
                        }
                    }
                    Ok(None) => {}
                    Err(e @ StoreError::Io { .. }) => return Err(e),
                    Err(error) => {
                        let moved_to = match (&error, options.quarantine) {
                            (StoreError::RefInvalid { .. }, true) => {
                                self.move_unreadable_ref(&path)?
                            }
                            _ => None,
                        };
                        report.dangling_refs.push(DanglingRef {
                            name: label,
                            error,
                            moved_to,
                        })
                    }
                }
            }
        }
        let (leases, temps) = self.reap()?;
        report.reaped_leases = leases;
        report.reaped_temps = temps;
        Ok(report)
    }
}

impl Store {
    /// Move a ref record that cannot be read (truncated, not canonical, wrong
    /// members …) to `corrupt/ref-<file name>.<32 hex>`, re-checked under the
    /// ref's stripe lock so that a record replaced meanwhile stays.
    fn move_unreadable_ref(&self, path: &std::path::Path) -> Result<Option<PathBuf>> {
        let Some(hash) = path.file_name().map(|n| n.to_string_lossy().into_owned()) else {
            return Ok(None);
        };
        if !tcg_cj::is_hex(&hash, 64) {
            return Ok(None);
        }
        let _shared = self.shared_lock()?;
        let _stripe = self.ref_stripe(&hash)?;
        match self.read_ref_file(path, &hash) {
            Err(StoreError::RefInvalid { .. }) => {}
            _ => return Ok(None),
        }
        let to = self
            .dir("corrupt")
            .join(format!("ref-{hash}.{}", crate::fsutil::random_hex32()));
        fs::rename(path, &to).map_err(crate::error::io_err("rename to corrupt", path))?;
        crate::fsutil::fsync_dir(&self.dir("refs"))?;
        crate::fsutil::fsync_dir(&self.dir("corrupt"))?;
        self.bump_ref_generation()?;
        Ok(Some(to))
    }
}
