//! Destination rules (SPEC-v1 §10.1, §10.2 steps 5 and 9): never overwrite;
//! accept an occupied destination only when it holds exactly the selected bytes.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use crate::artifact::publish::{fsync_parent, rename_noreplace, Temp};
use crate::{Code, Error, Result};

const COMPARE_CHUNK: usize = 1 << 20;

pub(crate) fn occupied(dest: &Path, why: &str) -> Error {
    Error::io_code(
        Code::IoDestinationOccupied,
        Some(libc::EEXIST),
        format!(
            "destination {} is not the selected compiled-graph artifact: {why}",
            dest.display()
        ),
    )
}

/// Step 5: an absent destination, or an empty directory (removed with `rmdir`,
/// which fails if it has meanwhile filled), may be published to; an occupied
/// directory is compared at publication; a file or symlink is refused now.
/// Returns the mode of an empty directory that was removed: the published
/// directory gets the same mode (the caller chose it, e.g. 0700).
pub(crate) fn prepare_directory_destination(dest: &Path) -> Result<Option<u32>> {
    let meta = match std::fs::symlink_metadata(dest) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(Error::io(
                format_args!("cannot inspect {}", dest.display()),
                &e,
            ))
        }
    };
    let ft = meta.file_type();
    if ft.is_symlink() {
        return Err(Error::io_code(
            Code::IoDestinationOccupied,
            Some(libc::EEXIST),
            format!(
                "destination {} is a symlink and is never followed or replaced",
                dest.display()
            ),
        ));
    }
    if ft.is_file() {
        return Err(Error::io_code(
            Code::IoDestinationNotDirectory,
            Some(libc::ENOTDIR),
            format!("destination {} is a file, not a directory", dest.display()),
        ));
    }
    if !ft.is_dir() {
        return Err(occupied(dest, "it is not a directory"));
    }
    match std::fs::remove_dir(dest) {
        Ok(()) => Ok(Some(meta.mode() & 0o7777)),
        // Not empty (or raced to non-empty): compared at publication.
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTEMPTY) | Some(libc::EEXIST)) => {
            Ok(None)
        }
        Err(e) => Err(Error::io(
            format_args!("cannot inspect {}", dest.display()),
            &e,
        )),
    }
}

/// Step 9–10: publish `stage` at `dest` without replacing anything; if `dest`
/// is occupied, accept it only if byte-identical to the stage. Then fsync the
/// parent.
pub(crate) fn publish_stage(mut stage: Temp, dest: &Path, mode: Option<u32>) -> Result<()> {
    stage.set_final_mode(mode)?;
    match rename_noreplace(stage.path(), dest) {
        // The stage path no longer exists, so dropping `stage` removes nothing.
        Ok(()) => {}
        Err(e) if e.code() == Code::IoDestinationOccupied => {
            same_tree(stage.path(), dest)?;
        }
        Err(e) => return Err(e),
    }
    drop(stage);
    fsync_parent(dest)
}

fn dir_identity(path: &Path) -> Result<(u64, u64, i64, i64)> {
    let m = std::fs::symlink_metadata(path)
        .map_err(|e| Error::io(format_args!("cannot inspect {}", path.display()), &e))?;
    if !m.file_type().is_dir() {
        return Err(occupied(path, "it is not a directory"));
    }
    Ok((m.dev(), m.ino(), m.mtime(), m.mtime_nsec()))
}

fn names(dir: &Path) -> Result<Vec<std::ffi::OsString>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)
        .map_err(|e| Error::io(format_args!("cannot list {}", dir.display()), &e))?
    {
        out.push(
            entry
                .map_err(|e| Error::io(format_args!("cannot list {}", dir.display()), &e))?
                .file_name(),
        );
    }
    out.sort();
    Ok(out)
}

/// `(dev, ino, size, mtime, mtime_nsec)`: what must not change while a file is compared.
type FileIdentity = (u64, u64, u64, i64, i64);

fn open_regular(path: &Path) -> Result<(File, FileIdentity)> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| Error::io(format_args!("cannot open {}", path.display()), &e))?;
    let m = f
        .metadata()
        .map_err(|e| Error::io(format_args!("cannot stat {}", path.display()), &e))?;
    if !m.file_type().is_file() {
        return Err(occupied(path, "an entry is not a regular file"));
    }
    Ok((f, (m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec())))
}

fn read_full(f: &mut File, buf: &mut [u8], path: &Path) -> Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        let n = f
            .read(&mut buf[filled..])
            .map_err(|e| Error::io(format_args!("cannot read {}", path.display()), &e))?;
        if n == 0 {
            break;
        }
        filled += n;
    }
    Ok(filled)
}

/// Whether two files hold the same bytes, with the destination's identity
/// stable across the read.
fn same_file(ours: &Path, theirs: &Path) -> Result<()> {
    let (mut a, a_id) = open_regular(ours)?;
    let (mut b, b_id) = open_regular(theirs)?;
    if a_id.2 != b_id.2 {
        return Err(occupied(theirs, "sizes differ"));
    }
    let mut ba = vec![0u8; COMPARE_CHUNK];
    let mut bb = vec![0u8; COMPARE_CHUNK];
    loop {
        let na = read_full(&mut a, &mut ba, ours)?;
        let nb = read_full(&mut b, &mut bb, theirs)?;
        if na != nb || ba[..na] != bb[..nb] {
            return Err(occupied(theirs, "bytes differ"));
        }
        if na == 0 {
            break;
        }
    }
    let (_, after) = open_regular(theirs)?;
    if after != b_id {
        return Err(occupied(theirs, "it changed while it was compared"));
    }
    Ok(())
}

/// The occupied-destination comparison of SPEC-v1 §10.2 step 9.
pub(crate) fn same_tree(stage: &Path, dest: &Path) -> Result<()> {
    let before = dir_identity(dest)?;
    let ours = names(stage)?;
    if names(dest)? != ours {
        return Err(occupied(dest, "its entries differ"));
    }
    for name in &ours {
        same_file(&stage.join(name), &dest.join(name))?;
    }
    if dir_identity(dest)? != before {
        return Err(occupied(dest, "it changed while it was compared"));
    }
    Ok(())
}
