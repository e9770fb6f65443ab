//! Manifests: one stored file as fixed 64 MiB chunks (SPEC-v1 §9.3), with a
//! streaming writer and a streaming verified reader.

use std::io::{self, Read, Write};
use std::path::Path;
use std::sync::mpsc;
use std::thread::JoinHandle;

use tcg_cj::{Map, Value};

use crate::digest::Hasher;
use crate::error::{io_err, Result, StoreError};
use crate::lease::{Lease, TempFile};
use crate::object::{read_object_unverified, read_object_verified, ObjectReader, IO_BUF};
use crate::{Digest, Store};

/// Manifest objects longer than this are refused (about 10^6 chunks, 64 TiB).
pub(crate) const MAX_MANIFEST_BYTES: u64 = 128 << 20;

/// One chunk of a manifest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// The chunk object's digest.
    pub digest: Digest,
    /// Its length, 1 … 64 MiB.
    pub len: u64,
}

/// A parsed, validated manifest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    /// SHA-256 of the whole file.
    pub file_digest: Digest,
    /// The file's length.
    pub size: u64,
    /// The chunks, in file order.
    pub chunks: Vec<Chunk>,
}

/// What a stored file is: its manifest and the file's own digest and size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ManifestInfo {
    /// The manifest object's digest (what a `manifest`-kind ref targets).
    pub manifest: Digest,
    /// SHA-256 of the file's bytes.
    pub file_digest: Digest,
    /// The file's length.
    pub size: u64,
}

impl Manifest {
    /// The canonical JSON bytes of this manifest.
    pub fn to_bytes(&self) -> Vec<u8> {
        let chunks = self
            .chunks
            .iter()
            .map(|c| {
                let mut m = Map::new();
                m.insert("digest".into(), Value::Str(c.digest.to_prefixed()));
                m.insert("len".into(), Value::Int(c.len as i64));
                Value::Object(m)
            })
            .collect();
        let mut m = Map::new();
        m.insert("chunks".into(), Value::Array(chunks));
        m.insert("digest".into(), Value::Str(self.file_digest.to_prefixed()));
        m.insert("format".into(), Value::Int(1));
        m.insert("size".into(), Value::Int(self.size as i64));
        tcg_cj::to_canonical(&Value::Object(m)).expect("manifest values are always encodable")
    }

    /// Parse and check manifest bytes (SPEC-v1 §9.3) with the standard chunk
    /// length. `digest` names the manifest in errors; it is not re-checked here.
    pub fn parse(bytes: &[u8], digest: &Digest) -> Result<Manifest> {
        Manifest::parse_with(bytes, digest, crate::MAX_CHUNK_BYTES)
    }

    pub(crate) fn parse_with(bytes: &[u8], digest: &Digest, chunk_bytes: u64) -> Result<Manifest> {
        let bad = |reason: &str| StoreError::ManifestInvalid {
            digest: digest.to_hex(),
            reason: reason.to_string(),
        };
        let value = tcg_cj::parse_strict(bytes).map_err(|e| bad(&e.to_string()))?;
        let obj = value.as_object().ok_or_else(|| bad("not a json object"))?;
        // An unreadable format is decided before any other rule: a future
        // format may have other members (SPEC-v1 §10.9).
        match obj.get("format") {
            Some(Value::Int(1)) => {}
            Some(Value::Int(f)) => {
                return Err(StoreError::RecordFormatUnsupported {
                    digest: digest.to_hex(),
                    format: *f,
                })
            }
            _ => return Err(bad("format is not an integer")),
        }
        if tcg_cj::to_canonical(&value).ok().as_deref() != Some(bytes) {
            return Err(bad("bytes are not canonical json"));
        }
        let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        if keys != ["chunks", "digest", "format", "size"] {
            return Err(bad("members are not exactly chunks, digest, format, size"));
        }
        let file_digest = obj["digest"]
            .as_str()
            .and_then(Digest::from_prefixed)
            .ok_or_else(|| bad("digest is not sha256:<64 hex>"))?;
        let size = match obj["size"] {
            Value::Int(s) if s >= 0 => s as u64,
            _ => return Err(bad("size is not an integer in 0 … 2^63-1")),
        };
        let arr = obj["chunks"]
            .as_array()
            .ok_or_else(|| bad("chunks is not an array"))?;
        let mut chunks = Vec::with_capacity(arr.len());
        let mut sum: u64 = 0;
        for (i, c) in arr.iter().enumerate() {
            let co = c.as_object().ok_or_else(|| bad("chunk is not an object"))?;
            let ck: Vec<&str> = co.keys().map(String::as_str).collect();
            if ck != ["digest", "len"] {
                return Err(bad("chunk members are not exactly digest, len"));
            }
            let d = co["digest"]
                .as_str()
                .and_then(Digest::from_prefixed)
                .ok_or_else(|| bad("chunk digest is not sha256:<64 hex>"))?;
            let len = match co["len"] {
                Value::Int(l) if l >= 1 && (l as u64) <= chunk_bytes => l as u64,
                _ => return Err(bad("chunk len is not an integer in 1 … MAX_CHUNK_BYTES")),
            };
            if i + 1 < arr.len() && len != chunk_bytes {
                return Err(bad(
                    "a chunk other than the last is shorter than MAX_CHUNK_BYTES",
                ));
            }
            sum = sum
                .checked_add(len)
                .ok_or_else(|| bad("chunk lengths overflow"))?;
            chunks.push(Chunk { digest: d, len });
        }
        if sum != size {
            return Err(bad("chunk lengths do not sum to size"));
        }
        if chunks.len() == 1 && chunks[0].digest != file_digest {
            return Err(bad("the only chunk's digest differs from the file digest"));
        }
        if chunks.is_empty() && file_digest != Digest::of(b"") {
            return Err(bad("an empty file's digest is not sha256 of no bytes"));
        }
        Ok(Manifest {
            file_digest,
            size,
            chunks,
        })
    }
}

