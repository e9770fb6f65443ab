//! Objects: the only write path (install) and verified reads (SPEC-v1 §9.2).

use std::fs::{self, File, Permissions};
use std::io::{self, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::digest::Hasher;
use crate::error::{io_err, Result, StoreError};
use crate::fsutil;
use crate::lease::{Lease, LeaseCore, TempFile};
use crate::{Digest, Store};

/// Buffer length of streaming reads and writes.
pub(crate) const IO_BUF: usize = 1 << 20;

impl Store {
    /// Install `bytes` as an object and pin it in `lease`. Returns its digest.
    pub fn put_bytes(&self, lease: &Lease, bytes: &[u8]) -> Result<Digest> {
        let digest = Digest::of(bytes);
        let mut temp = lease.create_temp()?;
        temp.file()
            .write_all(bytes)
            .map_err(io_err("write", &temp.path))?;
        self.install_temp(lease.core(), temp, &digest, bytes.len() as u64)?;
        Ok(digest)
    }

    /// Install the bytes of `reader` as one object (bounded memory), hashing as
    /// it writes. With `expected`, bytes of another digest are refused
    /// (`store.digest_mismatch`) and nothing is installed.
    /// Returns the digest and length.
    pub fn put_reader(
        &self,
        lease: &Lease,
        mut reader: impl Read,
        expected: Option<&Digest>,
    ) -> Result<(Digest, u64)> {
        let mut temp = lease.create_temp()?;
        let mut hasher = Hasher::default();
        let mut buf = vec![0u8; IO_BUF];
        let mut len = 0u64;
        loop {
            let n = match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(StoreError::from_io(e, "read source", "<reader>")),
            };
            hasher.update(&buf[..n]);
            temp.file()
                .write_all(&buf[..n])
                .map_err(io_err("write", &temp.path))?;
            len += n as u64;
        }
        let digest = hasher.finish();
        if let Some(exp) = expected {
            if *exp != digest {
                return Err(StoreError::DigestMismatch {
                    path: temp.path.clone(),
                    expected: exp.to_hex(),
                    actual: digest.to_hex(),
                });
            }
        }
        self.install_temp(lease.core(), temp, &digest, len)?;
        Ok((digest, len))
    }

    /// Install the contents of the file at `path` as one object.
    pub fn put_file(&self, lease: &Lease, path: &Path) -> Result<(Digest, u64)> {
        let f = File::open(path).map_err(io_err("open", path))?;
        self.put_reader(lease, f, None)
    }

    /// Publish a fully written temp as object `digest` of `len` bytes
    /// (SPEC-v1 §9.2 steps 2–6).
    pub(crate) fn install_temp(
        &self,
        lease: &LeaseCore,
        mut temp: TempFile,
        digest: &Digest,
        len: u64,
    ) -> Result<()> {
        {
            let f = temp.file.as_ref().expect("temp file open");
            f.sync_all().map_err(io_err("fsync", &temp.path))?;
            f.set_permissions(Permissions::from_mode(0o444))
                .map_err(io_err("chmod", &temp.path))?;
        }
        temp.file.take();
        let _shared = self.shared_lock()?;
        lease.pin_locked(digest)?;
        let dest = self.object_path(digest);
        let leaf = dest.parent().expect("object has a parent").to_path_buf();
        let _stripe = self.object_stripe(digest)?;
        let made = fsutil::create_dirs_tracked(&self.objects_dir(), &leaf)?;
        match fs::hard_link(&temp.path, &dest) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                match verify_object(&dest, digest, Some(len)) {
                    Ok(()) => {}
                    Err(err) if err.is_bad_stored_bytes() => {
                        self.move_to_corrupt(&dest, digest)?;
                        fs::hard_link(&temp.path, &dest).map_err(io_err("link", &dest))?;
                    }
                    Err(err) => return Err(err),
                }
            }
            Err(e) => return Err(io_err("link", &dest)(e)),
        }
        // The resident may have been linked by a writer that died before its
        // directory fsync; fsync the leaf in every case.
        fsutil::fsync_dir(&leaf)?;
        for d in &made {
            fsutil::fsync_dir(d.parent().expect("fan-out dir has a parent"))?;
        }
        drop(temp);
        Ok(())
    }

    /// Move a resident that failed verification to `corrupt/`. The caller holds
    /// the object's stripe lock.
    pub(crate) fn move_to_corrupt(&self, path: &Path, digest: &Digest) -> Result<PathBuf> {
        let to =
            self.dir("corrupt")
                .join(format!("{}.{}", digest.to_hex(), fsutil::random_hex32()));
        fs::rename(path, &to).map_err(io_err("rename to corrupt", path))?;
        fsutil::fsync_dir(&self.dir("corrupt"))?;
        if let Some(p) = path.parent() {
            fsutil::fsync_dir(p)?;
        }
        Ok(to)
    }

    /// The length of object `digest` by `lstat` (no hashing); `None` when
    /// absent. A non-regular entry is `store.not_regular_file`.
    pub fn object_len(&self, digest: &Digest) -> Result<Option<u64>> {
        let p = self.object_path(digest);
        match fs::symlink_metadata(&p) {
            Ok(md) if md.file_type().is_file() => Ok(Some(md.len())),
            Ok(md) => Err(StoreError::NotRegularFile {
                path: p,
                found: fsutil::type_name(&md),
            }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err("lstat", &p)(e)),
        }
    }

    /// Pin `digest` in `lease` and open it for streaming. With `expected_len`
    /// the object must have that length. With `verify`, the reader hashes as it
    /// goes and fails at the end on a mismatch (withholding the final bytes).
    pub fn open_object(
        &self,
        lease: &Lease,
        digest: &Digest,
        expected_len: Option<u64>,
        verify: bool,
    ) -> Result<ObjectReader> {
        lease.pin(std::slice::from_ref(digest))?;
        self.open_object_pinned(digest, expected_len, verify)
    }

    pub(crate) fn open_object_pinned(
        &self,
        digest: &Digest,
        expected_len: Option<u64>,
        verify: bool,
    ) -> Result<ObjectReader> {
        let path = self.object_path(digest);
        let (file, md) = fsutil::open_regular(&path)?.ok_or_else(|| StoreError::ObjectMissing {
            digest: digest.to_hex(),
            path: path.clone(),
        })?;
        if let Some(exp) = expected_len {
            if md.len() != exp {
                return Err(StoreError::LengthMismatch {
                    path,
                    digest: digest.to_hex(),
                    expected: exp,
                    actual: md.len(),
                });
            }
        }
        Ok(ObjectReader {
            file,
            path,
            digest: *digest,
            len: md.len(),
            pos: 0,
            hasher: verify.then(Hasher::default),
        })
    }

    /// Read a whole object into memory, verified, refusing objects longer than
    /// `max_len` (`store.digest_mismatch` via length).
    pub fn read_object(&self, lease: &Lease, digest: &Digest, max_len: u64) -> Result<Vec<u8>> {
        lease.pin(std::slice::from_ref(digest))?;
        read_object_verified(&self.object_path(digest), digest, max_len)
    }
}

