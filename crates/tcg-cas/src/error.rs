//! The one error type of the store, with stable codes (SPEC-v1 §12).

use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// Every failure of the store. `code()` gives the stable code string.
///
/// Only `DigestMismatch`, `LengthMismatch`, `ObjectMissing`, `NotRegularFile`
/// and `ManifestInvalid` are evidence that stored bytes are wrong; `Io` never is
/// (ENOSPC, EROFS, EIO, EACCES, ... stay `Io` with their errno).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Bytes do not hash to the digest that names or declares them.
    #[error("digest mismatch at {path}: expected sha256:{expected}, found sha256:{actual}")]
    DigestMismatch {
        /// The object (or temp) that was hashed.
        path: PathBuf,
        /// The digest the bytes should have had (64 hex).
        expected: String,
        /// The digest they have (64 hex).
        actual: String,
    },
    /// A stored object or chunk has the wrong length (code `store.digest_mismatch`).
    #[error(
        "length mismatch at {path} (sha256:{digest}): expected {expected} bytes, found {actual}"
    )]
    LengthMismatch {
        /// The object path.
        path: PathBuf,
        /// Its digest (64 hex).
        digest: String,
        /// The length the manifest or caller declared.
        expected: u64,
        /// The length found.
        actual: u64,
    },
    /// No object is stored under this digest.
    #[error("object sha256:{digest} is missing ({path})")]
    ObjectMissing {
        /// The digest (64 hex).
        digest: String,
        /// Where it should be.
        path: PathBuf,
    },
    /// A store path is a symlink, FIFO, directory, socket or device, not a regular file.
    #[error("not a regular file: {path} ({found})")]
    NotRegularFile {
        /// The offending path.
        path: PathBuf,
        /// What was found there, such as "symlink" or "fifo".
        found: &'static str,
    },
    /// A ref name or ref record is invalid (code `store.ref_invalid`).
    #[error("invalid ref {name:?}: {reason}")]
    RefInvalid {
        /// The ref name as requested.
        name: String,
        /// What is wrong, in lowercase prose.
        reason: String,
    },
    /// Setting a ref would name an object or manifest closure that is not present.
    #[error("closure of ref {name:?} is missing: sha256:{digest}: {reason}")]
    ClosureMissing {
        /// The ref name.
        name: String,
        /// The digest that is missing or does not load (64 hex).
        digest: String,
        /// Why, in lowercase prose.
        reason: String,
    },
    /// The store root's `FORMAT` names another format, or the root is not a store.
    #[error("unsupported store format at {path}: {found}")]
    FormatUnsupported {
        /// The `FORMAT` file or root.
        path: PathBuf,
        /// What was found, for people.
        found: String,
    },
    /// The root is a store of torch-compiled-graphs 0.2.0 (a HashRepo root:
    /// `objects/sha256/` and `refs/` without `FORMAT`), which is not read in
    /// place; its graphs are adopted into a new root (code `store.hashrepo_root`).
    #[error("{path} is a torch-compiled-graphs 0.2.0 store (HashRepo layout), which this version does not open in place; adopt its graphs into a new store with `torch-compiled-graphs adopt --from-hashrepo {path} --cas-root NEW_ROOT` (the old root is only read)")]
    HashRepoRoot {
        /// The old root.
        path: PathBuf,
    },
    /// A manifest or ref record has an integer `format` other than 1: an
    /// unreadable format (SPEC-v1 §10.9), a miss for the engine
    /// (code `store.format_unsupported`).
    #[error("unreadable record format {format} in sha256:{digest}")]
    RecordFormatUnsupported {
        /// The manifest digest, or the ref name's hash for ref records (64 hex).
        digest: String,
        /// The format integer found.
        format: i64,
    },
    /// A manifest object hashes correctly but breaks a §9.3 rule
    /// (code `store.manifest_invalid`, evidence of bad stored bytes).
    #[error("invalid manifest sha256:{digest}: {reason}")]
    ManifestInvalid {
        /// The manifest digest (64 hex).
        digest: String,
        /// What is wrong, in lowercase prose.
        reason: String,
    },
    /// GC refuses to run on a network or cluster filesystem.
    #[error("refusing gc on network filesystem {name} (statfs type {magic:#x}) at {path}")]
    NetworkFilesystem {
        /// The store root.
        path: PathBuf,
        /// The `statfs` f_type.
        magic: u64,
        /// Its name, such as "nfs".
        name: &'static str,
    },
    /// GC could not read a ref record or a needed manifest and deleted nothing.
    #[error("gc aborted, nothing deleted: {reason}")]
    GcAborted {
        /// What could not be read, for people.
        reason: String,
        /// The underlying failure.
        #[source]
        source: Box<StoreError>,
    },
    /// A named (mint) lock was not acquired within the caller's timeout.
    #[error("timed out after {waited:?} waiting for lock {name:?}")]
    MintLockTimeout {
        /// The lock name (the key).
        name: String,
        /// How long the caller waited.
        waited: Duration,
    },
    /// A materialization destination already exists; nothing was replaced
    /// (code `io.destination_occupied`).
    #[error("destination already exists: {path}")]
    DestinationOccupied {
        /// The destination.
        path: PathBuf,
    },
    /// A store directory or file can be written by another local user (or is
    /// a symlink where the store keeps a directory): the store refuses to
    /// serve from it (code `store.insecure_permissions`).
    #[error("insecure store permissions at {path}: {reason}; make it owned by you and run `chmod go-w {path}`")]
    InsecurePermissions {
        /// The offending directory or file.
        path: PathBuf,
        /// What is wrong, in lowercase prose.
        reason: String,
    },
    /// A read-only operation named a root that holds no store; nothing was
    /// created (code `store.not_found`).
    #[error("no store at {path}: {reason}")]
    NotFound {
        /// The root as given.
        path: PathBuf,
        /// What is missing, in lowercase prose.
        reason: String,
    },
    /// An I/O failure that proves nothing about stored bytes; errno preserved.
    #[error("i/o error during {op} on {path}: {source}")]
    Io {
        /// The operation, such as "write" or "fsync".
        op: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The error, with its errno.
        #[source]
        source: io::Error,
    },
}