impl Store {
    /// Pin and load manifest `digest`: verify the object's digest, parse
    /// strictly, require canonical bytes and every §9.3 rule. An integer
    /// `format` other than 1 is `store.format_unsupported`
    /// ([`StoreError::RecordFormatUnsupported`]).
    pub fn load_manifest(&self, lease: &Lease, digest: &Digest) -> Result<Manifest> {
        lease.pin(std::slice::from_ref(digest))?;
        self.load_manifest_pinned(digest)
    }

    pub(crate) fn load_manifest_pinned(&self, digest: &Digest) -> Result<Manifest> {
        let bytes = read_object_verified(&self.object_path(digest), digest, MAX_MANIFEST_BYTES)?;
        Manifest::parse_with(&bytes, digest, self.chunk_bytes())
    }

    /// Parse only, no rehash (GC's mark phase).
    pub(crate) fn parse_manifest_unverified(&self, digest: &Digest) -> Result<Manifest> {
        let bytes = read_object_unverified(&self.object_path(digest), digest, MAX_MANIFEST_BYTES)?;
        Manifest::parse_with(&bytes, digest, self.chunk_bytes())
    }

    /// A streaming writer of one file into chunk objects and a manifest.
    pub fn chunked_writer<'l>(&self, lease: &'l Lease) -> ChunkedWriter<'l> {
        ChunkedWriter {
            store: self.clone(),
            lease,
            buf: Vec::with_capacity(IO_BUF),
            chunk: None,
            chunks: Vec::new(),
            size: 0,
            whole: Whole::None,
            failed: false,
        }
    }

    /// Store the file at `path` as chunks and a manifest (one read pass).
    pub fn ingest_file(&self, lease: &Lease, path: &Path) -> Result<ManifestInfo> {
        let mut f = std::fs::File::open(path).map_err(io_err("open", path))?;
        let mut w = self.chunked_writer(lease);
        w.copy_from(&mut f)?;
        w.finish()
    }

    /// Store the bytes of `reader` as chunks and a manifest, in bounded memory.
    pub fn ingest_reader(&self, lease: &Lease, mut reader: impl Read) -> Result<ManifestInfo> {
        let mut w = self.chunked_writer(lease);
        w.copy_from(&mut reader)?;
        w.finish()
    }

    /// Pin manifest `digest` and its chunks in `lease` and stream the file,
    /// verifying every chunk (digest and length) as it goes when `verify`.
    pub fn open_file<'l>(
        &self,
        lease: &'l Lease,
        digest: &Digest,
        verify: bool,
    ) -> Result<ChunkedReader<'l>> {
        let manifest = self.load_manifest(lease, digest)?;
        let ds: Vec<Digest> = manifest.chunks.iter().map(|c| c.digest).collect();
        lease.pin(&ds)?;
        Ok(ChunkedReader {
            store: self.clone(),
            _lease: lease,
            manifest,
            next: 0,
            current: None,
            verify,
        })
    }
}

