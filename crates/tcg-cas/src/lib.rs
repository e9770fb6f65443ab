//! The content-addressed store of torch-compiled-graphs (SPEC-v1 §9).
//!
//! It knows nothing about graphs: objects, manifests, refs, leases, GC.
//!
//! ```text
//! <root>/FORMAT                          "torch-compiled-graphs-store 1\n"
//! <root>/objects/sha256/ab/cd/<64 hex>   immutable objects, mode 0444
//! <root>/refs/<hex64(sha256(name))>      ref records (CJ), replaced atomically
//! <root>/leases/<32 hex>                 live writers and readers (flock held)
//! <root>/tmp/<lease>.<n>                 temps, reaped by lease liveness only
//! <root>/corrupt/<64 hex>.<32 hex>       residents that failed re-verification
//! <root>/locks/store, object-XX, ref-XX  store lock and 2 x 256 stripe locks
//! <root>/locks/mint/<hex64(sha256(k))>   named single-flight locks
//! <root>/locks/ref-generation            ref generation counter (8 bytes)
//! <root>/uses/<hex64(sha256(name))>      best-effort last-use stamps (eviction)
//! ```
//!
//! See `docs/store.md` for the guarantees and the choices made where the
//! specification is silent.
#![deny(missing_docs)]

mod digest;
mod error;
mod fsck;
mod fsutil;
mod gc;
mod lease;
mod lock;
mod manifest;
mod materialize;
mod object;
mod refs;
mod secure;

use std::collections::HashSet;
use std::fs::{self, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub use digest::{name_hash, Digest};
pub use error::{store_error_of, Result, StoreError};
pub use fsck::{CorruptObject, DanglingRef, FsckOptions, FsckReport};
pub use fsutil::network_filesystem_name;
pub use gc::{GcOptions, GcReport, StoreStats};
pub use lease::Lease;
pub use lock::NamedLock;
pub use manifest::{
    first_chunk_channel, Chunk, ChunkedReader, ChunkedWriter, FirstChunkSender, FirstChunkState,
    Manifest, ManifestInfo, SharedBytes, StoredFile,
};
pub use materialize::{MaterializeMethod, MaterializeReport};
pub use object::ObjectReader;
pub use refs::{
    validate_ref_name, CasOutcome, RefEntry, RefKind, RefListing, Target, MAX_REF_NAME_BYTES,
};

use error::io_err;
use fsutil::FileLock;

/// The ref prefix of compiled-graph records (SPEC-v1 §9.5, wire identity).
pub const GRAPH_REF_PREFIX: &str = "torch-compiled-graphs/v1/graphs/";
/// The ref prefix of quarantine markers (SPEC-v1 §9.5, wire identity).
pub const QUARANTINE_REF_PREFIX: &str = "torch-compiled-graphs/v1/quarantine/";
/// Fixed chunk length of manifests (SPEC-v1 §9.3).
pub const MAX_CHUNK_BYTES: u64 = 67_108_864;
/// The exact contents of `<root>/FORMAT` (SPEC-v1 §9.1).
pub const STORE_FORMAT_LINE: &str = "torch-compiled-graphs-store 1\n";

/// A handle on one store root. Cheap to clone; `Send + Sync`.
#[derive(Clone, Debug)]
pub struct Store {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    root: PathBuf,
    chunk_bytes: u64,
    /// (source st_dev, destination st_dev) pairs where reflink failed.
    no_reflink: Mutex<HashSet<(u64, u64)>>,
}

/// Options of [`Store::open_with`].
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// Manifest chunk length. Only tests change it: a store opened with another
    /// value writes manifests that other stores refuse.
    #[doc(hidden)]
    pub chunk_bytes: u64,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            chunk_bytes: MAX_CHUNK_BYTES,
        }
    }
}

/// The store's fixed directories, parents before children.
const DIRS: [&str; 9] = [
    "objects",
    "objects/sha256",
    "refs",
    "leases",
    "tmp",
    "corrupt",
    "locks",
    "locks/mint",
    "uses",
];

