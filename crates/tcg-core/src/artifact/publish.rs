//! Staged, no-clobber publication (SPEC-v1 §6.7, §6.8, §10.1): temps named
//! `.<destination name>.<random>` beside the destination, removed on every
//! failure path; directories published by `renameat2(RENAME_NOREPLACE)`,
//! files by `link`; the parent fsynced afterwards.

use std::ffi::CString;
use std::fs::{DirBuilder, File, OpenOptions};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
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
    /// A stage directory's own descriptor, `flock`ed exclusively while this
    /// process lives: how a later operation tells a live stage from a dead one.
    _lock: Option<File>,
    /// The mode the stage gets just before it is published (it is 0700 while
    /// it is filled, so no other user can reach what is being staged).
    final_mode: u32,
}

/// The infix of stage directory names: `.<name>.tcg-stage.<random>`.
const STAGE_INFIX: &str = ".tcg-stage.";

fn flock_nb(f: &File) -> bool {
    use std::os::unix::io::AsRawFd;
    // SAFETY: flock on a descriptor we own.
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

fn open_dir_nofollow(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(path)
}

fn same_inode(a: &std::fs::Metadata, b: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    a.dev() == b.dev() && a.ino() == b.ino()
}

/// Remove the stages that killed processes left beside `dest`: every
/// `.<name>.tcg-stage.*` directory owned by this user whose `flock` can be
/// taken (its creator holds it for its whole life, so only a dead creator's
/// stage is free). Never by age; never through a symlink. Returns how many
/// were removed. Best effort: a stage that cannot be inspected stays.
pub fn reap_dead_stages(dest: &Path) -> usize {
    let Ok((parent, name)) = split_destination(dest) else {
        return 0;
    };
    let prefix = format!(".{name}{STAGE_INFIX}");
    let Ok(entries) = std::fs::read_dir(&parent) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        if !entry.file_name().to_string_lossy().starts_with(&prefix) {
            continue;
        }
        let path = entry.path();
        let Ok(before) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        use std::os::unix::fs::MetadataExt;
        // SAFETY: geteuid cannot fail.
        if !before.file_type().is_dir() || before.uid() != unsafe { libc::geteuid() } {
            continue;
        }
        let Ok(dir) = open_dir_nofollow(&path) else {
            continue;
        };
        if !flock_nb(&dir) {
            continue; // alive
        }
        // Still the directory whose lock we hold (not renamed and replaced).
        match (dir.metadata(), std::fs::symlink_metadata(&path)) {
            (Ok(held), Ok(now)) if same_inode(&held, &now) => {}
            _ => continue,
        }
        // std's remove_dir_all never follows symlinks inside the tree.
        if std::fs::remove_dir_all(&path).is_ok() {
            removed += 1;
        }
    }
    removed
}

impl Temp {
    /// A fresh stage directory `.<name>.tcg-stage.<random>` beside `dest`
    /// (parents created), mode 0700 while it is filled, `flock`ed while this
    /// process lives. Dead stages of the same destination (left by a killed
    /// process) are removed first. On publication it gets mode 0755 & ~umask.
    pub fn stage_dir(dest: &Path) -> Result<Temp> {
        let (parent, name) = split_destination(dest)?;
        create_parents(&parent)?;
        reap_dead_stages(dest);
        loop {
            let path = parent.join(format!(".{name}{STAGE_INFIX}{}", random_suffix()));
            match DirBuilder::new().mode(DIR_MODE).create(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => {
                    return Err(Error::io(
                        format_args!("cannot create stage {}", path.display()),
                        &e,
                    ))
                }
            }
            let io = |e: std::io::Error| {
                Error::io(format_args!("cannot lock stage {}", path.display()), &e)
            };
            let lock = match open_dir_nofollow(&path) {
                Ok(f) => f,
                // Removed by a reaper that took it for dead before we locked it.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io(e)),
            };
            if !flock_nb(&lock) {
                continue; // a reaper holds it and will remove it
            }
            match std::fs::symlink_metadata(&path) {
                Ok(now) if same_inode(&lock.metadata().map_err(io)?, &now) => {}
                _ => continue,
            }
            // DIR_MODE & ~umask is the published mode; private until then.
            let final_mode = lock.metadata().map_err(io)?.permissions().mode() & 0o7777;
            lock.set_permissions(std::fs::Permissions::from_mode(0o700))
                .map_err(io)?;
            return Ok(Temp {
                path,
                dir: true,
                armed: true,
                _lock: Some(lock),
                final_mode,
            });
        }
    }

    /// Give a stage directory the mode it is published with: `mode` when
    /// given (the mode of a directory the caller created for it), else
    /// 0755 & ~umask.
    pub fn set_final_mode(&mut self, mode: Option<u32>) -> Result<()> {
        let mode = mode.unwrap_or(self.final_mode);
        std::fs::set_permissions(&self.path, std::fs::Permissions::from_mode(mode))
            .map_err(|e| Error::io(format_args!("cannot chmod {}", self.path.display()), &e))
    }

    /// Disarm after the stage was renamed into place by the caller.
    pub fn disarm(&mut self) {
        self.armed = false;
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
                            _lock: None,
                            final_mode: FILE_MODE,
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
        self.set_final_mode(None)?;
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
