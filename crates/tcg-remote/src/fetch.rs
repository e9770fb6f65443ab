//! Fetch (FLEET.md §3, zero trust): the ref's key, the manifest's SHA-256
//! and shape, then the chunks streamed through SHA-256 checks. The engine
//! feeds the stream to the same full verification and host admission as
//! `import_artifact`; nothing here is served or unpacked.

use std::collections::VecDeque;
use std::io;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use sha2::{Digest as _, Sha256};
use tcg_cas::{Chunk, Digest, FirstChunkSender, FirstChunkState, Manifest, SharedBytes};
use tcg_core::engine::{EnvelopeStream, FailureSlot, RemoteEnvelope, RemoteError, StreamFailure};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::client::{Client, Fail};
use crate::layout::{Layout, RefRecord, MAX_MANIFEST_BYTES, MAX_REF_BYTES};

/// Chunks requested ahead of the reader, the one it reads included: what
/// has arrived and is not yet read stays in memory (up to 64 MiB a chunk).
/// The GETs start in manifest order, each once the previous one's answer
/// has begun.
pub const CHUNKS_AHEAD: usize = 3;

/// A remote manifest may declare at most this many times the bytes of its
/// distinct chunks. An envelope is one gzip stream at maximum compression:
/// two identical 64 MiB stretches of it need identical incompressible input
/// met in identical compressor states, so a real envelope practically never
/// repeats a chunk, and twice its distinct bytes is a generous bound on what
/// one could; a manifest listing one chunk hundreds of times (128 MiB stored,
/// 13 GB downloaded per worker) is refused before the first GET.
pub const MAX_REPEAT_FACTOR: u64 = 2;

fn unavailable(what: &str, f: Fail) -> RemoteError {
    RemoteError::Unavailable(format!("{what}: {f}"))
}

/// Read and check the ref of `key`: `Ok(None)` when absent.
pub fn read_ref(
    client: &Client,
    layout: &Layout,
    key: &str,
) -> Result<Option<RefRecord>, RemoteError> {
    let path = layout.graph_ref(key);
    let bytes = match client.get_small(&path, MAX_REF_BYTES) {
        Ok((b, _)) => b,
        Err(Fail::NotFound) => return Ok(None),
        Err(f) => return Err(unavailable("reading the ref", f)),
    };
    let record = RefRecord::parse(&bytes).map_err(|why| RemoteError::Bad {
        manifest: None,
        why: format!("ref {path}: {why}"),
    })?;
    if record.key != key {
        return Err(RemoteError::Bad {
            manifest: Some(record.manifest.to_hex()),
            why: format!("ref {path} names key {:?}", record.key),
        });
    }
    Ok(Some(record))
}

/// Read manifest `m`, check its SHA-256 and shape: `Ok(None)` when absent
/// or of a format this build cannot read.
pub fn read_manifest(
    client: &Client,
    layout: &Layout,
    m: &Digest,
) -> Result<Option<Manifest>, RemoteError> {
    let bad = |why: String| RemoteError::Bad {
        manifest: Some(m.to_hex()),
        why,
    };
    let bytes = match client.get_small(&layout.manifest(m), MAX_MANIFEST_BYTES) {
        Ok((b, _)) => b,
        Err(Fail::NotFound) => return Ok(None),
        Err(f) => return Err(unavailable("reading the manifest", f)),
    };
    check_manifest(&bytes, m).map_err(bad)
}