impl Store {
    /// Open the store at `root`, initialising it (with `FORMAT`) when the
    /// directory is absent or empty. A root whose `FORMAT` names another format,
    /// or a non-empty directory without `FORMAT`, is refused
    /// (`store.format_unsupported`). Directories are created with mode 0700
    /// whatever the umask; a root or store directory that another user can
    /// write, or a symlink where a store directory should be, is refused
    /// (`store.insecure_permissions`).
    pub fn open(root: impl AsRef<Path>) -> Result<Store> {
        Store::open_with(root, StoreOptions::default())
    }

    /// Open an existing store without creating anything: a missing root, a
    /// root without `FORMAT` or a missing store directory is
    /// `store.not_found`. For read-only operations (listing, statistics,
    /// fsck), so that a mistyped root is an error, not a new store.
    pub fn open_existing(root: impl AsRef<Path>) -> Result<Store> {
        let root = root.as_ref().to_path_buf();
        let not_found = |reason: &str| StoreError::NotFound {
            path: root.clone(),
            reason: reason.to_string(),
        };
        match fs::metadata(&root) {
            Ok(md) if md.is_dir() => {}
            Ok(_) => return Err(not_found("the root is not a directory")),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(not_found("the root does not exist"))
            }
            Err(e) => return Err(io_err("stat", &root)(e)),
        }
        if fs::symlink_metadata(root.join("FORMAT")).is_err() {
            if is_hashrepo_root(&root) {
                return Err(StoreError::HashRepoRoot { path: root });
            }
            return Err(not_found("the root has no FORMAT file"));
        }
        check_or_init_format(&root)?;
        for d in DIRS {
            if !secure::check_dir(&root.join(d))? {
                return Err(not_found(&format!("the store directory {d}/ is missing")));
            }
        }
        Store::open_with(root, StoreOptions::default())
    }

    /// [`Store::open`] with options.
    pub fn open_with(root: impl AsRef<Path>, options: StoreOptions) -> Result<Store> {
        let root = root.as_ref().to_path_buf();
        if let Some(parent) = root.parent().filter(|p| !p.as_os_str().is_empty()) {
            fs::create_dir_all(parent).map_err(io_err("mkdir", parent))?;
        }
        secure::create_private_dir(&root)?;
        // The root is named by the caller and may be reached through a
        // symlink; what it resolves to must be private.
        let md = fs::metadata(&root).map_err(io_err("stat", &root))?;
        secure::check_md(&root, &md)?;
        check_or_init_format(&root)?;
        let mut created = false;
        for d in DIRS {
            let p = root.join(d);
            if !secure::check_dir(&p)? {
                secure::create_private_dir(&p)?;
                secure::check_dir(&p)?;
                created = true;
            }
        }
        if created {
            for d in ["", "objects", "locks"] {
                fsutil::fsync_dir(&root.join(d))?;
            }
        }
        assert!(options.chunk_bytes > 0, "chunk_bytes must be positive");
        Ok(Store {
            inner: Arc::new(Inner {
                root,
                chunk_bytes: options.chunk_bytes,
                no_reflink: Mutex::new(HashSet::new()),
            }),
        })
    }

    /// Re-check that the store's fixed directories are real directories that
    /// no other user can write (maintenance passes call this before they
    /// delete anything, since the store may have changed since it was opened).
    pub fn check_permissions(&self) -> Result<()> {
        let root = self.root();
        let md = fs::metadata(root).map_err(io_err("stat", root))?;
        secure::check_md(root, &md)?;
        for d in DIRS {
            let p = root.join(d);
            if !secure::check_dir(&p)? {
                return Err(StoreError::NotFound {
                    path: root.to_owned(),
                    reason: format!("the store directory {d}/ is missing"),
                });
            }
        }
        Ok(())
    }

    /// The store root.
    pub fn root(&self) -> &Path {
        &self.inner.root
    }

    /// The manifest chunk length of this store (64 MiB outside tests).
    pub fn chunk_bytes(&self) -> u64 {
        self.inner.chunk_bytes
    }

    pub(crate) fn dir(&self, name: &str) -> PathBuf {
        self.inner.root.join(name)
    }

    pub(crate) fn objects_dir(&self) -> PathBuf {
        self.inner.root.join("objects/sha256")
    }

    /// The path of the object named `digest` (whether or not it exists).
    pub fn object_path(&self, digest: &Digest) -> PathBuf {
        let h = digest.to_hex();
        self.objects_dir().join(&h[0..2]).join(&h[2..4]).join(h)
    }

    pub(crate) fn shared_lock(&self) -> Result<FileLock> {
        fsutil::lock_path(&self.inner.root.join("locks/store"), false)
    }

    pub(crate) fn exclusive_lock(&self) -> Result<FileLock> {
        fsutil::lock_path(&self.inner.root.join("locks/store"), true)
    }

    pub(crate) fn object_stripe(&self, digest: &Digest) -> Result<FileLock> {
        let p = self
            .inner
            .root
            .join(format!("locks/object-{:02x}", digest.0[0]));
        fsutil::lock_path(&p, true)
    }

    pub(crate) fn ref_stripe(&self, name_hex: &str) -> Result<FileLock> {
        let p = self
            .inner
            .root
            .join(format!("locks/ref-{}", &name_hex[0..2]));
        fsutil::lock_path(&p, true)
    }

    /// A temp path outside any lease (`tmp/<random 32 hex>.<tag>`): no lease
    /// file has that id, so a crash leftover is reaped as a dead lease's temp.
    /// Only used while the shared store lock is held (GC reaps under the
    /// exclusive one).
    pub(crate) fn anonymous_temp(&self, tag: &str) -> PathBuf {
        self.dir("tmp")
            .join(format!("{}.{}", fsutil::random_hex32(), tag))
    }
}

