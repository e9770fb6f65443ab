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

use tcg_core::artifact::package::Package;
use tcg_core::{Code, Error, Result};

/// Largest `.so` the native path loads (4 GiB).
pub const MAX_SHARED_OBJECT_BYTES: u64 = 4 << 30;
/// Largest wrapper source it reads (64 MiB).
pub const MAX_WRAPPER_BYTES: u64 = 64 << 20;
/// Largest single cubin it extracts (256 MiB).
pub const MAX_CUBIN_BYTES: u64 = 256 << 20;
/// Most cubins one entry may carry.
pub const MAX_CUBINS: usize = 65_536;

/// An entry's members, extracted; the directory is removed on drop.
#[derive(Debug)]
pub struct Extracted {
    dir: tempfile::TempDir,
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
    let wrapper = pkg.read(&members.wrapper).map_err(rewrap)?;
    let wrapper = String::from_utf8(wrapper)
        .map_err(|_| invalid(format!("wrapper {:?} is not UTF-8", members.wrapper)))?;

    let dir = tempfile::Builder::new()
        .prefix("tcg-native-")
        .tempdir()
        .map_err(|e| Error::io("cannot create a private directory for the graph's .so", &e))?;
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
    Ok(Extracted {
        dir,
        shared_object,
        wrapper,
    })
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