/// The checks of a remote manifest's bytes named `m` (no I/O): its SHA-256,
/// the manifest rules, the envelope size limit and the repeat bound.
/// `Ok(None)`: a format this build cannot read. The fuzz target
/// `remote_records` runs it on arbitrary bytes.
pub fn check_manifest(bytes: &[u8], m: &Digest) -> Result<Option<Manifest>, String> {
    let actual = Digest::of(bytes);
    if actual != *m {
        return Err(format!(
            "manifest {} has SHA-256 {}",
            m.to_hex(),
            actual.to_hex()
        ));
    }
    let manifest = match Manifest::parse(bytes, m) {
        Ok(man) => man,
        Err(tcg_cas::StoreError::RecordFormatUnsupported { .. }) => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    if manifest.size > tcg_core::artifact::MAX_ARCHIVE_BYTES {
        return Err(format!(
            "manifest size {} is over the envelope limit of {} bytes",
            manifest.size,
            tcg_core::artifact::MAX_ARCHIVE_BYTES
        ));
    }
    // A chunk listed again is downloaded again: bound what repeats may add.
    let mut distinct = std::collections::BTreeSet::new();
    let mut distinct_bytes = 0u64;
    for c in &manifest.chunks {
        if distinct.insert(c.digest) {
            distinct_bytes += c.len;
        }
    }
    if manifest.size > distinct_bytes.saturating_mul(MAX_REPEAT_FACTOR) {
        return Err(format!(
            "manifest lists {} chunks ({} bytes) but only {} distinct ones ({distinct_bytes} bytes): \
             repeats beyond {MAX_REPEAT_FACTOR}x the distinct bytes are refused",
            manifest.chunks.len(),
            manifest.size,
            distinct.len()
        ));
    }
    Ok(Some(manifest))
}

/// Open the envelope of `key` (FLEET.md §3 steps 1-2).
pub fn open(
    client: &Client,
    layout: &Layout,
    key: &str,
) -> Result<Option<RemoteEnvelope>, RemoteError> {
    let Some(record) = read_ref(client, layout, key)? else {
        return Ok(None);
    };
    open_manifest(client, layout, &record.manifest)
}

/// Open the envelope of manifest `m` (named by the ref, or by a signature
/// record): the manifest's SHA-256 and shape, then the checked stream. A
/// chunk the remote does not have ends the stream as a miss
/// ([`StreamFailure::Missing`]) when its GET is answered 404.
pub fn open_manifest(
    client: &Client,
    layout: &Layout,
    m: &Digest,
) -> Result<Option<RemoteEnvelope>, RemoteError> {
    let Some(manifest) = read_manifest(client, layout, m)? else {
        return Ok(None);
    };
    let failure: FailureSlot = Arc::new(Mutex::new(None));
    let chunks = manifest.chunks.clone();
    let (file_digest, size) = (manifest.file_digest, manifest.size);
    let reader = ChunkStream::new(client, layout, manifest, Arc::clone(&failure));
    Ok(Some(RemoteEnvelope {
        manifest: *m,
        file_digest,
        size,
        reader: Box::new(reader),
        chunks,
        failure,
    }))
}

/// What one chunk's GET hands the reader: its bytes in the order they
/// arrived, or why it failed.
type Frame = Result<Bytes, StreamFailure>;

/// GET one chunk and pass its frames on to the reader as they arrive, all
/// but the last: that one is sent only once the length and the SHA-256
/// match. A reader therefore never holds every byte of a chunk before the
/// chunk is proven, and the local writer (which installs a chunk only once
/// it has all of its bytes) never installs an unproven one. The hash runs on
/// a thread of its own, so that neither the runtime nor the reader waits
/// for it until the last frame. `answered` fires once the response has
/// begun (or the GET failed); `first`, for the first chunk, receives the
/// hash's state once the chunk is proven.
async fn fetch_chunk(
    store: Arc<dyn ObjectStore>,
    path: Path,
    chunk: Chunk,
    limit: std::time::Duration,
    tx: mpsc::UnboundedSender<Frame>,
    answered: oneshot::Sender<()>,
    first: Option<FirstChunkSender>,
) {
    use futures_util::StreamExt;
    let hex = chunk.digest.to_hex();
    let streamed = tokio::time::timeout(limit, async {
        let r = store.get(&path).await.map_err(|e| match e {
            object_store::Error::NotFound { .. } => {
                StreamFailure::Missing(format!("chunk {hex} is missing from the remote"))
            }
            e => StreamFailure::Transport(format!("chunk {hex}: {e}")),
        })?;
        let _ = answered.send(());
        if r.meta.size != chunk.len {
            // The server states another length for a content-addressed name.
            return Err(StreamFailure::Bad(format!(
                "chunk {hex} is stored with {} bytes, the manifest says {}",
                r.meta.size, chunk.len
            )));
        }
        let (to_hash, frames_in) = std::sync::mpsc::channel::<Bytes>();
        let hashing = tokio::task::spawn_blocking(move || {
            let mut hasher = Sha256::new();
            for frame in frames_in {
                hasher.update(&frame);
            }
            hasher
        });
        let mut held: Option<Bytes> = None;
        let mut got: u64 = 0;
        let mut frames = r.into_stream();
        while let Some(frame) = frames.next().await {
            let frame = frame.map_err(|e| StreamFailure::Transport(format!("chunk {hex}: {e}")))?;
            got += frame.len() as u64;
            if got > chunk.len {
                // More than the stated length: cut off here.
                break;
            }
            let _ = to_hash.send(frame.clone());
            if let Some(previous) = held.replace(frame) {
                if tx.send(Ok(previous)).is_err() {
                    // The reader is gone: nothing more to do.
                    return Ok(None);
                }
            }
        }
        drop(to_hash);
        if got != chunk.len {
            // A body of another length with a 200 is a transport fault
            // (truncation), not proof.
            return Err(StreamFailure::Transport(format!(
                "chunk {hex} arrived with {got} bytes, expected {}",
                chunk.len
            )));
        }
        let hasher = hashing
            .await
            .map_err(|e| StreamFailure::Transport(format!("chunk {hex}: hashing: {e}")))?;
        let actual: [u8; 32] = hasher.clone().finalize().into();
        if actual != chunk.digest.0 {
            return Err(StreamFailure::Bad(format!(
                "chunk {hex} has SHA-256 {}",
                hex::encode(actual)
            )));
        }
        if let Some(first) = first {
            first.send(hasher);
        }
        Ok(held)
    })
    .await;
    let last = match streamed {
        Err(_) => Err(StreamFailure::Transport(format!(
            "chunk {hex} took longer than {:.1} s",
            limit.as_secs_f64()
        ))),
        Ok(Ok(None)) => return,
        Ok(Ok(Some(b))) => Ok(b),
        Ok(Err(f)) => Err(f),
    };
    let _ = tx.send(last);
}

/// A task that ends with its owner.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A chunk to fetch: where, what, where its frames go, and for the first
/// chunk where its hash's state goes.
type Order = (
    Path,
    Chunk,
    mpsc::UnboundedSender<Frame>,
    Option<FirstChunkSender>,
);

/// One chunk on its way: its frames, and how many bytes of it the reader
/// has taken.
struct InFlight {
    chunk: Chunk,
    frames: mpsc::UnboundedReceiver<Frame>,
    taken: u64,
}

/// The envelope as a stream: chunks fetched ahead in parallel and handed out
/// as they arrive, each chunk's last bytes only once its length and SHA-256
/// are checked (see [`fetch_chunk`]). A consumer that has read a chunk to
/// its end has read proven bytes; one that stops inside a chunk has
/// received bytes it must not keep, and every consumer here stages them
/// where nothing is served until the whole stream, the local manifest and
/// the full verification have passed.
///
/// The whole-file digest is not hashed here: the verified chunks fix every
/// byte, and the local chunked writer hashes the whole file anyway (it takes
/// the chunk digests checked here instead of hashing the chunks again, and
/// continues from the first chunk's state, [`EnvelopeStream::first_chunk_state`]); the
/// engine then requires the local manifest it made to be the remote manifest
/// (same digest), which also binds the remote's file digest and size
/// (`fetch_remote`), before anything is published.
pub struct ChunkStream {
    layout: Layout,
    manifest: Manifest,
    next: usize,
    pending: VecDeque<InFlight>,
    orders: mpsc::UnboundedSender<Order>,
    /// Starts the GETs in order, each once the previous one's answer has
    /// begun; aborting it aborts them.
    driver: JoinHandle<()>,
    failure: FailureSlot,
    failed: bool,
    /// Where the first chunk's hash state arrives, until taken.
    first_state: Option<FirstChunkState>,
    first_sender: Option<FirstChunkSender>,
}

impl ChunkStream {
    fn new(client: &Client, layout: &Layout, manifest: Manifest, failure: FailureSlot) -> Self {
        let (orders, mut incoming) = mpsc::unbounded_channel::<Order>();
        let store = Arc::clone(&client.store);
        let config = client.config.clone();
        // One GET at a time until its answer begins: a server prepares the
        // next while the previous streams, and the first bytes come as
        // early as one GET allows. At most CHUNKS_AHEAD are in flight (a
        // chunk leaves the reader's queue only once its GET has ended).
        let driver = client.runtime.spawn(async move {
            let mut tasks = Vec::new();
            while let Some((path, c, tx, first)) = incoming.recv().await {
                let limit = config.data_timeout(c.len);
                let store = Arc::clone(&store);
                let (answered, answer) = oneshot::channel();
                tasks.push(AbortOnDrop(tokio::spawn(fetch_chunk(
                    store, path, c, limit, tx, answered, first,
                ))));
                let _ = answer.await;
            }
        });
        let (first_sender, first_state) = tcg_cas::first_chunk_channel();
        // No GET before the first frame is asked for: the engine decides
        // trust from the manifest and the statements first (remote_trust.rs).
        ChunkStream {
            layout: layout.clone(),
            manifest,
            next: 0,
            pending: VecDeque::new(),
            orders,
            driver,
            failure,
            failed: false,
            first_state: Some(first_state),
            first_sender: Some(first_sender),
        }
    }

    fn fill(&mut self) {
        while self.pending.len() < CHUNKS_AHEAD && self.next < self.manifest.chunks.len() {
            let c = self.manifest.chunks[self.next];
            self.next += 1;
            let path = self.layout.chunk(&c.digest);
            let (tx, rx) = mpsc::unbounded_channel();
            let first = self.first_sender.take();
            let _ = self.orders.send((path, c, tx, first));
            self.pending.push_back(InFlight {
                chunk: c,
                frames: rx,
                taken: 0,
            });
        }
    }

    fn fail(&mut self, f: StreamFailure) -> io::Error {
        let msg = match &f {
            StreamFailure::Transport(m) | StreamFailure::Bad(m) | StreamFailure::Missing(m) => {
                m.clone()
            }
        };
        if let Ok(mut slot) = self.failure.lock() {
            slot.get_or_insert(f);
        }
        self.failed = true;
        io::Error::other(msg)
    }

    /// The next frame of the stream: `Ok(None)` at its end.
    fn next(&mut self) -> Result<Option<Bytes>, StreamFailure> {
        if self.next == 0 {
            self.fill();
        }
        loop {
            let Some(head) = self.pending.front_mut() else {
                return Ok(None);
            };
            if let Some(b) = head.next()? {
                return Ok(Some(b));
            }
            self.pending.pop_front();
            self.fill();
        }
    }
}

impl InFlight {
    /// The chunk's next frame: `Ok(None)` once it is complete (the task
    /// sent its last frame only after the check).
    fn next(&mut self) -> Result<Option<Bytes>, StreamFailure> {
        match self.frames.blocking_recv() {
            Some(Ok(b)) => {
                self.taken += b.len() as u64;
                Ok(Some(b))
            }
            Some(Err(f)) => Err(f),
            None if self.taken == self.chunk.len => Ok(None),
            None => Err(StreamFailure::Transport(format!(
                "chunk {} ended after {} of {} bytes",
                self.chunk.digest.to_hex(),
                self.taken,
                self.chunk.len
            ))),
        }
    }
}

impl Drop for ChunkStream {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

impl EnvelopeStream for ChunkStream {
    fn next_frame(&mut self) -> io::Result<Option<SharedBytes>> {
        if self.failed {
            return Err(io::Error::other("the remote stream failed"));
        }
        match self.next() {
            Ok(Some(b)) => Ok(Some(Arc::new(b))),
            Ok(None) => Ok(None),
            Err(f) => Err(self.fail(f)),
        }
    }

    fn settle(&mut self) {
        if self.failed {
            return;
        }
        let Some(head) = self.pending.front_mut() else {
            return;
        };
        if head.taken == 0 {
            return;
        }
        // The rest of this chunk only: its last frame comes after its check.
        let verdict = loop {
            match head.next() {
                Ok(Some(_)) => {}
                Ok(None) => break None,
                Err(f) => break Some(f),
            }
        };
        if let Some(f) = verdict {
            self.fail(f);
        }
    }

    fn first_chunk_state(&mut self) -> Option<FirstChunkState> {
        self.first_state.take()
    }
}
