//! Manifests: one stored file as fixed 64 MiB chunks (SPEC-v1 §9.3), with a
//! streaming writer and a streaming verified reader.

use std::io::{self, Read, Write};
use std::path::Path;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use tcg_cj::{Map, Value};

use crate::digest::Hasher;
use crate::error::{io_err, Result, StoreError};
use crate::fsutil;
use crate::lease::{Lease, TempFile};
use crate::object::{read_object_unverified, read_object_verified, ObjectReader, IO_BUF};
use crate::{Digest, Store};

/// Bytes between writeback kicks of a chunk temp.
const WRITEBACK_KICK: u64 = 8 << 20;

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
            buf: Vec::new(),
            filled: 0,
            chunk_len: 0,
            sealed: 0,
            known: None,
            size: 0,
            pipe: None,
            failed: false,
            ended: false,
            whole_from_start: false,
            first_state: None,
        }
    }

    /// A [`ChunkedWriter`] for a file expected to be `size` bytes long: one
    /// longer than a chunk has its whole-file hash run from byte 0 beside
    /// the chunks' (instead of after the first chunk's), so that it never
    /// waits. The hint only schedules work: the file may be of any length.
    pub fn chunked_writer_sized<'l>(&self, lease: &'l Lease, size: u64) -> ChunkedWriter<'l> {
        let mut w = self.chunked_writer(lease);
        w.whole_from_start = size > self.chunk_bytes();
        w
    }

    /// A [`ChunkedWriter`] for bytes the caller has already checked, chunk by
    /// chunk, against `chunks` (a manifest's list): the writer does not hash
    /// the chunks again (it still hashes the whole file). The bytes must cut
    /// into exactly these chunks at this store's chunk length; a chunk of
    /// another length, or another number of chunks, fails the writer.
    pub fn chunked_writer_known<'l>(
        &self,
        lease: &'l Lease,
        chunks: &[Chunk],
    ) -> ChunkedWriter<'l> {
        let mut w = self.chunked_writer(lease);
        w.known = Some(chunks.into());
        w
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

/// Bytes a caller hands a [`ChunkedWriter`] without a copy (a network
/// frame, say): kept alive until the writer's threads are done with them.
pub type SharedBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// Frames shorter than this are copied into the writer's buffer instead:
/// each shared frame costs a write and three hand-offs of its own.
const SHARE_MIN: usize = 64 << 10;

/// A buffer of the writer's pipeline: one of its own (recycled), or a
/// range of a caller's shared bytes.
enum Buf {
    Owned(Vec<u8>),
    Shared(SharedBytes, std::ops::Range<usize>),
}

impl std::ops::Deref for Buf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Buf::Owned(v) => v,
            Buf::Shared(b, r) => &(**b).as_ref()[r.clone()],
        }
    }
}

/// Random access to a stored file's bytes, for a reader that seeks (a zip's
/// central directory, say): each chunk object opened without following a
/// link and checked for its length, and read in place. Not hashed: for
/// bytes this process has just stored from data it hashed as it wrote them
/// (the store is private to its owner); anything else reads through
/// [`Store::open_file`] with verification.
#[derive(Debug)]
pub struct StoredFile {
    /// Each chunk's first offset, its length and its object.
    chunks: Vec<(u64, u64, std::fs::File)>,
    size: u64,
    pos: u64,
}

impl Store {
    /// Pin manifest `digest` and its chunks in `lease` and open the file
    /// for random access ([`StoredFile`]).
    pub fn open_stored(&self, lease: &Lease, digest: &Digest) -> Result<StoredFile> {
        let manifest = self.load_manifest(lease, digest)?;
        let ds: Vec<Digest> = manifest.chunks.iter().map(|c| c.digest).collect();
        lease.pin(&ds)?;
        let mut chunks = Vec::with_capacity(manifest.chunks.len());
        let mut start = 0u64;
        for c in &manifest.chunks {
            let path = self.object_path(&c.digest);
            let (file, md) =
                fsutil::open_regular(&path)?.ok_or_else(|| StoreError::ObjectMissing {
                    digest: c.digest.to_hex(),
                    path: path.clone(),
                })?;
            if md.len() != c.len {
                return Err(StoreError::LengthMismatch {
                    path,
                    digest: c.digest.to_hex(),
                    expected: c.len,
                    actual: md.len(),
                });
            }
            chunks.push((start, c.len, file));
            start += c.len;
        }
        Ok(StoredFile {
            chunks,
            size: manifest.size,
            pos: 0,
        })
    }
}

