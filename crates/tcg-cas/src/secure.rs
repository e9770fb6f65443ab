//! Who may write the store: explicit private modes at creation, whatever the
//! umask, and a refusal to serve from a store that another local user can
//! write (`store.insecure_permissions`). `docs/store.md` states the threat
//! model.

use std::fs::{self, DirBuilder, Metadata, Permissions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::Path;

use crate::error::{io_err, Result, StoreError};

/// Mode of every directory the store creates (owner only), set explicitly
/// after creation so that no umask widens or narrows it.
pub(crate) const DIR_MODE: u32 = 0o700;

/// The effective user id of this process.
pub(crate) fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Why `md` lets a user other than this process's (and root) change what it
/// names, if it does: another owner can chmod it; a group- or other-writable
/// mode lets them write it (or, for a directory, replace its entries).
pub(crate) fn insecure_reason(md: &Metadata) -> Option<String> {
    let uid = md.uid();
    if uid != euid() && uid != 0 {
        return Some(format!(
            "owned by uid {uid}, not by this user (uid {}) or root",
            euid()
        ));
    }
    let mode = md.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Some(format!("mode {mode:04o} lets other users write it"));
    }
    None
}

/// Refuse `path` (already `lstat`ed or `fstat`ed as `md`) when another user
/// can write it.
pub(crate) fn check_md(path: &Path, md: &Metadata) -> Result<()> {
    match insecure_reason(md) {
        None => Ok(()),
        Some(reason) => Err(StoreError::InsecurePermissions {
            path: path.to_owned(),
            reason,
        }),
    }
}

/// `path` must be a real directory (not a symlink) that no other user can
/// write. `Ok(false)` when it does not exist.
pub(crate) fn check_dir(path: &Path) -> Result<bool> {
    let md = match fs::symlink_metadata(path) {
        Ok(md) => md,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io_err("lstat", path)(e)),
    };
    if !md.file_type().is_dir() {
        return Err(StoreError::InsecurePermissions {
            path: path.to_owned(),
            reason: format!(
                "a {} where the store keeps a directory (never followed)",
                crate::fsutil::type_name(&md)
            ),
        });
    }
    check_md(path, &md)?;
    Ok(true)
}

/// Create the directory `path` (its parent exists) with mode exactly
/// [`DIR_MODE`]. Returns whether this call created it; an existing entry is
/// left as it is (the caller checks it).
pub(crate) fn create_private_dir(path: &Path) -> Result<bool> {
    match DirBuilder::new().mode(DIR_MODE).create(path) {
        Ok(()) => {
            // The umask may have removed owner bits; set the mode exactly.
            fs::set_permissions(path, Permissions::from_mode(DIR_MODE))
                .map_err(io_err("chmod", path))?;
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(io_err("mkdir", path)(e)),
    }
}
