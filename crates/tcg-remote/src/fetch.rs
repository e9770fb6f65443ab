//! Fetch (FLEET.md §3, zero trust): the ref's key, the manifest's SHA-256
//! and shape, then the chunks streamed through SHA-256 checks. The engine
//! feeds the stream to the same full verification and host admission as
//! `import_artifact`; nothing here is served or unpacked.

use std::collections::VecDeque;
use std::io::{self, Read};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use sha2::{Digest as _, Sha256};
use tcg_cas::{Chunk, Digest, Manifest};
use tcg_core::engine::{FailureSlot, RemoteEnvelope, RemoteError, StreamFailure};
use tokio::runtime::Handle;
use tokio::task::JoinHandle;

use crate::client::{Client, Fail};
use crate::layout::{Layout, RefRecord, MAX_MANIFEST_BYTES, MAX_REF_BYTES};

/// Chunks fetched ahead of the reader (each up to 64 MiB in memory).
pub const PREFETCH: usize = 2;

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
    let actual = Digest::of(&bytes);
    if actual != *m {
        return Err(bad(format!(
            "manifest {} has SHA-256 {}",
            m.to_hex(),
            actual.to_hex()
        )));
    }
    let manifest = match Manifest::parse(&bytes, m) {
        Ok(man) => man,
        Err(tcg_cas::StoreError::RecordFormatUnsupported { .. }) => return Ok(None),
        Err(e) => return Err(bad(e.to_string())),
    };
    if manifest.size > tcg_core::artifact::MAX_ARCHIVE_BYTES {
        return Err(bad(format!(
            "manifest size {} is over the envelope limit",
            manifest.size
        )));
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
/// record): the manifest's SHA-256 and shape, every chunk's presence and
/// size, then the checked stream.
pub fn open_manifest(
    client: &Client,
    layout: &Layout,
    m: &Digest,
) -> Result<Option<RemoteEnvelope>, RemoteError> {
    let Some(manifest) = read_manifest(client, layout, m)? else {
        return Ok(None);
    };
    // A missing chunk is a miss, found before any byte is streamed.
    let paths = manifest
        .chunks
        .iter()
        .map(|c| layout.chunk(&c.digest))
        .collect();
    for (c, head) in manifest.chunks.iter().zip(client.head_all(paths)) {
        match head {
            Ok(meta) if meta.size == c.len => {}
            Ok(meta) => {
                return Err(RemoteError::Bad {
                    manifest: Some(m.to_hex()),
                    why: format!(
                        "chunk {} is {} bytes, the manifest says {}",
                        c.digest.to_hex(),
                        meta.size,
                        c.len
                    ),
                })
            }
            Err(Fail::NotFound) => return Ok(None),
            Err(f) => return Err(unavailable("checking a chunk", f)),
        }
    }
    let failure: FailureSlot = Arc::new(Mutex::new(None));
    let chunks = manifest.chunks.clone();
    let reader = ChunkStream::new(client, layout, manifest, Arc::clone(&failure));
    Ok(Some(RemoteEnvelope {
        manifest: *m,
        reader: Box::new(reader),
        chunks,
        failure,
    }))
}

/// What one chunk's GET came to, before the digest check.
enum Got {
    Body(Bytes, [u8; 32]),
    Stored(u64),
    Short(u64),
}

async fn fetch_chunk(
    store: Arc<dyn ObjectStore>,
    path: Path,
    chunk: Chunk,
    limit: std::time::Duration,
) -> Result<Bytes, StreamFailure> {
    use futures_util::StreamExt;
    let got = tokio::time::timeout(limit, async {
        let r = store.get(&path).await?;
        if r.meta.size != chunk.len {
            return Ok(Got::Stored(r.meta.size));
        }
        // Hashed as the body arrives (frames of kilobytes), so the check is
        // done about when the last byte is: no second pass over the chunk.
        let mut body = bytes::BytesMut::with_capacity(chunk.len as usize);
        let mut hasher = Sha256::new();
        let mut frames = r.into_stream();
        while let Some(frame) = frames.next().await {
            let frame = frame?;
            if (body.len() + frame.len()) as u64 > chunk.len {
                // More than the stated length: cut off, reported as short below.
                return Ok(Got::Short(body.len() as u64 + frame.len() as u64));
            }
            hasher.update(&frame);
            body.extend_from_slice(&frame);
        }
        if body.len() as u64 != chunk.len {
            return Ok(Got::Short(body.len() as u64));
        }
        Ok::<_, object_store::Error>(Got::Body(body.freeze(), hasher.finalize().into()))
    })
    .await;
    let (bytes, actual) = match got {
        Err(_) => {
            return Err(StreamFailure::Transport(format!(
                "chunk {} took longer than {:.1} s",
                chunk.digest.to_hex(),
                limit.as_secs_f64()
            )))
        }
        Ok(Err(e)) => {
            return Err(StreamFailure::Transport(format!(
                "chunk {}: {e}",
                chunk.digest.to_hex()
            )))
        }
        Ok(Ok(Got::Stored(stored))) => {
            // The server states another length for a content-addressed name.
            return Err(StreamFailure::Bad(format!(
                "chunk {} is stored with {stored} bytes, the manifest says {}",
                chunk.digest.to_hex(),
                chunk.len
            )));
        }
        Ok(Ok(Got::Short(n))) => {
            // A body of another length with a 200 is a transport fault
            // (truncation), not proof.
            return Err(StreamFailure::Transport(format!(
                "chunk {} arrived with {n} bytes, expected {}",
                chunk.digest.to_hex(),
                chunk.len
            )));
        }
        Ok(Ok(Got::Body(b, d))) => (b, d),
    };
    if actual != chunk.digest.0 {
        return Err(StreamFailure::Bad(format!(
            "chunk {} has SHA-256 {}",
            chunk.digest.to_hex(),
            hex::encode(actual)
        )));
    }
    Ok(bytes)
}

/// The envelope as a stream: chunks fetched ahead in parallel, each checked
/// against its digest and length before any of its bytes is handed out.
///
/// The whole-file digest is not hashed here: the verified chunks fix every
/// byte, and the local chunked writer hashes the whole file anyway (it takes
/// the chunk digests checked here instead of hashing the chunks again); the
/// engine then requires the local manifest it made to be the remote manifest
/// (same digest), which also binds the remote's file digest and size
/// (`fetch_remote`), before anything is published.
pub struct ChunkStream {
    handle: Handle,
    store: Arc<dyn ObjectStore>,
    layout: Layout,
    config: crate::config::RemoteConfig,
    manifest: Manifest,
    next: usize,
    pending: VecDeque<JoinHandle<Result<Bytes, StreamFailure>>>,
    current: Bytes,
    failure: FailureSlot,
    failed: bool,
}

impl ChunkStream {
    fn new(client: &Client, layout: &Layout, manifest: Manifest, failure: FailureSlot) -> Self {
        let mut s = ChunkStream {
            handle: client.runtime.handle().clone(),
            store: Arc::clone(&client.store),
            layout: layout.clone(),
            config: client.config.clone(),
            manifest,
            next: 0,
            pending: VecDeque::new(),
            current: Bytes::new(),
            failure,
            failed: false,
        };
        s.fill();
        s
    }

    fn fill(&mut self) {
        while self.pending.len() < PREFETCH && self.next < self.manifest.chunks.len() {
            let c = self.manifest.chunks[self.next];
            self.next += 1;
            let store = Arc::clone(&self.store);
            let path = self.layout.chunk(&c.digest);
            let limit = self.config.data_timeout(c.len);
            self.pending
                .push_back(self.handle.spawn(fetch_chunk(store, path, c, limit)));
        }
    }

    fn fail(&mut self, f: StreamFailure) -> io::Error {
        let msg = match &f {
            StreamFailure::Transport(m) | StreamFailure::Bad(m) => m.clone(),
        };
        if let Ok(mut slot) = self.failure.lock() {
            slot.get_or_insert(f);
        }
        self.failed = true;
        io::Error::other(msg)
    }
}

impl Drop for ChunkStream {
    fn drop(&mut self) {
        for h in &self.pending {
            h.abort();
        }
    }
}

impl Read for ChunkStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.failed {
            return Err(io::Error::other("the remote stream failed"));
        }
        if self.current.is_empty() {
            let Some(task) = self.pending.pop_front() else {
                return Ok(0);
            };
            let got = self
                .handle
                .block_on(task)
                .unwrap_or_else(|e| Err(StreamFailure::Transport(e.to_string())));
            let bytes = match got {
                Ok(b) => b,
                Err(f) => return Err(self.fail(f)),
            };
            self.fill();
            self.current = bytes;
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current[..n]);
        let _ = self.current.split_to(n);
        Ok(n)
    }
}