impl StoredFile {
    /// The file's length.
    pub fn len(&self) -> u64 {
        self.size
    }

    /// Whether the file has no bytes.
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }
}

impl Read for StoredFile {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        use std::os::unix::fs::FileExt;
        if buf.is_empty() || self.pos >= self.size {
            return Ok(0);
        }
        let i = self
            .chunks
            .partition_point(|(start, _, _)| *start <= self.pos)
            - 1;
        let (start, len, file) = &self.chunks[i];
        let within = self.pos - start;
        let n = buf
            .len()
            .min((len - within).min(usize::MAX as u64) as usize);
        let got = file.read_at(&mut buf[..n], within)?;
        if got == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "a stored chunk is shorter than its manifest says",
            ));
        }
        self.pos += got as u64;
        Ok(got)
    }
}

impl io::Seek for StoredFile {
    fn seek(&mut self, to: io::SeekFrom) -> io::Result<u64> {
        let target = match to {
            io::SeekFrom::Start(n) => Some(n),
            io::SeekFrom::End(d) => self.size.checked_add_signed(d),
            io::SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        let Some(target) = target else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "seek before the start of the file",
            ));
        };
        self.pos = target;
        Ok(target)
    }
}

/// Work for the sink thread, in stream order.
enum ToSink {
    /// Bytes of the current chunk.
    Data(Piece),
    /// The current chunk, of `len` bytes, is complete.
    Seal { len: u64 },
    /// Reply once everything before has been written (and sealed chunks installed).
    Barrier(mpsc::SyncSender<()>),
}

/// Work for the install thread, in seal order.
enum ToInstall {
    /// A sealed chunk's temp and length: fsync and install it under the
    /// digest the hash thread gives.
    Chunk(TempFile, u64),
    /// Reply once every chunk before is installed.
    Barrier(mpsc::SyncSender<()>),
}

/// Work for the chunk-hash thread, in stream order.
enum ToHash {
    Data(Arc<Piece>),
    /// The current chunk, of `len` bytes, is complete: name its digest.
    Seal {
        len: u64,
    },
}

/// Work for the whole-file hash thread.
enum ToWhole {
    Data(Arc<Piece>),
    /// Hash from byte 0 (known chunks: the first is not hashed here).
    Fresh,
    /// Continue from the state after chunk 1, once it comes (the data sent
    /// after this is chunk 2 on): from the thread that hashed chunk 1, or,
    /// for known chunks, as handed over with them, and then only if it
    /// finishes to the known first chunk's digest.
    After(mpsc::Receiver<Hasher>, Option<Digest>),
}

/// The SHA-256 state after the first chunk of a file, handed over by whoever
/// hashed and checked that chunk ([`first_chunk_channel`]): a writer of known
/// chunks continues its whole-file hash from it
/// ([`ChunkedWriter::continue_from`]) instead of hashing the first chunk
/// again. A state that does not finish to the first known chunk's digest is
/// not used, and the writer then fails at `finish` (nothing is installed
/// under a digest it did not compute or check).
pub struct FirstChunkState(mpsc::Receiver<Hasher>);

/// Where the state after the first chunk is sent, once that chunk is checked.
pub struct FirstChunkSender(mpsc::SyncSender<Hasher>);

/// A channel for the SHA-256 state after a file's first chunk.
pub fn first_chunk_channel() -> (FirstChunkSender, FirstChunkState) {
    let (tx, rx) = mpsc::sync_channel(1);
    (FirstChunkSender(tx), FirstChunkState(rx))
}

impl FirstChunkSender {
    /// Hand over `state`: SHA-256 updated with exactly the first chunk's
    /// bytes, not finalized.
    pub fn send(self, state: sha2::Sha256) {
        let _ = self.0.send(Hasher::from_state(state));
    }
}