/// Read and verify a small object without a lease (the caller holds a lock
/// that excludes GC, or only parses).
pub(crate) fn read_object_verified(path: &Path, digest: &Digest, max_len: u64) -> Result<Vec<u8>> {
    let bytes = read_object_unverified(path, digest, max_len)?;
    let actual = Digest::of(&bytes);
    if actual != *digest {
        return Err(StoreError::DigestMismatch {
            path: path.to_owned(),
            expected: digest.to_hex(),
            actual: actual.to_hex(),
        });
    }
    Ok(bytes)
}

pub(crate) fn read_object_unverified(
    path: &Path,
    digest: &Digest,
    max_len: u64,
) -> Result<Vec<u8>> {
    let (mut file, md) = fsutil::open_regular(path)?.ok_or_else(|| StoreError::ObjectMissing {
        digest: digest.to_hex(),
        path: path.to_owned(),
    })?;
    if md.len() > max_len {
        return Err(StoreError::LengthMismatch {
            path: path.to_owned(),
            digest: digest.to_hex(),
            expected: max_len,
            actual: md.len(),
        });
    }
    let mut bytes = Vec::with_capacity(md.len() as usize);
    (&mut file)
        .take(md.len())
        .read_to_end(&mut bytes)
        .map_err(io_err("read", path))?;
    if bytes.len() as u64 != md.len() {
        return Err(StoreError::LengthMismatch {
            path: path.to_owned(),
            digest: digest.to_hex(),
            expected: md.len(),
            actual: bytes.len() as u64,
        });
    }
    Ok(bytes)
}