impl StoreError {
    /// The stable code string of this error (SPEC-v1 §12).
    pub fn code(&self) -> &'static str {
        match self {
            StoreError::DigestMismatch { .. } | StoreError::LengthMismatch { .. } => {
                "store.digest_mismatch"
            }
            StoreError::ObjectMissing { .. } => "store.object_missing",
            StoreError::NotRegularFile { .. } => "store.not_regular_file",
            StoreError::RefInvalid { .. } => "store.ref_invalid",
            StoreError::ClosureMissing { .. } => "store.closure_missing",
            StoreError::FormatUnsupported { .. } | StoreError::RecordFormatUnsupported { .. } => {
                "store.format_unsupported"
            }
            StoreError::ManifestInvalid { .. } => "store.manifest_invalid",
            StoreError::HashRepoRoot { .. } => "store.hashrepo_root",
            StoreError::NetworkFilesystem { .. } => "store.network_filesystem",
            StoreError::GcAborted { .. } => "store.gc_aborted",
            StoreError::MintLockTimeout { .. } => "store.mint_lock_timeout",
            StoreError::DestinationOccupied { .. } => "io.destination_occupied",
            StoreError::InsecurePermissions { .. } => "store.insecure_permissions",
            StoreError::NotFound { .. } => "store.not_found",
            StoreError::Io { .. } => "io.error",
        }
    }

    /// True when this error proves that stored bytes are wrong or absent
    /// (the engine's quarantine evidence, SPEC-v1 §10.1).
    pub fn is_bad_stored_bytes(&self) -> bool {
        matches!(
            self,
            StoreError::DigestMismatch { .. }
                | StoreError::LengthMismatch { .. }
                | StoreError::ObjectMissing { .. }
                | StoreError::NotRegularFile { .. }
                | StoreError::ManifestInvalid { .. }
        )
    }

    /// The errno of an `Io` error, if any.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            StoreError::Io { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }

    /// Wrap into an `io::Error` (for `Read`/`Write` impls); recover with
    /// [`StoreError::from_io`] or [`store_error_of`].
    pub fn into_io(self) -> io::Error {
        let kind = match &self {
            // keep the kind (ENOSPC -> StorageFull, ...) visible to plain io users
            StoreError::Io { source, .. } => source.kind(),
            _ => io::ErrorKind::Other,
        };
        io::Error::new(kind, self)
    }

    /// Recover a typed error from an `io::Error` produced by a store reader or
    /// writer; a plain `io::Error` becomes `Io` with `op` and `path`.
    pub fn from_io(err: io::Error, op: &'static str, path: impl Into<PathBuf>) -> StoreError {
        if err.get_ref().is_some_and(|e| e.is::<StoreError>()) {
            match err.into_inner().map(|b| b.downcast::<StoreError>()) {
                Some(Ok(e)) => return *e,
                _ => unreachable!("checked above"),
            }
        }
        StoreError::Io {
            op,
            path: path.into(),
            source: err,
        }
    }
}

/// The typed store error carried inside an `io::Error`, if there is one.
pub fn store_error_of(err: &io::Error) -> Option<&StoreError> {
    err.get_ref().and_then(|e| e.downcast_ref::<StoreError>())
}

/// Result alias of the store.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

pub(crate) fn io_err(
    op: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(io::Error) -> StoreError {
    let path = path.into();
    move |source| StoreError::Io { op, path, source }
}