impl std::fmt::Debug for FirstChunkState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FirstChunkState")
    }
}

impl std::fmt::Debug for FirstChunkSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FirstChunkSender")
    }
}

/// A chunk's digest as the install thread takes it: decided at its seal
/// (known chunks), or from the thread hashing it.
enum ChunkDigest {
    Known(std::result::Result<Digest, String>),
    Hashing(mpsc::Receiver<Digest>),
}

/// Messages a queue between two of the writer's threads holds; what they
/// hold is bounded by the writer's [`Budget`].
const QUEUE: usize = 1024;

/// Spare buffers a writer keeps for reuse (1 MiB each).
const SPARE_BUFFERS: usize = 32;

/// The bytes a writer's buffers hold between the caller and the last of its
/// threads, at most one chunk's worth (64 MiB): deep enough that one
/// thread's stall (an fsync, a hash descheduled) does not hold up the
/// others, and a bound on memory. The caller waits while they are over;
/// a single larger buffer is let through alone.
struct Budget {
    used: std::sync::Mutex<u64>,
    freed: std::sync::Condvar,
    cap: u64,
}

impl Budget {
    fn acquire(&self, n: u64) {
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        while *used > 0 && *used + n > self.cap {
            used = self.freed.wait(used).unwrap_or_else(|p| p.into_inner());
        }
        *used += n;
    }

    fn release(&self, n: u64) {
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        *used = used.saturating_sub(n);
        self.freed.notify_all();
    }
}

/// A buffer on its way through the writer's threads, counted in its
/// [`Budget`] until the last of them lets go.
struct Piece {
    buf: Buf,
    budget: Arc<Budget>,
}

