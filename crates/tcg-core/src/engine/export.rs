//! Export (SPEC-v1 §10.7): the exact bytes the graph ref selects, verified
//! once in the destination's directory, published without clobbering.

use std::fs::OpenOptions;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

use super::destination::occupied;
use super::publish::bad_read;
use super::resolve::{classify_store, Evidence, Verdict};
use super::{check_key, graph_ref, store_err, Engine};
use crate::artifact::envelope::Tee;
use crate::artifact::publish::{fsync_parent, Temp};
use crate::artifact::read_envelope;
use crate::{Code, Error, Result};

fn failed(key: &str, why: impl std::fmt::Display) -> Error {
    Error::new(
        Code::QuarantineExportVerification,
        format!("compiled graph {key} failed export verification: {why}"),
    )
}

/// Accept an existing destination only if it is a regular file (not a
/// symlink) with the manifest's size and SHA-256, stable across the read.
fn accept_existing(dest: &Path, size: u64, digest: &[u8; 32]) -> Result<()> {
    let mut f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(dest)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => occupied(dest, "it is a symlink"),
            _ => Error::io(format_args!("cannot open {}", dest.display()), &e),
        })?;
    let id = |m: &std::fs::Metadata| (m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec());
    let before = f
        .metadata()
        .map_err(|e| Error::io(format_args!("cannot stat {}", dest.display()), &e))?;
    if !before.file_type().is_file() {
        return Err(occupied(dest, "it is not a regular file"));
    }
    if before.size() != size {
        return Err(occupied(dest, "its size differs"));
    }
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| Error::io(format_args!("cannot read {}", dest.display()), &e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    let after = std::fs::symlink_metadata(dest)
        .map_err(|e| Error::io(format_args!("cannot stat {}", dest.display()), &e))?;
    if id(&before) != id(&after) {
        return Err(occupied(dest, "it changed while it was compared"));
    }
    if h.finalize().as_slice() != digest {
        return Err(occupied(dest, "its bytes differ"));
    }
    Ok(())
}

impl Engine {
    /// Export the envelope stored for `key` to the file `destination`.
    pub fn export_artifact(&self, key: &str, destination: &Path) -> Result<PathBuf> {
        check_key(key)?;
        self.refuse_destination_in_store(destination)?;
        let lease = self.store.lease().map_err(store_err)?;
        let name = graph_ref(key);
        let Some(target) = self.store.get_ref(&name).map_err(store_err)? else {
            return Err(Error::new(
                Code::StoreAbsent,
                format!("compiled graph {key} is not present"),
            ));
        };
        let m = target.digest;
        if self.quarantine_marker(key, &m)?.is_some() {
            return Err(Error::new(
                Code::QuarantinePresent,
                format!("compiled graph {key} is quarantined and has nothing verified to export"),
            ));
        }
        let quarantine_and_fail = |why: String| -> Result<PathBuf> {
            self.quarantine(&lease, key, &m, Code::QuarantineExportVerification)?;
            Err(failed(key, why))
        };
        let manifest = match self.store.pin_ref(&lease, &name) {
            Ok(Some(t)) if t == target => match self.store.load_manifest(&lease, &m) {
                Ok(man) => man,
                Err(e) => match classify_store(e) {
                    Verdict::Other(e) => return Err(e),
                    Verdict::Unreadable => {
                        return quarantine_and_fail("unreadable manifest format".into())
                    }
                    Verdict::Bad(_, why) => return quarantine_and_fail(why),
                },
            },
            Ok(_) => {
                return Err(Error::new(
                    Code::StoreRefMoved,
                    format!("the record of {key} changed during export"),
                ))
            }
            Err(e) => match classify_store(e) {
                Verdict::Other(e) => return Err(e),
                Verdict::Unreadable => {
                    return quarantine_and_fail("unreadable manifest format".into())
                }
                Verdict::Bad(_, why) => return quarantine_and_fail(why),
            },
        };
        // Verify the stored bytes from the store itself (never by reading back
        // a file outside it, which someone else may change): whole-file digest
        // and size, the full reader, the key. Only this can quarantine.
        let input = match self.store.open_file(&lease, &m, true) {
            Ok(r) => r,
            Err(e) => {
                return match classify_store(e) {
                    Verdict::Other(e) => Err(e),
                    Verdict::Unreadable => quarantine_and_fail("unreadable format".into()),
                    Verdict::Bad(_, why) => quarantine_and_fail(why),
                }
            }
        };
        let mut hasher = Sha256::new();
        let mut size = 0u64;
        let tee = Tee::new(input, |b: &[u8]| {
            hasher.update(b);
            size += b.len() as u64;
            Ok(())
        });
        let stage = super::StoreStage::new(self, &lease)?;
        let mut admission = |md: &crate::artifact::Metadata| -> Result<()> {
            if md.key() != key {
                return Err(Error::new(
                    Code::QuarantineKeyMismatch,
                    format!("stored metadata states key {}", md.key()),
                ));
            }
            Ok(())
        };
        let evidence = Evidence::default();
        let read = read_envelope(evidence.reader(tee), stage.path(), &mut admission);
        drop(stage);
        if let Err(err) = read {
            let (_, why) = bad_read(err, &evidence)?;
            return quarantine_and_fail(why);
        }
        let digest: [u8; 32] = hasher.finalize().into();
        if size != manifest.size || digest != manifest.file_digest.0 {
            return quarantine_and_fail("the exported bytes do not match the manifest".into());
        }
        // A temp beside the destination; the store links its copy at that name,
        // proving the bytes written by reading them back through its own
        // descriptor. A mismatch there with intact stored chunks is an I/O
        // error (the temp was changed), never a quarantine.
        let (temp, file) = Temp::file(destination)?;
        drop(file);
        std::fs::remove_file(temp.path())
            .map_err(|e| Error::io(format_args!("cannot prepare {}", temp.path().display()), &e))?;
        if let Err(e) = self.store.materialize(&lease, &m, temp.path(), true) {
            return match classify_store(e) {
                Verdict::Other(e) => Err(e),
                Verdict::Unreadable => quarantine_and_fail("unreadable format".into()),
                Verdict::Bad(_, why) => quarantine_and_fail(why),
            };
        }
        match std::fs::hard_link(temp.path(), destination) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                accept_existing(destination, manifest.size, &manifest.file_digest.0)?;
            }
            Err(e) => {
                return Err(Error::io(
                    format_args!("cannot publish {}", destination.display()),
                    &e,
                ))
            }
        }
        drop(temp);
        fsync_parent(destination)?;
        lease.end().map_err(store_err)?;
        Ok(destination.to_path_buf())
    }
}
