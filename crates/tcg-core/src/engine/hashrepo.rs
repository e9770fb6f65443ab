//! Reading a store written by torch-compiled-graphs 0.2.0 (a HashRepo root)
//! without trusting it, for [`Engine::adopt_hashrepo`](super::Engine::adopt_hashrepo).
//!
//! The old tree may belong to someone else or be damaged, so nothing in it is
//! believed: every directory and file is opened relative to its parent with
//! `O_NOFOLLOW` (a symlink anywhere below the root is refused), only regular
//! files are read, every read is bounded, a ref record's `name` must hash to
//! its file name, the manifest object is re-hashed, and the envelope is
//! streamed once from its objects while each chunk and the whole file are
//! hashed. Nothing is ever written to the old root.

use std::ffi::{CString, OsString};
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::Path;

use sha2::{Digest as _, Sha256};
use tcg_cas::{name_hash, Digest};
use tcg_cj::Value;

use crate::{Code, Error, Result};

/// The largest ref record read (the original wrote about 200 bytes).
pub const MAX_REF_RECORD_BYTES: u64 = 65_536;
/// The largest repository manifest read (a 13 GB envelope in 64 MiB chunks is about 25 KiB).
pub const MAX_REPO_MANIFEST_BYTES: u64 = 1_048_576;
/// The chunk length of HashRepo files; no chunk may be longer.
pub const HASHREPO_CHUNK_BYTES: u64 = 67_108_864;
/// The one file a graph's repository manifest lists.
pub const ENVELOPE_PATH: &str = "compiled_graph.tar.gz";

/// A directory of the old root, opened without following symlinks.
pub(crate) struct Dir {
    fd: OwnedFd,
    path: std::path::PathBuf,
}