impl std::ops::Deref for Piece {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Piece {
    fn drop(&mut self) {
        self.budget.release(self.buf.len() as u64);
    }
}

/// Helper threads, so that the caller's thread only fills buffers (or hands
/// over shared ones): the sink writes each chunk's temp, and an install
/// thread fsyncs and installs a sealed chunk while the sink writes the next;
/// beside them, a thread of its own hashes each chunk (chunks are hashed in
/// parallel when one falls behind), or, for known chunks, the cut is checked
/// and the known digest named; and one more thread hashes the whole file
/// (from chunk 2 on, continuing chunk 1's state, so a one-chunk file is
/// hashed once). A buffer is shared by the sink and the hash threads and
/// goes back to the caller when the last lets go; what is queued is bounded
/// by the [`Budget`] (and two sealed chunks awaiting install).
struct Pipeline {
    tx: Option<mpsc::SyncSender<ToSink>>,
    back: mpsc::Receiver<Vec<u8>>,
    budget: Arc<Budget>,
    sink: Option<JoinHandle<Result<Vec<Chunk>>>>,
    hash: Option<JoinHandle<()>>,
    whole: Option<JoinHandle<Option<Digest>>>,
}

/// The bytes handed to a writer of known chunks do not cut into those chunks.
fn layout_mismatch(store: &Store, why: String) -> StoreError {
    StoreError::Io {
        op: "check chunk layout",
        path: store.dir("tmp"),
        source: io::Error::other(why),
    }
}

/// Give a buffer back to the caller if this was its last holder (a shared
/// one is released instead).
fn recycle(piece: Arc<Piece>, back: &mpsc::SyncSender<Vec<u8>>) {
    if let Some(mut piece) = Arc::into_inner(piece) {
        if let Buf::Owned(v) = &mut piece.buf {
            let v = std::mem::take(v);
            let n = v.len() as u64;
            // The budget counts the bytes until they are handed back.
            piece.budget.release(n);
            let _ = back.try_send(v);
        }
    }
}

/// One chunk's hashing thread: its data in, its digest out (and, for the
/// first chunk, the hasher's state, which the whole-file hash continues).
struct ChunkHasher {
    tx: mpsc::SyncSender<Arc<Piece>>,
    digest: mpsc::Receiver<Digest>,
    state: Option<mpsc::Receiver<Hasher>>,
}

fn spawn_chunk_hasher(first: bool, back: mpsc::SyncSender<Vec<u8>>) -> ChunkHasher {
    let (tx, rx) = mpsc::sync_channel::<Arc<Piece>>(QUEUE);
    let (dtx, digest) = mpsc::sync_channel(1);
    let (stx, state) = if first {
        let (a, b) = mpsc::sync_channel(1);
        (Some(a), Some(b))
    } else {
        (None, None)
    };
    std::thread::spawn(move || {
        let mut h = Hasher::default();
        for v in rx {
            h.update(&v);
            recycle(v, &back);
        }
        if let Some(s) = stx {
            let _ = s.send(h.clone());
        }
        let _ = dtx.send(h.finish());
    });
    ChunkHasher { tx, digest, state }
}

/// The chunk-hash thread: hands each chunk's bytes to a thread of its own
/// and the digests, in `Seal` order, to `digests`.
fn hash_chunks(
    rx: mpsc::Receiver<ToHash>,
    whole: mpsc::SyncSender<ToWhole>,
    digests: mpsc::Sender<ChunkDigest>,
    known: Option<Arc<[Chunk]>>,
    whole_from_start: bool,
    mut first_state: Option<FirstChunkState>,
    back: mpsc::SyncSender<Vec<u8>>,
) {
    let mut current: Option<ChunkHasher> = None;
    let mut sealed = 0usize;
    // Known chunks are not hashed again: the whole-file hash then starts at
    // byte 0 (a one-chunk file's digest is its chunk's), or after the first
    // chunk from the state handed over with them; a file expected to be
    // longer than a chunk has it start at byte 0 too.
    if known.as_ref().is_none_or(|k| k.len() < 2) {
        first_state = None;
    }
    let mut whole_on = match &known {
        Some(k) => k.len() > 1 && first_state.is_none(),
        None => whole_from_start,
    };
    if whole_on {
        let _ = whole.send(ToWhole::Fresh);
    }
    for msg in rx {
        match msg {
            ToHash::Data(v) => {
                if known.is_none() {
                    // Chunk 1's state seeds the whole-file hash unless that runs already.
                    let seeds = sealed == 0 && !whole_on;
                    let c = current.get_or_insert_with(|| spawn_chunk_hasher(seeds, back.clone()));
                    let _ = c.tx.send(Arc::clone(&v));
                }
                if whole_on {
                    let _ = whole.send(ToWhole::Data(v));
                } else {
                    recycle(v, &back);
                }
            }
            ToHash::Seal { len } => {
                let digest = match &known {
                    None => match current.take() {
                        Some(c) => {
                            drop(c.tx);
                            if let Some(state) = c.state {
                                whole_on = true;
                                let _ = whole.send(ToWhole::After(state, None));
                            }
                            ChunkDigest::Hashing(c.digest)
                        }
                        None => ChunkDigest::Known(Err(format!("chunk {sealed} has no bytes"))),
                    },
                    Some(k) => {
                        if let (0, Some(FirstChunkState(state))) = (sealed, first_state.take()) {
                            whole_on = true;
                            let _ = whole.send(ToWhole::After(state, Some(k[0].digest)));
                        }
                        ChunkDigest::Known(match k.get(sealed) {
                            Some(c) if c.len == len => Ok(c.digest),
                            Some(c) => Err(format!(
                                "chunk {sealed} is {len} bytes, the known chunk is {} bytes",
                                c.len
                            )),
                            None => Err(format!(
                                "chunk {sealed} is past the {} known chunks",
                                k.len()
                            )),
                        })
                    }
                };
                sealed += 1;
                let _ = digests.send(digest);
            }
        }
    }
}

impl Pipeline {
    fn start(
        store: &Store,
        lease: &Lease,
        known: Option<Arc<[Chunk]>>,
        whole_from_start: bool,
        first_state: Option<FirstChunkState>,
    ) -> Pipeline {
        let (tx, rx) = mpsc::sync_channel::<ToSink>(QUEUE);
        let (htx, hrx) = mpsc::sync_channel::<ToHash>(QUEUE);
        let (wtx, wrx) = mpsc::sync_channel::<ToWhole>(QUEUE);
        let (dtx, drx) = mpsc::channel::<ChunkDigest>();
        let (btx, back) = mpsc::sync_channel::<Vec<u8>>(SPARE_BUFFERS);
        let budget = Arc::new(Budget {
            used: std::sync::Mutex::new(0),
            freed: std::sync::Condvar::new(),
            cap: store.chunk_bytes(),
        });
        let store = store.clone();
        let core = Arc::clone(lease.core());
        let sink_back = btx.clone();
        // Sealed chunks are fsynced and installed on a thread of their own,
        // so that the sink writes the next chunk meanwhile.
        let (itx, irx) = mpsc::sync_channel::<ToInstall>(2);
        let install_store = store.clone();
        let install_core = Arc::clone(&core);
        let install = std::thread::spawn(move || -> Result<Vec<Chunk>> {
            let mut chunks: Vec<Chunk> = Vec::new();
            for msg in irx {
                match msg {
                    ToInstall::Chunk(t, len) => {
                        let digest = match drx.recv() {
                            Ok(ChunkDigest::Known(Ok(d))) => d,
                            Ok(ChunkDigest::Known(Err(why))) => {
                                return Err(layout_mismatch(&install_store, why))
                            }
                            Ok(ChunkDigest::Hashing(rx)) => match rx.recv() {
                                Ok(d) => d,
                                Err(_) => panic!("store chunk hash thread ended early"),
                            },
                            Err(_) => panic!("store hash thread ended early"),
                        };
                        install_store.install_temp(&install_core, t, &digest, len)?;
                        chunks.push(Chunk { digest, len });
                    }
                    ToInstall::Barrier(reply) => {
                        let _ = reply.send(());
                    }
                }
            }
            Ok(chunks)
        });
        let sink = std::thread::spawn(move || -> Result<Vec<Chunk>> {
            let mut temp: Option<(TempFile, u64)> = None;
            let written = (|| -> Result<()> {
                for msg in rx {
                    match msg {
                        ToSink::Data(v) => {
                            // Hashed on the hash thread while it is written here.
                            let v = Arc::new(v);
                            let _ = htx.send(ToHash::Data(Arc::clone(&v)));
                            if temp.is_none() {
                                temp = Some((core.create_temp()?, 0));
                            }
                            let (t, len) = temp.as_mut().expect("temp just ensured");
                            t.file().write_all(&v).map_err(io_err("write", &t.path))?;
                            let before = *len;
                            *len += v.len() as u64;
                            if before / WRITEBACK_KICK != *len / WRITEBACK_KICK {
                                // Start writeback early so the fsync at the seal is short.
                                let end = *len / WRITEBACK_KICK * WRITEBACK_KICK;
                                fsutil::start_writeback(
                                    t.file(),
                                    end - WRITEBACK_KICK,
                                    WRITEBACK_KICK,
                                );
                            }
                            recycle(v, &sink_back);
                        }
                        ToSink::Seal { len } => {
                            let _ = htx.send(ToHash::Seal { len });
                            let (t, written) = temp.take().expect("a sealed chunk has bytes");
                            debug_assert_eq!(written, len);
                            if itx.send(ToInstall::Chunk(t, len)).is_err() {
                                // The install thread failed: its error below.
                                return Ok(());
                            }
                        }
                        ToSink::Barrier(reply) => {
                            if itx.send(ToInstall::Barrier(reply)).is_err() {
                                return Ok(());
                            }
                        }
                    }
                }
                Ok(())
            })();
            drop(itx);
            let installed = match install.join() {
                Ok(r) => r,
                Err(_) => panic!("store install thread panicked"),
            };
            written?;
            installed
        });
        let hash_back = btx.clone();
        let hash = std::thread::spawn(move || {
            hash_chunks(
                hrx,
                wtx,
                dtx,
                known,
                whole_from_start,
                first_state,
                hash_back,
            )
        });
        let whole = std::thread::spawn(move || {
            let mut h: Option<Hasher> = None;
            for msg in wrx {
                match msg {
                    ToWhole::Data(v) => {
                        if let Some(h) = h.as_mut() {
                            h.update(&v);
                        }
                        recycle(v, &btx);
                    }
                    ToWhole::Fresh => h = Some(Hasher::default()),
                    // None when no state came (chunk 1's thread died, or the
                    // caller sent none) or not the known first chunk's:
                    // `finish` then fails.
                    ToWhole::After(state, first) => {
                        h = state
                            .recv()
                            .ok()
                            .filter(|s| first.is_none_or(|d| s.clone().finish() == d))
                    }
                }
            }
            h.map(Hasher::finish)
        });
        Pipeline {
            tx: Some(tx),
            back,
            budget,
            sink: Some(sink),
            hash: Some(hash),
            whole: Some(whole),
        }
    }

