//! The members of one package entry, taken out of `model.pt2` into a private
//! directory so that the dynamic loader can open the `.so`.
//!
//! The zip is read with the bounded reader of `tcg-core` (central directory,
//! no duplicate or encrypted members, stored or deflate only, CRC checked,
//! no more than the declared size). Only the entry's wrapper source and its
//! `.so` are read; nothing is written outside the private directory, whose
//! file names this module chooses itself.

use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use tcg_core::artifact::package::loadable::{check_loadable, FileRanges};
use tcg_core::artifact::package::Package;
use tcg_core::{Code, Error, Result};

/// Largest `.so` the native path loads (4 GiB).
pub const MAX_SHARED_OBJECT_BYTES: u64 = 4 << 30;
/// Largest wrapper source it reads: the verifier's bound, defined once in
/// `tcg-core`.
pub use tcg_core::artifact::limits::MAX_WRAPPER_BYTES;

/// The prefix of the private directories under the temp directory.
pub const DIR_PREFIX: &str = "tcg-native-";

/// An entry's members, extracted; the directory is removed on drop.
#[derive(Debug)]
pub struct Extracted {
    dir: tempfile::TempDir,
    /// An open handle on the directory holding an exclusive `flock` for as
    /// long as the directory is in use: the proof of liveness that lets a
    /// later load remove the directories of killed processes.
    _alive: std::fs::File,
    shared_object: PathBuf,
    /// The wrapper source (`*.wrapper.cpp`) of the entry.
    pub wrapper: String,
}

impl Extracted {
    /// The extracted `.so`.
    pub fn shared_object(&self) -> &Path {
        &self.shared_object
    }
    /// The private directory (mode 0700).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

fn invalid(message: String) -> Error {
    Error::new(Code::RunPackageInvalid, message)
}

fn sized(pkg: &mut Package, name: &str, limit: u64) -> Result<u64> {
    let size = pkg.declared_size(name)?;
    if size > limit {
        return Err(invalid(format!(
            "package member {name:?} declares {size} bytes, more than the {limit} the native path reads"
        )));
    }
    Ok(size)
}

/// Extract the `.so` of `entry` from the package at `package` into a new
/// private directory under `std::env::temp_dir()`, and read the wrapper source.
pub fn extract(package: &Path, entry: &str) -> Result<Extracted> {
    let rewrap = |e: Error| {
        e.rewrap(
            Code::RunPackageInvalid,
            format_args!("cannot load {}", package.display()),
        )
    };
    let mut pkg = Package::open(package).map_err(rewrap)?;
    let members = pkg.entry_members(Some(entry)).map_err(rewrap)?;

    sized(&mut pkg, &members.wrapper, MAX_WRAPPER_BYTES)?;
    let wrapper = pkg
        .read_bounded(&members.wrapper, MAX_WRAPPER_BYTES)
        .map_err(rewrap)?;
    let wrapper = String::from_utf8(wrapper)
        .map_err(|_| invalid(format!("wrapper {:?} is not UTF-8", members.wrapper)))?;

    let declared = sized(&mut pkg, &members.shared_object, MAX_SHARED_OBJECT_BYTES)?;
    let tmp = std::env::temp_dir();
    remove_leftovers(&tmp);
    let (dir, alive) = locked_dir(&tmp)?;
    // tempfile creates the directory with mode 0700; the .so gets a fixed name
    // of this module's choosing, never a name from the zip.
    let shared_object = dir.path().join("graph.so");
    let mut out = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o500)
        .open(&shared_object)
        .map_err(|e| {
            Error::io(
                format_args!("cannot create {}", shared_object.display()),
                &e,
            )
        })?;
    let mut written = 0u64;
    pkg.stream(&members.shared_object, &mut |r: &mut dyn Read| {
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = r
                .read(&mut buf)
                .map_err(|e| invalid(format!("cannot read {:?}: {e}", members.shared_object)))?;
            if n == 0 {
                return Ok(());
            }
            written += n as u64;
            if written > declared {
                return Err(invalid(format!(
                    "package member {:?} holds more than its declared {declared} bytes",
                    members.shared_object
                )));
            }
            out.write_all(&buf[..n]).map_err(|e| {
                Error::io(format_args!("cannot write {}", shared_object.display()), &e)
            })?;
        }
    })
    .map_err(rewrap)?;
    if written != declared {
        return Err(invalid(format!(
            "package member {:?} holds {written} bytes, not its declared {declared}",
            members.shared_object
        )));
    }
    out.flush()
        .map_err(|e| Error::io(format_args!("cannot write {}", shared_object.display()), &e))?;
    drop(out);
    // What the dynamic loader relies on is checked again here, on the bytes
    // about to be loaded, so a corrupted object fails instead of crashing
    // the process inside dlopen.
    let written = std::fs::File::open(&shared_object)
        .map_err(|e| Error::io(format_args!("cannot open {}", shared_object.display()), &e))?;
    check_loadable(&mut FileRanges {
        file: &written,
        size: declared,
    })
    .map_err(|e| {
        e.rewrap(
            Code::RunPackageInvalid,
            format_args!(
                "cannot load {}: {}",
                package.display(),
                members.shared_object
            ),
        )
    })?;
    Ok(Extracted {
        dir,
        _alive: alive,
        shared_object,
        wrapper,
    })
}

/// Try to take the exclusive lock of an open directory without waiting.
fn try_lock(dir: &std::fs::File) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor this function borrows; no memory is passed.
    unsafe { libc::flock(dir.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

fn open_dir(path: &Path) -> std::io::Result<std::fs::File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// A new private directory under `tmp`, locked. A cleaner may remove the
/// directory between its creation and the lock; the lock then holds a
/// directory that is no longer at its path, which is checked, and the
/// creation is retried.
fn locked_dir(tmp: &Path) -> Result<(tempfile::TempDir, std::fs::File)> {
    use std::os::unix::fs::MetadataExt;
    for _ in 0..8 {
        let dir = tempfile::Builder::new()
            .prefix(DIR_PREFIX)
            .tempdir_in(tmp)
            .map_err(|e| Error::io("cannot create a private directory for the graph's .so", &e))?;
        let Ok(handle) = open_dir(dir.path()) else {
            continue;
        };
        if !try_lock(&handle) {
            continue;
        }
        let same = match (handle.metadata(), std::fs::symlink_metadata(dir.path())) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        };
        if same {
            return Ok((dir, handle));
        }
    }
    Err(Error::new(
        Code::RunPackageInvalid,
        format!(
            "cannot keep a private directory under {}: each was removed as it was made",
            tmp.display()
        ),
    ))
}

/// Remove the private directories of processes that died while holding
/// them (killed during or after a load): a directory of this user whose lock
/// can be taken has no living owner. Failures are ignored: this is tidying,
/// and a directory that cannot be removed now is tried again next time.
pub fn remove_leftovers(tmp: &Path) -> usize {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: getuid cannot fail and touches no memory.
    let uid = unsafe { libc::getuid() };
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.to_string_lossy().starts_with(DIR_PREFIX) {
            continue;
        }
        let path = entry.path();
        // Not through a symlink, and only what this user owns.
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if !meta.is_dir() || meta.uid() != uid {
            continue;
        }
        let Ok(handle) = open_dir(&path) else {
            continue;
        };
        let still = handle
            .metadata()
            .is_ok_and(|m| m.dev() == meta.dev() && m.ino() == meta.ino());
        if still && try_lock(&handle) && std::fs::remove_dir_all(&path).is_ok() {
            removed += 1;
        }
    }
    removed
}
