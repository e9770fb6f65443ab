//! Materialization: a stored file copied to a caller path, never sharing an
//! inode with `objects/` (SPEC-v1 §9.8).

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{io_err, Result, StoreError};
use crate::fsutil;
use crate::lease::Lease;
use crate::object::IO_BUF;
use crate::{Digest, Manifest, Store};

/// How the bytes reached the destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MaterializeMethod {
    /// Every chunk was reflinked (FICLONERANGE).
    Reflink,
    /// Copied in the kernel (`copy_file_range`) or by read/write.
    Copy,
    /// Streamed through the verified reader (every chunk rehashed).
    Verified,
    /// The file is empty.
    Empty,
}

/// What [`Store::materialize`] wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaterializeReport {
    /// How the bytes were written.
    pub method: MaterializeMethod,
    /// The file's length.
    pub size: u64,
    /// The file's digest, from the manifest.
    pub file_digest: Digest,
}

/// Bytes copied between writeback kicks.
const WRITEBACK_PIECE: u64 = 8 << 20;

fn reflink_unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(
            libc::EOPNOTSUPP
                | libc::ENOTTY
                | libc::EXDEV
                | libc::EINVAL
                | libc::ENOSYS
                | libc::EBADF
        )
    )
}

impl Store {
    /// Write the file of manifest `manifest` to `dest`: a temp in `dest`'s
    /// directory (reflink per chunk where supported, else copy; or, with
    /// `verify`, the verified kernel copy of [`Store::copy_verified_into`]), fsync, publish with `link` (an existing
    /// `dest` is `io.destination_occupied` and is left untouched), fsync the
    /// parent. Never hardlinks or symlinks into the store.
    pub fn materialize(
        &self,
        lease: &Lease,
        manifest: &Digest,
        dest: &Path,
        verify: bool,
    ) -> Result<MaterializeReport> {
        let parent = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let fname = dest
            .file_name()
            .ok_or_else(|| StoreError::Io {
                op: "materialize",
                path: dest.to_owned(),
                source: io::Error::from_raw_os_error(libc::EINVAL),
            })?
            .to_string_lossy()
            .into_owned();
        if fs::symlink_metadata(dest).is_ok() {
            return Err(StoreError::DestinationOccupied {
                path: dest.to_owned(),
            });
        }
        let m = self.load_manifest(lease, manifest)?;
        let ds: Vec<Digest> = m.chunks.iter().map(|c| c.digest).collect();
        lease.pin(&ds)?;
        let tmp = parent.join(format!(".{fname}.{}", fsutil::random_hex32()));
        let out = OpenOptions::new()
            .read(true) // the verified copy reads back what it wrote
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&tmp)
            .map_err(io_err("create temp", &tmp))?;
        let guard = TempGuard(&tmp);
        let method = if m.chunks.is_empty() {
            MaterializeMethod::Empty
        } else if verify {
            self.kernel_copy_verified(&m, &out, &tmp, true)?;
            MaterializeMethod::Verified
        } else {
            self.copy_chunks(&m.chunks, &out, &tmp)?
        };
        out.sync_all().map_err(io_err("fsync", &tmp))?;
        drop(out);
        match fs::hard_link(&tmp, dest) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                return Err(StoreError::DestinationOccupied {
                    path: dest.to_owned(),
                })
            }
            Err(e) => return Err(io_err("link", dest)(e)),
        }
        drop(guard);
        fsutil::fsync_dir(&parent)?;
        Ok(MaterializeReport {
            method,
            size: m.size,
            file_digest: m.file_digest,
        })
    }

    /// Copy the file of `manifest` into `out` from offset 0 with the kernel's
    /// copy (`copy_file_range` per chunk, read/write where it is refused), then
    /// prove what was written: each chunk's range of `out` is read back and
    /// hashed against the chunk's digest, so the bytes left in `out` are
    /// exactly the verified ones. Bad stored bytes give the errors of the
    /// verified reader ([`StoreError::is_bad_stored_bytes`]); `out` then holds
    /// unproven bytes and the caller must discard it. Nothing is fsynced: for
    /// derived destinations (a resolve's stage). Returns the file's length.
    ///
    /// The kernel copy avoids two user-space copies of every byte, which on
    /// some hosts cost several times the hashing (`docs/benchmarks.md`).
    pub fn copy_verified_into(
        &self,
        lease: &Lease,
        manifest: &Digest,
        out: &File,
        out_path: &Path,
    ) -> Result<u64> {
        let m = self.load_manifest(lease, manifest)?;
        let ds: Vec<Digest> = m.chunks.iter().map(|c| c.digest).collect();
        lease.pin(&ds)?;
        self.kernel_copy_verified(&m, out, out_path, false)?;
        Ok(m.size)
    }

    /// The copy and read-back of [`Store::copy_verified_into`] for a loaded
    /// manifest whose chunks are pinned; `writeback` starts writeback behind
    /// the copy for a file that will be fsynced.
    fn kernel_copy_verified(
        &self,
        m: &Manifest,
        out: &File,
        out_path: &Path,
        writeback: bool,
    ) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let mut off = 0u64;
        for c in &m.chunks {
            let r = self.open_object_pinned(&c.digest, Some(c.len), false)?;
            copy_one(
                r.file(),
                out,
                c.len,
                off,
                out_path,
                &self.object_path(&c.digest),
                &c.digest,
                writeback,
            )?;
            off += c.len;
        }
        // Hash the chunks back from `out`, spread over the host's cores.
        let mut starts = Vec::with_capacity(m.chunks.len());
        let mut at = 0u64;
        for c in &m.chunks {
            starts.push(at);
            at += c.len;
        }
        let next = std::sync::atomic::AtomicUsize::new(0);
        let workers = std::thread::available_parallelism()
            .map_or(1, usize::from)
            .clamp(1, 8)
            .min(m.chunks.len().max(1));
        let check = |i: usize, buf: &mut [u8]| -> Result<()> {
            let (c, off) = (&m.chunks[i], starts[i]);
            let mut h = crate::digest::Hasher::default();
            let mut done = 0u64;
            while done < c.len {
                let want = (c.len - done).min(buf.len() as u64) as usize;
                let n = match out.read_at(&mut buf[..want], off + done) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(io_err("read back", out_path)(e)),
                };
                h.update(&buf[..n]);
                done += n as u64;
            }
            if done != c.len {
                return Err(StoreError::LengthMismatch {
                    path: self.object_path(&c.digest),
                    digest: c.digest.to_hex(),
                    expected: c.len,
                    actual: done,
                });
            }
            let got = h.finish();
            if got != c.digest {
                return Err(StoreError::DigestMismatch {
                    path: self.object_path(&c.digest),
                    expected: c.digest.to_hex(),
                    actual: got.to_hex(),
                });
            }
            Ok(())
        };
        // Sized to the largest chunk, at most `IO_BUF`: a small package's
        // read-back touches a few pages, not a whole buffer (page faults are
        // most of a small resolve's read-back).
        let buf_len = m
            .chunks
            .iter()
            .map(|c| c.len)
            .max()
            .unwrap_or(0)
            .clamp(1, IO_BUF as u64) as usize;
        let work = || -> Result<()> {
            let mut buf = vec![0u8; buf_len];
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= m.chunks.len() {
                    return Ok(());
                }
                // A read-back that does not match proves something only once
                // the stored chunk itself is rehashed: the output may have been
                // changed by someone else after it was written.
                if let Err(e) = check(i, &mut buf) {
                    if !e.is_bad_stored_bytes() {
                        return Err(e);
                    }
                    let c = &m.chunks[i];
                    crate::object::verify_object(
                        &self.object_path(&c.digest),
                        &c.digest,
                        Some(c.len),
                    )?;
                    return Err(StoreError::Io {
                        op: "verify copy",
                        path: out_path.to_owned(),
                        source: io::Error::other(
                            "the copy changed after it was written, while the stored chunk is intact",
                        ),
                    });
                }
            }
        };
        std::thread::scope(|scope| {
            let helpers: Vec<_> = (1..workers).map(|_| scope.spawn(work)).collect();
            let mut result = work();
            for h in helpers {
                let r = h.join().expect("verification worker panicked");
                result = result.and(r);
            }
            result
        })
    }

    fn copy_chunks(
        &self,
        chunks: &[crate::Chunk],
        out: &File,
        tmp: &Path,
    ) -> Result<MaterializeMethod> {
        let dst_dev = out.metadata().map_err(io_err("fstat", tmp))?.dev();
        let mut all_reflinked = true;
        let mut off = 0u64;
        for c in chunks {
            let r = self.open_object_pinned(&c.digest, Some(c.len), false)?;
            let src = r.file();
            let src_dev = src.metadata().map_err(io_err("fstat", tmp))?.dev();
            let key = (src_dev, dst_dev);
            let try_reflink = !self
                .inner
                .no_reflink
                .lock()
                .expect("reflink set poisoned")
                .contains(&key);
            let mut done = false;
            if try_reflink {
                match fsutil::ficlone_range(src, out, c.len, off) {
                    Ok(()) => done = true,
                    Err(e) if reflink_unsupported(&e) => {
                        self.inner
                            .no_reflink
                            .lock()
                            .expect("reflink set poisoned")
                            .insert(key);
                    }
                    Err(e) => return Err(io_err("reflink", tmp)(e)),
                }
            }
            if !done {
                all_reflinked = false;
                copy_one(
                    src,
                    out,
                    c.len,
                    off,
                    tmp,
                    &self.object_path(&c.digest),
                    &c.digest,
                    true,
                )?;
            }
            off += c.len;
        }
        Ok(if all_reflinked {
            MaterializeMethod::Reflink
        } else {
            MaterializeMethod::Copy
        })
    }
}