    /// Stop the threads: the chunks installed (or the sink's error), and the
    /// whole-file digest when it was hashed.
    fn stop(&mut self) -> (Result<Vec<Chunk>>, Option<Digest>) {
        self.tx.take();
        let sink = match self.sink.take().map(JoinHandle::join) {
            Some(Ok(r)) => r,
            Some(Err(_)) => panic!("store sink thread panicked"),
            None => Ok(Vec::new()),
        };
        if let Some(Err(_)) = self.hash.take().map(JoinHandle::join) {
            panic!("store hash thread panicked");
        }
        let whole = match self.whole.take().map(JoinHandle::join) {
            Some(Ok(d)) => d,
            Some(Err(_)) => panic!("store whole-file hash thread panicked"),
            None => None,
        };
        (sink, whole)
    }
}

/// Streaming writer of one file (`impl Write`): cuts 64 MiB chunks from offset
/// 0, installs each as an object pinned in the lease, and on [`finish`]
/// installs the manifest. Memory is bounded: at most one chunk's worth of
/// bytes (64 MiB) queued for the helper threads, and up to 32 spare 1 MiB
/// buffers. Writing, fsync and install of chunk objects, and the hashes, run
/// on helper threads.
/// Dropping it without `finish` discards the partial chunk; installed chunks
/// stay pinned until the lease ends and are then garbage.
///
/// [`finish`]: ChunkedWriter::finish
pub struct ChunkedWriter<'l> {
    store: Store,
    lease: &'l Lease,
    /// Always `IO_BUF` long once in use (never re-zeroed); `filled` bytes are data.
    buf: Vec<u8>,
    filled: usize,
    /// Bytes of the current chunk already handed to the sink.
    chunk_len: u64,
    /// Chunks sealed so far.
    sealed: usize,
    /// The chunks the bytes are known to be (already checked against their
    /// digests by the caller): not hashed again.
    known: Option<Arc<[Chunk]>>,
    size: u64,
    pipe: Option<Pipeline>,
    failed: bool,
    /// [`ChunkedWriter::end_input`] was called.
    ended: bool,
    /// Hash the whole file from byte 0 beside the chunks.
    whole_from_start: bool,
    /// Known chunks only: the state after the first chunk, which the
    /// whole-file hash continues ([`ChunkedWriter::continue_from`]).
    first_state: Option<FirstChunkState>,
}