fn cstr(name: &[u8]) -> io::Result<CString> {
    CString::new(name).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// Why a named thing in the old tree cannot be read, as a typed error:
/// a missing object, a symlink or other non-regular entry, or an I/O error.
fn open_error(what: &Path, err: io::Error) -> Error {
    match err.raw_os_error() {
        Some(libc::ENOENT) => Error::new(
            Code::StoreObjectMissing,
            format!("{} is missing", what.display()),
        ),
        Some(libc::ELOOP) | Some(libc::ENOTDIR) | Some(libc::ENXIO) => Error::new(
            Code::StoreNotRegularFile,
            format!(
                "{} is a symlink or not of the expected type; the old store is not trusted through links",
                what.display()
            ),
        ),
        _ => Error::io(format_args!("cannot open {}", what.display()), &err),
    }
}

impl Dir {
    /// Open the root itself (the path the user named may be a link; nothing below it may).
    pub(crate) fn open_root(path: &Path) -> Result<Dir> {
        let c = cstr(path.as_os_str().as_bytes())
            .map_err(|e| Error::io(format_args!("cannot open {}", path.display()), &e))?;
        // SAFETY: a valid C string; the returned descriptor is owned below.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(Error::io(
                format_args!("cannot open {}", path.display()),
                &io::Error::last_os_error(),
            ));
        }
        Ok(Dir {
            // SAFETY: fd is a fresh descriptor owned by nobody else.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            path: path.to_path_buf(),
        })
    }

    fn openat(&self, name: &[u8], flags: libc::c_int) -> io::Result<OwnedFd> {
        let c = cstr(name)?;
        // SAFETY: valid descriptor and C string; the result is owned below.
        let fd = unsafe {
            libc::openat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                flags | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// A subdirectory, refusing symlinks.
    pub(crate) fn subdir(&self, name: &str) -> Result<Dir> {
        let path = self.path.join(name);
        match self.openat(name.as_bytes(), libc::O_RDONLY | libc::O_DIRECTORY) {
            Ok(fd) => Ok(Dir { fd, path }),
            Err(e) => Err(open_error(&path, e)),
        }
    }

    /// Whether `name` is present here (as anything, links included).
    pub(crate) fn has(&self, name: &str) -> Result<bool> {
        let c = cstr(name.as_bytes()).map_err(|e| Error::io("bad name", &e))?;
        // SAFETY: an all-zero stat is a valid out-buffer for fstatat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: valid descriptor, C string and out-pointer.
        let rc = unsafe {
            libc::fstatat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                &mut st,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        if rc == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENOENT) {
            Ok(false)
        } else {
            Err(Error::io(
                format_args!("cannot stat {}", self.path.join(name).display()),
                &e,
            ))
        }
    }

    /// A regular file opened read-only (non-blocking, so a FIFO cannot stall
    /// us) with its size; symlinks and other types are `store.not_regular_file`.
    pub(crate) fn regular_file(&self, name: &str) -> Result<(File, u64)> {
        let path = self.path.join(name);
        let fd = self
            .openat(name.as_bytes(), libc::O_RDONLY | libc::O_NONBLOCK)
            .map_err(|e| open_error(&path, e))?;
        let file = File::from(fd);
        let md = file
            .metadata()
            .map_err(|e| Error::io(format_args!("cannot stat {}", path.display()), &e))?;
        if !md.file_type().is_file() {
            return Err(Error::new(
                Code::StoreNotRegularFile,
                format!("{} is not a regular file", path.display()),
            ));
        }
        Ok((file, md.len()))
    }

    /// The names in this directory (without `.` and `..`), sorted.
    pub(crate) fn entries(&self) -> Result<Vec<OsString>> {
        let fail =
            |e: io::Error| Error::io(format_args!("cannot list {}", self.path.display()), &e);
        // fdopendir takes ownership of its descriptor, so give it a duplicate.
        // SAFETY: duplicating a valid descriptor.
        let dup = unsafe { libc::fcntl(self.fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
        if dup < 0 {
            return Err(fail(io::Error::last_os_error()));
        }
        // SAFETY: dup is ours; on success the DIR owns it and closedir closes it.
        let dir = unsafe { libc::fdopendir(dup) };
        if dir.is_null() {
            let e = io::Error::last_os_error();
            // SAFETY: fdopendir failed, so dup is still ours to close.
            unsafe { libc::close(dup) };
            return Err(fail(e));
        }
        // SAFETY: a fresh DIR stream starts at the beginning after rewind.
        unsafe { libc::rewinddir(dir) };
        let mut names = Vec::new();
        loop {
            // SAFETY: errno is thread-local; readdir on a valid stream.
            unsafe { *libc::__errno_location() = 0 };
            let ent = unsafe { libc::readdir(dir) };
            if ent.is_null() {
                let e = io::Error::last_os_error();
                // SAFETY: closing the stream we opened.
                unsafe { libc::closedir(dir) };
                if e.raw_os_error().unwrap_or(0) != 0 {
                    return Err(fail(e));
                }
                break;
            }
            // SAFETY: d_name is a NUL-terminated array inside the entry.
            let name = unsafe { std::ffi::CStr::from_ptr((*ent).d_name.as_ptr()) };
            let bytes = name.to_bytes();
            if bytes != b"." && bytes != b".." {
                names.push(OsString::from_vec(bytes.to_vec()));
            }
        }
        names.sort();
        Ok(names)
    }
}

/// Read at most `limit` bytes of a file whose size was checked against it.
fn read_bounded(mut file: File, size: u64, limit: u64, what: &Path) -> Result<Vec<u8>> {
    if size > limit {
        return Err(Error::new(
            Code::StoreRefInvalid,
            format!(
                "{} is {size} bytes, over the limit of {limit}",
                what.display()
            ),
        ));
    }
    let mut buf = Vec::with_capacity(size as usize);
    (&mut file)
        .take(limit + 1)
        .read_to_end(&mut buf)
        .map_err(|e| Error::io(format_args!("cannot read {}", what.display()), &e))?;
    if buf.len() as u64 > limit {
        return Err(Error::new(
            Code::StoreRefInvalid,
            format!("{} grew past the limit of {limit} bytes", what.display()),
        ));
    }
    Ok(buf)
}

/// A checked ref record of the old store.
pub(crate) struct RefRecord {
    pub(crate) name: String,
    pub(crate) target: Digest,
}

/// Read and check `refs/<file>`: a regular file of at most
/// [`MAX_REF_RECORD_BYTES`], strict JSON `{"format":1,"name":…,"target":"sha256:…"}`
/// whose `name` hashes to the file name.
pub(crate) fn read_ref(refs: &Dir, file: &str) -> Result<RefRecord> {
    let path = refs.path.join(file);
    let invalid = |why: String| {
        Error::new(
            Code::StoreRefInvalid,
            format!("ref record {}: {why}", path.display()),
        )
    };
    if !tcg_cj::is_hex(file, 64) {
        return Err(invalid(
            "the file name is not the 64-hex hash of a ref name".into(),
        ));
    }
    let (f, size) = refs.regular_file(file)?;
    let bytes = read_bounded(f, size, MAX_REF_RECORD_BYTES, &path)?;
    let value = tcg_cj::parse_strict(&bytes).map_err(|e| invalid(format!("not JSON: {e}")))?;
    let obj = value
        .as_object()
        .ok_or_else(|| invalid("not an object".into()))?;
    if obj.len() != 3 {
        return Err(invalid(
            "members are not exactly format, name and target".into(),
        ));
    }
    match obj.get("format") {
        Some(Value::Int(1)) => {}
        Some(Value::Int(n)) => {
            return Err(Error::new(
                Code::StoreFormatUnsupported,
                format!("ref record {} has format {n}", path.display()),
            ))
        }
        _ => return Err(invalid("format is not the integer 1".into())),
    }
    let name = obj
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid("name is not a string".into()))?;
    if name_hash(name) != file {
        return Err(invalid(format!(
            "names {name:?}, whose hash is not the file name"
        )));
    }
    let target = obj
        .get("target")
        .and_then(Value::as_str)
        .and_then(Digest::from_prefixed)
        .ok_or_else(|| invalid("target is not sha256:<64 hex>".into()))?;
    Ok(RefRecord {
        name: name.to_string(),
        target,
    })
}

/// The objects directory of the old store: `objects/sha256/<h0h1>/<h2h3>/<hex>`.
pub(crate) struct Objects(pub(crate) Dir);

impl Objects {
    fn open(&self, digest: &Digest) -> Result<(File, u64)> {
        let h = digest.to_hex();
        self.0.subdir(&h[0..2])?.subdir(&h[2..4])?.regular_file(&h)
    }

    /// A small object, re-hashed against its name.
    pub(crate) fn read_small(&self, digest: &Digest, limit: u64) -> Result<Vec<u8>> {
        let (f, size) = self.open(digest)?;
        let path = self.0.path.join(digest.to_hex());
        let bytes = read_bounded(f, size, limit, &path).map_err(|e| {
            if e.code() == Code::StoreRefInvalid {
                Error::new(Code::StoreManifestInvalid, e.message().to_string())
            } else {
                e
            }
        })?;
        let got = Digest::of(&bytes);
        if got != *digest {
            return Err(Error::new(
                Code::StoreDigestMismatch,
                format!("object {digest} holds bytes of {got}"),
            ));
        }
        Ok(bytes)
    }
}

/// The envelope a repository manifest lists: its whole-file digest, size and parts.
pub(crate) struct EnvelopeFile {
    pub(crate) digest: Digest,
    pub(crate) size: u64,
    /// (object, length) in order; one part equal to the whole file when unchunked.
    pub(crate) parts: Vec<(Digest, u64)>,
}

/// Check a repository manifest (HashRepo manifest v1) that lists exactly one
/// file, `compiled_graph.tar.gz`.
pub(crate) fn parse_manifest(bytes: &[u8], digest: &Digest) -> Result<EnvelopeFile> {
    let invalid = |why: &str| {
        Error::new(
            Code::StoreManifestInvalid,
            format!("repository manifest {digest}: {why}"),
        )
    };
    let value = tcg_cj::parse_strict(bytes).map_err(|_| invalid("not JSON"))?;
    let obj = value.as_object().ok_or_else(|| invalid("not an object"))?;
    match obj.get("format") {
        Some(Value::Int(1)) => {}
        Some(Value::Int(n)) => {
            return Err(Error::new(
                Code::StoreFormatUnsupported,
                format!("repository manifest {digest} has format {n}"),
            ))
        }
        _ => return Err(invalid("format is not the integer 1")),
    }
    if obj.len() != 2 {
        return Err(invalid("members are not exactly format and files"));
    }
    let files = match obj.get("files") {
        Some(Value::Array(files)) if files.len() == 1 => files,
        _ => return Err(invalid("files does not list exactly one file")),
    };
    let file = files[0]
        .as_object()
        .ok_or_else(|| invalid("a file entry is not an object"))?;
    if file
        .keys()
        .any(|k| !matches!(k.as_str(), "path" | "size_bytes" | "digest" | "chunks"))
    {
        return Err(invalid("a file entry has an unknown member"));
    }
    if file.get("path").and_then(Value::as_str) != Some(ENVELOPE_PATH) {
        return Err(invalid("the file is not compiled_graph.tar.gz"));
    }
    let size = file
        .get("size_bytes")
        .and_then(Value::as_i64)
        .and_then(|n| u64::try_from(n).ok())
        .ok_or_else(|| invalid("size_bytes is not a non-negative integer"))?;
    let whole = file
        .get("digest")
        .and_then(Value::as_str)
        .and_then(Digest::from_prefixed)
        .ok_or_else(|| invalid("digest is not sha256:<64 hex>"))?;
    crate::artifact::envelope::check_compressed_size(size)?;
    let parts = match file.get("chunks") {
        None => vec![(whole, size)],
        Some(Value::Array(chunks)) => {
            let mut parts = Vec::with_capacity(chunks.len());
            let mut total: u64 = 0;
            for c in chunks {
                let c = c
                    .as_object()
                    .filter(|c| c.len() == 2)
                    .ok_or_else(|| invalid("a chunk is not {digest, len}"))?;
                let d = c
                    .get("digest")
                    .and_then(Value::as_str)
                    .and_then(Digest::from_prefixed)
                    .ok_or_else(|| invalid("a chunk digest is not sha256:<64 hex>"))?;
                let len = c
                    .get("len")
                    .and_then(Value::as_i64)
                    .and_then(|n| u64::try_from(n).ok())
                    .filter(|n| (1..=HASHREPO_CHUNK_BYTES).contains(n))
                    .ok_or_else(|| invalid("a chunk len is not in 1..=64 MiB"))?;
                total = total.saturating_add(len);
                parts.push((d, len));
            }
            if total != size {
                return Err(invalid("chunk lengths do not sum to size_bytes"));
            }
            parts
        }
        Some(_) => return Err(invalid("chunks is not a list")),
    };
    Ok(EnvelopeFile {
        digest: whole,
        size,
        parts,
    })
}

/// The envelope, streamed once from its objects: each part's length and
/// digest and the whole file's digest are checked as the bytes pass. The
/// first failure is kept in [`EnvelopeStream::failure`] (the reader itself
/// can only report an `io::Error` to the envelope reader).
pub(crate) struct EnvelopeStream<'a> {
    objects: &'a Objects,
    file: &'a EnvelopeFile,
    next: usize,
    current: Option<(File, Sha256, u64, Digest)>,
    whole: Sha256,
    total: u64,
    done: bool,
    pub(crate) failure: Option<Error>,
}

impl<'a> EnvelopeStream<'a> {
    pub(crate) fn new(objects: &'a Objects, file: &'a EnvelopeFile) -> Self {
        EnvelopeStream {
            objects,
            file,
            next: 0,
            current: None,
            whole: Sha256::new(),
            total: 0,
            done: false,
            failure: None,
        }
    }

    fn fail(&mut self, err: Error) -> io::Error {
        let msg = err.message().to_string();
        if self.failure.is_none() {
            self.failure = Some(err);
        }
        io::Error::other(msg)
    }

    /// Read what is left (nothing, once a well-formed envelope was read to
    /// its end) so that every part and the whole-file digest are checked;
    /// returns the first failure and how many bytes were left.
    pub(crate) fn drain(&mut self) -> (Option<Error>, u64) {
        let mut rest = vec![0u8; 65_536];
        let mut trailing = 0u64;
        loop {
            match self.read(&mut rest) {
                Ok(0) => break,
                Ok(n) => trailing += n as u64,
                Err(e) => {
                    if self.failure.is_none() {
                        self.failure = Some(Error::io("cannot read the old store", &e));
                    }
                    break;
                }
            }
        }
        (self.failure.take(), trailing)
    }
}

impl Read for EnvelopeStream<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(e) = &self.failure {
            return Err(io::Error::other(e.message().to_string()));
        }
        loop {
            if let Some((f, hasher, remaining, digest)) = &mut self.current {
                if *remaining == 0 {
                    let got = Digest(std::mem::take(hasher).finalize().into());
                    let want = *digest;
                    self.current = None;
                    if got != want {
                        return Err(self.fail(Error::new(
                            Code::StoreDigestMismatch,
                            format!("object {want} holds bytes of {got}"),
                        )));
                    }
                    continue;
                }
                let n = (buf.len() as u64).min(*remaining) as usize;
                let got = f.read(&mut buf[..n])?;
                if got == 0 {
                    let want = *digest;
                    return Err(self.fail(Error::new(
                        Code::StoreDigestMismatch,
                        format!("object {want} is shorter than its manifest says"),
                    )));
                }
                hasher.update(&buf[..got]);
                self.whole.update(&buf[..got]);
                *remaining -= got as u64;
                self.total += got as u64;
                return Ok(got);
            }
            if self.next < self.file.parts.len() {
                let (digest, len) = self.file.parts[self.next];
                self.next += 1;
                let (f, size) = match self.objects.open(&digest) {
                    Ok(x) => x,
                    Err(e) => return Err(self.fail(e)),
                };
                if size != len {
                    return Err(self.fail(Error::new(
                        Code::StoreDigestMismatch,
                        format!("object {digest} is {size} bytes, its manifest says {len}"),
                    )));
                }
                self.current = Some((f, Sha256::new(), len, digest));
                continue;
            }
            if !self.done {
                self.done = true;
                let got = Digest(std::mem::take(&mut self.whole).finalize().into());
                if self.total != self.file.size || got != self.file.digest {
                    return Err(self.fail(Error::new(
                        Code::StoreDigestMismatch,
                        format!(
                            "the envelope's chunks hash to {got}, its manifest names {}",
                            self.file.digest
                        ),
                    )));
                }
            }
            return Ok(0);
        }
    }
}