#[allow(clippy::too_many_arguments)]
fn copy_one(
    src: &File,
    out: &File,
    len: u64,
    off: u64,
    tmp: &Path,
    src_path: &Path,
    digest: &Digest,
    writeback: bool,
) -> Result<()> {
    // Copy in pieces and (for a file that will be fsynced) start writeback
    // after each, so that the final fsync finds little left to write.
    let mut copied = 0u64;
    let res = loop {
        if copied == len {
            break Ok(copied);
        }
        let piece = (len - copied).min(WRITEBACK_PIECE);
        match fsutil::copy_range(src, copied, out, piece, off + copied) {
            Ok(0) => break Ok(copied),
            Ok(n) => {
                if writeback {
                    fsutil::start_writeback(out, off + copied, n);
                }
                copied += n;
            }
            Err(e) if copied == 0 => break Err(e),
            Err(e) => return Err(io_err("copy", tmp)(e)),
        }
    };
    let copied = match res {
        Ok(n) => n,
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EXDEV | libc::ENOSYS | libc::EINVAL | libc::EOPNOTSUPP)
            ) =>
        {
            rw_copy(src, out, len, off, tmp)?
        }
        Err(e) => return Err(io_err("copy", tmp)(e)),
    };
    if copied != len {
        return Err(StoreError::LengthMismatch {
            path: src_path.to_owned(),
            digest: digest.to_hex(),
            expected: len,
            actual: copied,
        });
    }
    Ok(())
}

fn rw_copy(src: &File, out: &File, len: u64, off: u64, tmp: &Path) -> Result<u64> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; len.clamp(1, IO_BUF as u64) as usize];
    let mut done = 0u64;
    while done < len {
        let want = (len - done).min(buf.len() as u64) as usize;
        let n = match src.read_at(&mut buf[..want], done) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_err("read", tmp)(e)),
        };
        out.write_all_at(&buf[..n], off + done)
            .map_err(io_err("write", tmp))?;
        done += n as u64;
    }
    Ok(done)
}

struct TempGuard<'a>(&'a Path);

impl Drop for TempGuard<'_> {
    fn drop(&mut self) {
        let _ = fs::remove_file(self.0);
    }
}