impl std::fmt::Debug for ChunkedWriter<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkedWriter")
            .field("size", &self.size)
            .field("chunks", &self.sealed)
            .finish()
    }
}

impl ChunkedWriter<'_> {
    /// Bytes accepted so far.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// How many more bytes fit in the buffer without crossing a chunk edge.
    fn room(&self) -> usize {
        let to_edge = self.store.chunk_bytes() - self.chunk_len - self.filled as u64;
        (IO_BUF - self.filled).min(to_edge.min(usize::MAX as u64) as usize)
    }

    fn ensure_buf(&mut self) {
        if self.buf.len() != IO_BUF {
            self.buf = vec![0; IO_BUF];
        }
    }

    fn send(&mut self, msg: ToSink) -> Result<()> {
        let pipe = self.pipe.as_mut().expect("pipeline started");
        let sent = pipe.tx.as_ref().map(|tx| tx.send(msg).is_ok());
        if sent == Some(true) {
            return Ok(());
        }
        self.failed = true;
        match pipe.stop().0 {
            Err(e) => Err(e),
            Ok(_) => Err(self.poisoned()),
        }
    }

    /// Send bytes of the current chunk, once the writer's queues have room
    /// for them (its [`Budget`]); the first bytes start the threads.
    fn send_data(&mut self, buf: Buf) -> Result<()> {
        let pipe = self.pipe.get_or_insert_with(|| {
            Pipeline::start(
                &self.store,
                self.lease,
                self.known.clone(),
                self.whole_from_start,
                self.first_state.take(),
            )
        });
        let budget = Arc::clone(&pipe.budget);
        budget.acquire(buf.len() as u64);
        self.send(ToSink::Data(Piece { buf, budget }))
    }

    fn poisoned(&self) -> StoreError {
        StoreError::Io {
            op: "write after failure",
            path: self.store.dir("tmp"),
            source: io::Error::other("chunked writer failed earlier"),
        }
    }

    fn flush_buf(&mut self) -> Result<()> {
        if self.filled == 0 {
            return Ok(());
        }
        self.chunk_len += self.filled as u64;
        let spare = self
            .pipe
            .as_ref()
            .and_then(|p| p.back.try_recv().ok())
            .map(|mut v| {
                v.resize(IO_BUF, 0);
                v
            })
            .unwrap_or_else(|| vec![0; IO_BUF]);
        let mut data = std::mem::replace(&mut self.buf, spare);
        data.truncate(self.filled);
        self.filled = 0;
        self.send_data(Buf::Owned(data))?;
        if self.chunk_len == self.store.chunk_bytes() {
            self.seal_chunk()?;
        }
        Ok(())
    }

    fn seal_chunk(&mut self) -> Result<()> {
        if self.chunk_len == 0 {
            return Ok(());
        }
        let len = std::mem::take(&mut self.chunk_len);
        self.sealed += 1;
        self.send(ToSink::Seal { len })
    }

    fn guard(&self) -> Result<()> {
        if self.failed {
            return Err(self.poisoned());
        }
        Ok(())
    }

    /// [`ChunkedWriter::guard`] for bytes: none after
    /// [`ChunkedWriter::end_input`] (a refused write fails the writer).
    fn guard_input(&mut self) -> Result<()> {
        self.guard()?;
        if self.ended {
            self.failed = true;
            return Err(StoreError::Io {
                op: "write after the end of input",
                path: self.store.dir("tmp"),
                source: io::Error::other("bytes after the chunked writer's input ended"),
            });
        }
        Ok(())
    }

    fn after(&mut self, r: Result<()>) -> Result<()> {
        if r.is_err() {
            self.failed = true;
        }
        r
    }

    fn accept(&mut self, data: &[u8]) -> Result<usize> {
        self.guard_input()?;
        let mut off = 0;
        while off < data.len() {
            let n = self.room().min(data.len() - off);
            self.ensure_buf();
            self.buf[self.filled..self.filled + n].copy_from_slice(&data[off..off + n]);
            self.filled += n;
            off += n;
            self.size += n as u64;
            if self.room() == 0 {
                let r = self.flush_buf();
                self.after(r)?;
            }
        }
        Ok(data.len())
    }

    /// Append `data` without copying it (frames of [`SHARE_MIN`] bytes or
    /// more; shorter ones are copied): the writer's threads write and hash
    /// it from the caller's memory and drop their references when done.
    pub fn write_shared(&mut self, data: SharedBytes) -> Result<()> {
        let len = (*data).as_ref().len();
        if len < SHARE_MIN {
            return self.accept((*data).as_ref()).map(drop);
        }
        self.guard_input()?;
        let r = self.flush_buf();
        self.after(r)?;
        let step = self.store.chunk_bytes();
        let mut off = 0;
        while off < len {
            let to_edge = (step - self.chunk_len).min(usize::MAX as u64) as usize;
            let n = to_edge.min(len - off);
            self.chunk_len += n as u64;
            self.size += n as u64;
            let r = self.send_data(Buf::Shared(Arc::clone(&data), off..off + n));
            self.after(r)?;
            off += n;
            if self.chunk_len == step {
                let r = self.seal_chunk();
                self.after(r)?;
            }
        }
        Ok(())
    }

    /// A writer of known chunks continues its whole-file hash from `state`
    /// (the first chunk's, handed over by whoever checked that chunk)
    /// instead of hashing the first chunk again. Only before the first byte;
    /// ignored by a writer of unknown chunks or of a single known chunk.
    pub fn continue_from(&mut self, state: FirstChunkState) {
        if self.pipe.is_none() {
            self.first_state = Some(state);
        }
    }

    /// The input has ended: seal the chunk in progress now, so that its
    /// fsync and install run while the caller finishes other work;
    /// [`ChunkedWriter::finish`] then only waits for them. Bytes written
    /// after this are refused.
    pub fn end_input(&mut self) -> Result<()> {
        self.guard()?;
        let r = self.flush_buf().and_then(|()| self.seal_chunk());
        self.after(r)?;
        self.ended = true;
        Ok(())
    }

    /// Copy all of `reader` into the file, reading straight into the writer's
    /// buffer. Returns the number of bytes copied.
    pub fn copy_from(&mut self, reader: &mut impl Read) -> Result<u64> {
        self.guard_input()?;
        let mut total = 0u64;
        loop {
            let room = self.room();
            self.ensure_buf();
            let start = self.filled;
            let n = match reader.read(&mut self.buf[start..start + room]) {
                Ok(0) => return Ok(total),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(StoreError::from_io(e, "read source", "<reader>")),
            };
            self.filled += n;
            total += n as u64;
            self.size += n as u64;
            if self.room() == 0 {
                let r = self.flush_buf();
                self.after(r)?;
            }
        }
    }

    /// Push buffered bytes to the current chunk's temp and wait until the
    /// helper thread has written them (sealed chunks are installed by then).
    fn barrier(&mut self) -> Result<()> {
        self.guard()?;
        let r = self.flush_buf();
        self.after(r)?;
        if self.pipe.is_none() {
            return Ok(());
        }
        let (tx, rx) = mpsc::sync_channel(1);
        let r = self.send(ToSink::Barrier(tx));
        self.after(r)?;
        if rx.recv().is_err() {
            self.failed = true;
            let pipe = self.pipe.as_mut().expect("pipeline started");
            return Err(pipe.stop().0.err().unwrap_or_else(|| self.poisoned()));
        }
        Ok(())
    }

    /// Install the last chunk and the manifest; return what was stored.
    pub fn finish(mut self) -> Result<ManifestInfo> {
        self.guard()?;
        self.flush_buf()?;
        self.seal_chunk()?;
        let (chunks, whole) = match self.pipe.as_mut() {
            Some(p) => {
                let (sink, whole) = p.stop();
                (sink?, whole)
            }
            None => (Vec::new(), None),
        };
        if let Some(known) = &self.known {
            if known.len() != chunks.len() {
                return Err(layout_mismatch(
                    &self.store,
                    format!("{} chunks written, {} known", chunks.len(), known.len()),
                ));
            }
        }
        let file_digest = match chunks.len() {
            0 => Digest::of(b""),
            1 => chunks[0].digest,
            _ => whole.ok_or_else(|| StoreError::Io {
                op: "hash the whole file",
                path: self.store.dir("tmp"),
                source: io::Error::other(
                    "no SHA-256 state for the first chunk came, or not the known first chunk's",
                ),
            })?,
        };
        let manifest = Manifest {
            file_digest,
            size: self.size,
            chunks,
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
        if let Some(p) = self.pipe.as_mut() {
            let _ = p.stop();
        }
    }
}

impl Write for ChunkedWriter<'_> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.accept(data).map_err(StoreError::into_io)
    }

    /// Pushes buffered bytes to the current chunk's temp and waits until they
    /// are written (no fsync; chunks are fsynced when sealed). Reports a
    /// failure of the helper thread (ENOSPC, EROFS, ...).
    fn flush(&mut self) -> io::Result<()> {
        self.barrier().map_err(StoreError::into_io)
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