/// Rehash a resident object: regular file, not a symlink, right length (when
/// given) and digest. Typed errors; I/O errors stay `Io`.
pub(crate) fn verify_object(path: &Path, digest: &Digest, len: Option<u64>) -> Result<()> {
    let (mut file, md) = fsutil::open_regular(path)?.ok_or_else(|| StoreError::ObjectMissing {
        digest: digest.to_hex(),
        path: path.to_owned(),
    })?;
    if let Some(l) = len {
        if md.len() != l {
            return Err(StoreError::LengthMismatch {
                path: path.to_owned(),
                digest: digest.to_hex(),
                expected: l,
                actual: md.len(),
            });
        }
    }
    let mut hasher = Hasher::default();
    let mut buf = vec![0u8; IO_BUF];
    let mut total = 0u64;
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_err("read", path)(e)),
        };
        hasher.update(&buf[..n]);
        total += n as u64;
    }
    if total != md.len() {
        return Err(StoreError::LengthMismatch {
            path: path.to_owned(),
            digest: digest.to_hex(),
            expected: md.len(),
            actual: total,
        });
    }
    let actual = hasher.finish();
    if actual != *digest {
        return Err(StoreError::DigestMismatch {
            path: path.to_owned(),
            expected: digest.to_hex(),
            actual: actual.to_hex(),
        });
    }
    Ok(())
}

/// A streaming reader over one object. With verification on, the read that
/// reaches the end fails instead of returning its bytes when the digest does
/// not match; recover the typed error with [`StoreError::from_io`] or
/// [`crate::store_error_of`].
#[derive(Debug)]
pub struct ObjectReader {
    file: File,
    path: PathBuf,
    digest: Digest,
    len: u64,
    pos: u64,
    hasher: Option<Hasher>,
}

impl std::fmt::Debug for Hasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hasher")
    }
}

impl ObjectReader {
    /// The object's length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the object is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The object's digest.
    pub fn digest(&self) -> &Digest {
        &self.digest
    }

    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    fn finish_check(&mut self) -> io::Result<()> {
        if let Some(h) = self.hasher.take() {
            let actual = h.finish();
            if actual != self.digest {
                return Err(StoreError::DigestMismatch {
                    path: self.path.clone(),
                    expected: self.digest.to_hex(),
                    actual: actual.to_hex(),
                }
                .into_io());
            }
        }
        Ok(())
    }
}

impl Read for ObjectReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.pos == self.len {
            self.finish_check()?;
            return Ok(0);
        }
        if buf.is_empty() {
            return Ok(0);
        }
        let want = (buf.len() as u64).min(self.len - self.pos) as usize;
        let n = match self.file.read(&mut buf[..want]) {
            Ok(n) => n,
            Err(e) => return Err(io_err("read", &self.path)(e).into_io()),
        };
        if n == 0 {
            return Err(StoreError::LengthMismatch {
                path: self.path.clone(),
                digest: self.digest.to_hex(),
                expected: self.len,
                actual: self.pos,
            }
            .into_io());
        }
        if let Some(h) = self.hasher.as_mut() {
            h.update(&buf[..n]);
        }
        self.pos += n as u64;
        if self.pos == self.len {
            self.finish_check()?;
        }
        Ok(n)
    }
}