/// Whether `root` looks like a store of torch-compiled-graphs 0.2.0 (a
/// HashRepo root): `objects/sha256/` and `refs/` directories (not links) and
/// no `FORMAT`.
pub fn is_hashrepo_root(root: &Path) -> bool {
    let dir = |p: &str| fs::symlink_metadata(root.join(p)).is_ok_and(|m| m.is_dir());
    dir("objects")
        && dir("objects/sha256")
        && dir("refs")
        && fs::symlink_metadata(root.join("FORMAT")).is_err()
}

fn check_or_init_format(root: &Path) -> Result<()> {
    let fpath = root.join("FORMAT");
    loop {
        if let Some((mut f, md)) = fsutil::open_regular(&fpath).map_err(|e| match e {
            StoreError::NotRegularFile { .. } => StoreError::FormatUnsupported {
                path: fpath.clone(),
                found: "FORMAT is not a regular file".into(),
            },
            e => e,
        })? {
            let mut buf = Vec::new();
            (&mut f)
                .take(256)
                .read_to_end(&mut buf)
                .map_err(io_err("read", &fpath))?;
            if md.len() != STORE_FORMAT_LINE.len() as u64 || buf != STORE_FORMAT_LINE.as_bytes() {
                return Err(StoreError::FormatUnsupported {
                    path: fpath,
                    found: format!("FORMAT holds {:?}", String::from_utf8_lossy(&buf)),
                });
            }
            return Ok(());
        }
        // No FORMAT: only an empty root (or one holding initialisers' temps) is initialised.
        let mut foreign = None;
        for entry in fs::read_dir(root).map_err(io_err("read directory", root))? {
            let entry = entry.map_err(io_err("read directory", root))?;
            let name = entry.file_name();
            if !name.to_string_lossy().starts_with(".FORMAT.") {
                foreign = Some(name);
            }
        }
        if let Some(name) = foreign {
            // A concurrent initialiser links FORMAT before creating anything else.
            if fs::symlink_metadata(&fpath).is_ok() {
                continue;
            }
            if is_hashrepo_root(root) {
                return Err(StoreError::HashRepoRoot {
                    path: root.to_owned(),
                });
            }
            return Err(StoreError::FormatUnsupported {
                path: root.to_owned(),
                found: format!(
                    "non-empty directory without FORMAT (holds {:?})",
                    name.to_string_lossy()
                ),
            });
        }
        let tmp = root.join(format!(".FORMAT.{}", fsutil::random_hex32()));
        let write = || -> io::Result<()> {
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o644)
                .open(&tmp)?;
            f.write_all(STORE_FORMAT_LINE.as_bytes())?;
            f.set_permissions(fs::Permissions::from_mode(0o444))?;
            f.sync_all()
        };
        let res = write().map_err(io_err("write", &tmp));
        let linked = res.and_then(|()| match fs::hard_link(&tmp, &fpath) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(io_err("link", &fpath)(e)),
        });
        let _ = fs::remove_file(&tmp);
        linked?;
        fsutil::fsync_dir(root)?;
    }
}