enum Whole {
    /// Nothing beyond the first chunk yet.
    None,
    /// A helper thread hashes chunks 2..n while the caller hashes and writes.
    Thread {
        tx: Option<mpsc::SyncSender<Vec<u8>>>,
        back: mpsc::Receiver<Vec<u8>>,
        handle: Option<JoinHandle<Digest>>,
    },
}

/// Streaming writer of one file (`impl Write`): cuts 64 MiB chunks from offset
/// 0, installs each as an object pinned in the lease, and on [`finish`]
/// installs the manifest. Memory is bounded (a few MiB). Dropping it without
/// `finish` discards the partial chunk; installed chunks stay pinned until the
/// lease ends and are then garbage.
///
/// [`finish`]: ChunkedWriter::finish
pub struct ChunkedWriter<'l> {
    store: Store,
    lease: &'l Lease,
    buf: Vec<u8>,
    chunk: Option<(TempFile, Hasher, u64)>,
    chunks: Vec<Chunk>,
    size: u64,
    whole: Whole,
    failed: bool,
}

impl std::fmt::Debug for ChunkedWriter<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkedWriter")
            .field("size", &self.size)
            .field("chunks", &self.chunks.len())
            .finish()
    }
}

impl ChunkedWriter<'_> {
    /// Bytes accepted so far.
    pub fn size(&self) -> u64 {
        self.size
    }

    fn chunk_len(&self) -> u64 {
        self.chunk.as_ref().map_or(0, |c| c.2)
    }

    /// How many more bytes fit in the buffer without crossing a chunk edge.
    fn room(&self) -> usize {
        let to_edge = self.store.chunk_bytes() - self.chunk_len() - self.buf.len() as u64;
        (IO_BUF - self.buf.len()).min(to_edge.min(usize::MAX as u64) as usize)
    }

    fn flush_buf(&mut self) -> Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        if self.chunk.is_none() {
            self.chunk = Some((self.lease.create_temp()?, Hasher::default(), 0));
        }
        let (temp, hasher, len) = self.chunk.as_mut().expect("chunk just ensured");
        hasher.update(&self.buf);
        temp.file()
            .write_all(&self.buf)
            .map_err(io_err("write", &temp.path))?;
        *len += self.buf.len() as u64;
        let full = *len == self.store.chunk_bytes();
        if let Whole::Thread {
            tx: Some(tx), back, ..
        } = &mut self.whole
        {
            let spare = back
                .try_recv()
                .unwrap_or_else(|_| Vec::with_capacity(IO_BUF));
            let data = std::mem::replace(&mut self.buf, spare);
            tx.send(data).expect("hash thread alive");
        }
        self.buf.clear();
        if full {
            self.seal_chunk()?;
        }
        Ok(())
    }

    fn seal_chunk(&mut self) -> Result<()> {
        let Some((temp, hasher, len)) = self.chunk.take() else {
            return Ok(());
        };
        if self.chunks.is_empty() {
            // The whole-file hash of chunks 2..n continues from chunk 1's state,
            // so a one-chunk file is hashed exactly once.
            let mut whole = hasher.clone();
            let (tx, rx) = mpsc::sync_channel::<Vec<u8>>(3);
            let (btx, back) = mpsc::sync_channel::<Vec<u8>>(4);
            let handle = std::thread::spawn(move || {
                for data in rx {
                    whole.update(&data);
                    let _ = btx.try_send(data);
                }
                whole.finish()
            });
            self.whole = Whole::Thread {
                tx: Some(tx),
                back,
                handle: Some(handle),
            };
        }
        let digest = hasher.finish();
        self.store.install_temp(self.lease, temp, &digest, len)?;
        self.chunks.push(Chunk { digest, len });
        Ok(())
    }

    fn guard(&self) -> Result<()> {
        if self.failed {
            return Err(StoreError::Io {
                op: "write after failure",
                path: self.store.dir("tmp"),
                source: io::Error::other("chunked writer failed earlier"),
            });
        }
        Ok(())
    }

    fn accept(&mut self, data: &[u8]) -> Result<usize> {
        self.guard()?;
        let mut off = 0;
        while off < data.len() {
            let n = self.room().min(data.len() - off);
            self.buf.extend_from_slice(&data[off..off + n]);
            off += n;
            self.size += n as u64;
            if self.room() == 0 {
                if let Err(e) = self.flush_buf() {
                    self.failed = true;
                    return Err(e);
                }
            }
        }
        Ok(data.len())
    }

    /// Copy all of `reader` into the file, reading straight into the writer's
    /// buffer. Returns the number of bytes copied.
    pub fn copy_from(&mut self, reader: &mut impl Read) -> Result<u64> {
        self.guard()?;
        let mut total = 0u64;
        loop {
            let room = self.room();
            let start = self.buf.len();
            self.buf.resize(start + room, 0);
            let n = match reader.read(&mut self.buf[start..]) {
                Ok(0) => {
                    self.buf.truncate(start);
                    return Ok(total);
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                    self.buf.truncate(start);
                    continue;
                }
                Err(e) => {
                    self.buf.truncate(start);
                    return Err(StoreError::from_io(e, "read source", "<reader>"));
                }
            };
            self.buf.truncate(start + n);
            total += n as u64;
            self.size += n as u64;
            if self.room() == 0 {
                if let Err(e) = self.flush_buf() {
                    self.failed = true;
                    return Err(e);
                }
            }
        }
    }

    /// Install the last chunk and the manifest; return what was stored.
    pub fn finish(mut self) -> Result<ManifestInfo> {
        self.guard()?;
        self.flush_buf()?;
        if self.chunk_len() > 0 {
            self.seal_chunk()?;
        }
        let file_digest = match (&mut self.whole, self.chunks.len()) {
            (_, 0) => Digest::of(b""),
            (_, 1) => self.chunks[0].digest,
            (Whole::Thread { tx, handle, .. }, _) => {
                tx.take();
                handle
                    .take()
                    .expect("hash thread joined once")
                    .join()
                    .expect("hash thread panicked")
            }
            (Whole::None, _) => unreachable!("a thread exists after the first chunk"),
        };
        let manifest = Manifest {
            file_digest,
            size: self.size,
            chunks: std::mem::take(&mut self.chunks),
        };
        let digest = self.store.put_bytes(self.lease, &manifest.to_bytes())?;
        Ok(ManifestInfo {
            manifest: digest,
            file_digest,
            size: manifest.size,
        })
    }
}

