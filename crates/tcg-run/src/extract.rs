//! The members of one package entry, taken out of `model.pt2` into a private
//! directory so that the dynamic loader can open the `.so` (and, for a CUDA
//! graph, the CUDA driver its cubins: the generated code loads each kernel
//! from `<cubin dir>/<file name of the cubin>`, as torch's package loader
//! lays them out).
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
/// Largest single cubin it extracts: the verifier's bound, defined once in
/// `tcg-core`.
pub use tcg_core::artifact::limits::MAX_CUBIN_BYTES;
/// Most cubins one entry may carry.
pub const MAX_CUBINS: usize = 65_536;

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
/// With `sm` (a CUDA graph), the entry's cubins are extracted into the same
/// directory under their own file names, each checked again to be CUDA code
/// for `sm` (resolve checked them; the check is cheap and the bytes are read
/// here anyway).
pub fn extract(package: &Path, entry: &str, sm: Option<&str>) -> Result<Extracted> {
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
    refuse_native_unsupported(&mut pkg, &members, &wrapper, entry)?;

    let tmp = std::env::temp_dir();
    remove_leftovers(&tmp);
    let (dir, alive) = locked_dir(&tmp)?;
    // tempfile creates the directory with mode 0700; the .so gets a fixed name
    // of this module's choosing, never a name from the zip.
    let shared_object = dir.path().join("graph.so");
    write_member(
        &mut pkg,
        &members.shared_object,
        &shared_object,
        MAX_SHARED_OBJECT_BYTES,
        &mut |_| Ok(()),
    )
    .map_err(rewrap)?;
    if let Some(sm) = sm {
        if members.cubins.len() > MAX_CUBINS {
            return Err(invalid(format!(
                "entry {entry:?} carries {} cubins, more than the {MAX_CUBINS} the native path loads",
                members.cubins.len()
            )));
        }
        let mut names = std::collections::BTreeSet::new();
        for member in &members.cubins {
            let name = member.rsplit('/').next().unwrap_or(member);
            // The generated code asks for the cubin by its file name only; a
            // name that is not a plain file name, or two members of one name,
            // cannot be placed the way the loader expects.
            let plain = !name.is_empty()
                && name != "graph.so"
                && !name.starts_with('.')
                && name.len() <= 255
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
            if !plain || !names.insert(name.to_owned()) {
                return Err(invalid(format!(
                    "cubin member {member:?} has a file name the native path cannot place"
                )));
            }
            let mut bytes = Vec::new();
            write_member(
                &mut pkg,
                member,
                &dir.path().join(name),
                MAX_CUBIN_BYTES,
                &mut |chunk| {
                    // The bounded ELF check reads the whole object (section table
                    // included); cubins are small and capped above.
                    bytes.extend_from_slice(chunk);
                    Ok(())
                },
            )
            .map_err(rewrap)?;
            tcg_core::artifact::package::cubin::check_cubin(member, &bytes, sm).map_err(|e| {
                invalid(format!(
                    "cannot load {}: {}",
                    package.display(),
                    e.message()
                ))
            })?;
        }
    }
    // What the dynamic loader relies on is checked again here, on the bytes
    // about to be loaded, so a corrupted object fails instead of crashing
    // the process inside dlopen.
    let written = std::fs::File::open(&shared_object)
        .map_err(|e| Error::io(format_args!("cannot open {}", shared_object.display()), &e))?;
    let declared = written
        .metadata()
        .map_err(|e| Error::io(format_args!("cannot stat {}", shared_object.display()), &e))?
        .len();
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

/// Refuse, before anything is extracted, a graph whose wrapper makes calls
/// the native path cannot make (`run.native_unsupported`): operators without
/// a C shim go through torch's proxy executor, which needs the process that
/// registered them (docs/run.md, "What load_native refuses").
pub fn refuse_native_unsupported(
    pkg: &mut Package,
    members: &tcg_core::artifact::package::EntryMembers,
    wrapper: &str,
    entry: &str,
) -> Result<()> {
    let calls = tcg_core::artifact::package::entry_native_calls(pkg, members, wrapper);
    if calls.is_empty() {
        return Ok(());
    }
    let described: Vec<String> = calls.iter().map(|c| c.describe()).collect();
    Err(Error::new(
        Code::RunNativeUnsupported,
        format!(
            "graph {entry:?} calls operators the native path cannot run: {} (operators without a C shim run through torch's proxy executor and the dispatcher of the process that registered them); use load() in a process that imports torch and registers them",
            described.join(", ")
        ),
    ))
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

/// Write member `name` to a new file `path` (mode 0500, never an existing
/// file), at most `limit` bytes and exactly its declared size, handing each
/// chunk to `inspect` as well.
fn write_member(
    pkg: &mut Package,
    name: &str,
    path: &Path,
    limit: u64,
    inspect: &mut dyn FnMut(&[u8]) -> Result<()>,
) -> Result<()> {
    let declared = sized(pkg, name, limit)?;
    let mut out = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o500)
        .open(path)
        .map_err(|e| Error::io(format_args!("cannot create {}", path.display()), &e))?;
    let mut written = 0u64;
    pkg.stream(name, &mut |r: &mut dyn Read| {
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = r
                .read(&mut buf)
                .map_err(|e| invalid(format!("cannot read {name:?}: {e}")))?;
            if n == 0 {
                return Ok(());
            }
            written += n as u64;
            if written > declared {
                return Err(invalid(format!(
                    "package member {name:?} holds more than its declared {declared} bytes"
                )));
            }
            inspect(&buf[..n])?;
            out.write_all(&buf[..n])
                .map_err(|e| Error::io(format_args!("cannot write {}", path.display()), &e))?;
        }
    })?;
    if written != declared {
        return Err(invalid(format!(
            "package member {name:?} holds {written} bytes, not its declared {declared}"
        )));
    }
    out.flush()
        .map_err(|e| Error::io(format_args!("cannot write {}", path.display()), &e))
}
