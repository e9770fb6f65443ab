//! Staged, no-clobber publication (SPEC-v1 §6.7, §6.8, §10.1): temps named
//! `.<destination name>.<random>` beside the destination, removed on every
//! failure path; directories published by `renameat2(RENAME_NOREPLACE)`,
//! files by `link`; the parent fsynced afterwards.

use std::ffi::CString;
use std::fs::{DirBuilder, File, OpenOptions};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

use crate::error::{Code, Error, Result};

/// Mode of published directories, masked by the umask.
pub const DIR_MODE: u32 = 0o755;
/// Mode of published files, masked by the umask.
pub const FILE_MODE: u32 = 0o644;

fn random_suffix() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = Sha256::new();
    h.update(std::process::id().to_le_bytes());
    h.update(COUNTER.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    h.update(now.as_nanos().to_le_bytes());
    let marker = 0u8;
    h.update((&marker as *const u8 as usize).to_le_bytes());
    hex::encode(&h.finalize()[..6])
}

/// The parent directory of `dest` and its final name.
pub fn split_destination(dest: &Path) -> Result<(PathBuf, String)> {
    let name = dest
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| {
            Error::io_code(
                Code::IoError,
                Some(libc::EINVAL),
                format!("destination {} has no usable final name", dest.display()),
            )
        })?
        .to_owned();
    let parent = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((parent, name))
}

/// Create the parents of `dir` as needed, 0755 & ~umask.
pub fn create_parents(dir: &Path) -> Result<()> {
    DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(dir)
        .map_err(|e| Error::io(format_args!("cannot create {}", dir.display()), &e))
}

/// Refuse an existing entry at `dest` (`io.destination_occupied`).
pub fn refuse_occupied(dest: &Path) -> Result<()> {
    match std::fs::symlink_metadata(dest) {
        Ok(_) => Err(occupied(dest)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(
            format_args!("cannot inspect {}", dest.display()),
            &e,
        )),
    }
}

fn occupied(dest: &Path) -> Error {
    Error::io_code(
        Code::IoDestinationOccupied,
        Some(libc::EEXIST),
        format!(
            "destination {} already exists and is never overwritten",
            dest.display()
        ),
    )
}

/// A temp (a stage directory or a temp file) removed on drop unless
/// published.
#[derive(Debug)]
pub struct Temp {
    path: PathBuf,
    dir: bool,
    armed: bool,
}

impl Temp {
    /// A fresh stage directory `.<name>.<random>` beside `dest` (parents
    /// created), mode 0755 & ~umask.
    pub fn stage_dir(dest: &Path) -> Result<Temp> {
        let (parent, name) = split_destination(dest)?;
        create_parents(&parent)?;
        loop {
            let path = parent.join(format!(".{name}.{}", random_suffix()));
            match DirBuilder::new().mode(DIR_MODE).create(&path) {
                Ok(()) => {
                    return Ok(Temp {
                        path,
                        dir: true,
                        armed: true,
                    })
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => {
                    return Err(Error::io(
                        format_args!("cannot create stage {}", path.display()),
                        &e,
                    ))
                }
            }
        }
    }

    /// A fresh temp file `.<name>.<random>` beside `dest`, mode 0644 &
    /// ~umask, open for writing.
    pub fn file(dest: &Path) -> Result<(Temp, File)> {
        let (parent, name) = split_destination(dest)?;
        create_parents(&parent)?;
        loop {
            let path = parent.join(format!(".{name}.{}", random_suffix()));
            match OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(FILE_MODE)
                .open(&path)
            {
                Ok(f) => {
                    return Ok((
                        Temp {
                            path,
                            dir: false,
                            armed: true,
                        },
                        f,
                    ))
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => {
                    return Err(Error::io(
                        format_args!("cannot create temp {}", path.display()),
                        &e,
                    ))
                }
            }
        }
    }

    /// The temp's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Publish a stage directory at `dest` without replacing anything, then
    /// fsync the parent.
    pub fn publish_dir(mut self, dest: &Path) -> Result<()> {
        debug_assert!(self.dir);
        rename_noreplace(&self.path, dest)?;
        self.armed = false;
        fsync_parent(dest)
    }

    /// Publish a temp file at `dest` by `link` (never replacing), remove the
    /// temp name, then fsync the parent.
    pub fn publish_file(self, dest: &Path) -> Result<()> {
        debug_assert!(!self.dir);
        match std::fs::hard_link(&self.path, dest) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Err(occupied(dest)),
            Err(e) => {
                return Err(Error::io(
                    format_args!("cannot publish {}", dest.display()),
                    &e,
                ))
            }
        }
        drop(self); // removes the temp name
        fsync_parent(dest)
    }
}

impl Drop for Temp {
    fn drop(&mut self) {
        if self.armed {
            let _ = if self.dir {
                std::fs::remove_dir_all(&self.path)
            } else {
                std::fs::remove_file(&self.path)
            };
        }
    }
}

fn cstr(p: &Path) -> Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| {
        Error::io_code(
            Code::IoError,
            Some(libc::EINVAL),
            format!("path {} contains NUL", p.display()),
        )
    })
}

/// `renameat2(RENAME_NOREPLACE)`, or a plain `rename` where the kernel or
/// filesystem lacks it (POSIX then refuses a non-empty destination).
pub fn rename_noreplace(from: &Path, to: &Path) -> Result<()> {
    let (a, b) = (cstr(from)?, cstr(to)?);
    // SAFETY: both pointers are valid NUL-terminated strings for the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EEXIST) | Some(libc::ENOTEMPTY) => Err(occupied(to)),
        Some(libc::ENOSYS) | Some(libc::EINVAL) => match std::fs::rename(from, to) {
            Ok(()) => Ok(()),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EEXIST) | Some(libc::ENOTEMPTY)) => {
                Err(occupied(to))
            }
            Err(e) => Err(Error::io(
                format_args!("cannot publish {}", to.display()),
                &e,
            )),
        },
        _ => Err(Error::io(
            format_args!("cannot publish {}", to.display()),
            &err,
        )),
    }
}

/// fsync the directory that holds `path`.
pub fn fsync_parent(path: &Path) -> Result<()> {
    let (parent, _) = split_destination(path)?;
    let dir = File::open(&parent)
        .map_err(|e| Error::io(format_args!("cannot open {}", parent.display()), &e))?;
    dir.sync_all()
        .map_err(|e| Error::io(format_args!("cannot fsync {}", parent.display()), &e))
}
