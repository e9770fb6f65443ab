//! Publish (FLEET.md §2): chunks, then the manifest, then the ref by a
//! conditional create; first writer wins, fleet-wide.

use std::io::Read;
use std::time::Duration;

use bytes::Bytes;
use tcg_cas::{Digest, Manifest, Store};
use tcg_core::engine::{RemoteError, RemotePublication, StoreOutcome};

use crate::client::{Client, Fail};
use crate::fetch::read_ref;
use crate::layout::{host_name, unix_now, Layout, RefRecord};

/// Attempts of the ref create before giving up (each followed by a read-back).
pub const CREATE_ATTEMPTS: u32 = 4;

fn local(e: impl std::fmt::Display) -> RemoteError {
    RemoteError::Unavailable(format!("local store: {e}"))
}

fn unavailable(what: &str, f: Fail) -> RemoteError {
    RemoteError::Unavailable(format!("{what}: {f}"))
}

/// Upload `path` unless an object of `len` bytes is there already
/// (content-addressed: any writer writes identical bytes).
fn upload_missing(
    client: &Client,
    path: &object_store::path::Path,
    len: u64,
    bytes: impl FnOnce() -> Result<Bytes, RemoteError>,
) -> Result<bool, RemoteError> {
    match client.head(path) {
        Ok(meta) if meta.size == len => return Ok(false),
        Ok(_) | Err(Fail::NotFound) => {}
        Err(f) => return Err(unavailable("checking an object", f)),
    }
    let body = bytes()?;
    client
        .put(path, body, object_store::PutMode::Overwrite)
        .map_err(|f| unavailable("uploading", f))?;
    Ok(true)
}

/// Publish the locally stored envelope `m` of `key`. Returns the verdict and
/// how many chunk bytes were uploaded.
pub fn publish(
    client: &Client,
    layout: &Layout,
    store: &Store,
    key: &str,
    m: &Digest,
) -> Result<(RemotePublication, u64), RemoteError> {
    let lease = store.lease().map_err(local)?;
    let manifest_bytes = store
        .read_object(&lease, m, crate::layout::MAX_MANIFEST_BYTES)
        .map_err(local)?;
    let manifest = Manifest::parse(&manifest_bytes, m).map_err(local)?;
    let mut uploaded = 0u64;
    for c in &manifest.chunks {
        let sent = upload_missing(client, &layout.chunk(&c.digest), c.len, || {
            let mut r = store
                .open_object(&lease, &c.digest, Some(c.len), true)
                .map_err(local)?;
            let mut buf = Vec::with_capacity(c.len as usize);
            r.read_to_end(&mut buf).map_err(local)?;
            Ok(Bytes::from(buf))
        })?;
        if sent {
            uploaded += c.len;
        }
    }
    upload_missing(
        client,
        &layout.manifest(m),
        manifest_bytes.len() as u64,
        || Ok(Bytes::from(manifest_bytes.clone())),
    )?;
    let _ = lease.end();
    let record = RefRecord {
        key: key.to_string(),
        manifest: *m,
        producer: format!(
            "torch-compiled-graphs {} on {}",
            env!("CARGO_PKG_VERSION"),
            host_name()
        ),
        created: unix_now(),
    };
    let outcome = create_ref(client, layout, &record)?;
    Ok((outcome, uploaded))
}

/// Create the ref first-writer-wins with read-back and bounded retries
/// (FLEET.md §2 step 3).
pub fn create_ref(
    client: &Client,
    layout: &Layout,
    record: &RefRecord,
) -> Result<RemotePublication, RemoteError> {
    let path = layout.graph_ref(&record.key);
    let body = Bytes::from(record.to_bytes());
    let mut last = String::new();
    for attempt in 0..CREATE_ATTEMPTS {
        if attempt > 0 {
            std::thread::sleep(Duration::from_millis(100 << attempt));
        }
        match client.create(&path, body.clone()) {
            Ok(_) => {
                return Ok(RemotePublication {
                    outcome: StoreOutcome::Stored,
                    manifest: record.manifest.to_hex(),
                })
            }
            Err(f) => last = f.to_string(),
        }
        // Exists, timeout or transport error: the read-back decides.
        match read_ref(client, layout, &record.key) {
            Ok(Some(r)) if r.manifest == record.manifest => {
                return Ok(RemotePublication {
                    outcome: StoreOutcome::Present,
                    manifest: r.manifest.to_hex(),
                })
            }
            Ok(Some(r)) => {
                return Ok(RemotePublication {
                    outcome: StoreOutcome::Divergent,
                    manifest: r.manifest.to_hex(),
                })
            }
            Ok(None) => {}
            // A bad incumbent is an operator's to repair, never ours to overwrite.
            Err(e @ RemoteError::Bad { .. }) => return Err(e),
            Err(RemoteError::Unavailable(m)) => last = m,
        }
    }
    Err(RemoteError::Unavailable(format!(
        "creating the ref failed {CREATE_ATTEMPTS} times: {last}"
    )))
}