impl Drop for ChunkedWriter<'_> {
    fn drop(&mut self) {
        if let Whole::Thread { tx, handle, .. } = &mut self.whole {
            tx.take();
            if let Some(h) = handle.take() {
                let _ = h.join();
            }
        }
    }
}

impl Write for ChunkedWriter<'_> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.accept(data).map_err(StoreError::into_io)
    }

    /// Pushes buffered bytes to the current chunk's temp (no fsync; chunks
    /// are fsynced when sealed).
    fn flush(&mut self) -> io::Result<()> {
        self.guard().map_err(StoreError::into_io)?;
        if let Err(e) = self.flush_buf() {
            self.failed = true;
            return Err(e.into_io());
        }
        Ok(())
    }
}

/// A streaming reader of a stored file: its chunks in order, each verified
/// (length up front, digest at its end) when asked. On a bad chunk the read
/// that reaches its end fails with a typed error inside the `io::Error`.
pub struct ChunkedReader<'l> {
    store: Store,
    _lease: &'l Lease,
    manifest: Manifest,
    next: usize,
    current: Option<ObjectReader>,
    verify: bool,
}

impl std::fmt::Debug for ChunkedReader<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkedReader")
            .field("manifest", &self.manifest)
            .field("next", &self.next)
            .finish()
    }
}

impl ChunkedReader<'_> {
    /// The manifest being read.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }
}

impl Read for ChunkedReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if self.current.is_none() {
                let Some(c) = self.manifest.chunks.get(self.next) else {
                    return Ok(0);
                };
                self.current = Some(
                    self.store
                        .open_object_pinned(&c.digest, Some(c.len), self.verify)
                        .map_err(StoreError::into_io)?,
                );
                self.next += 1;
            }
            let r = self.current.as_mut().expect("current chunk open");
            let n = r.read(buf)?;
            if n > 0 || buf.is_empty() {
                return Ok(n);
            }
            self.current = None;
        }
    }
}
