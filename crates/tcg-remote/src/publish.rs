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

/// What [`upload_verified`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upload {
    /// The object held exactly the right bytes.
    Kept,
    /// It was missing: uploaded.
    Created,
    /// It held other bytes (proven: they do not hash to the name): replaced.
    Replaced,
}

/// `fleet repair`'s upload of a content-addressed object: read what the
/// remote holds at `path` and replace it when its bytes are not the ones
/// `digest` names (an overwritten chunk or manifest, proven wrong by its
/// SHA-256), upload it when missing, keep it otherwise.
pub fn upload_verified(
    client: &Client,
    path: &object_store::path::Path,
    digest: &Digest,
    len: u64,
    bytes: impl FnOnce() -> Result<Bytes, RemoteError>,
) -> Result<Upload, RemoteError> {
    let verdict = match client.head(path) {
        Err(Fail::NotFound) => Upload::Created,
        Err(f) => return Err(unavailable("checking an object", f)),
        Ok(meta) if meta.size != len => Upload::Replaced,
        Ok(_) => match client.get_small(path, len) {
            Ok((b, _)) if Digest::of(&b) == *digest => return Ok(Upload::Kept),
            Ok(_) => Upload::Replaced,
            Err(Fail::NotFound) => Upload::Created,
            Err(f) => return Err(unavailable("reading an object back", f)),
        },
    };
    let body = bytes()?;
    client
        .put(path, body, object_store::PutMode::Overwrite)
        .map_err(|f| unavailable("uploading", f))?;
    Ok(verdict)
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
    let (p, uploaded, _) = publish_objects(client, layout, store, key, m, false)?;
    Ok((p, uploaded))
}

/// [`publish`]; with `verify` (`fleet repair`), every chunk and the
/// manifest already on the remote is read back and replaced when its bytes
/// are proven wrong ([`upload_verified`]). Also returns how many objects
/// were replaced.
pub fn publish_objects(
    client: &Client,
    layout: &Layout,
    store: &Store,
    key: &str,
    m: &Digest,
    verify: bool,
) -> Result<(RemotePublication, u64, u64), RemoteError> {
    let (uploaded, replaced) = upload_objects(client, layout, store, m, verify)?;
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
    Ok((outcome, uploaded, replaced))
}

/// Upload the chunks, then the manifest, of the locally stored envelope `m`
/// ([`publish_objects`]). Returns (chunk bytes uploaded, objects replaced).
pub fn upload_objects(
    client: &Client,
    layout: &Layout,
    store: &Store,
    m: &Digest,
    verify: bool,
) -> Result<(u64, u64), RemoteError> {
    let lease = store.lease().map_err(local)?;
    let manifest_bytes = store
        .read_object(&lease, m, crate::layout::MAX_MANIFEST_BYTES)
        .map_err(local)?;
    let manifest = Manifest::parse(&manifest_bytes, m).map_err(local)?;
    let mut uploaded = 0u64;
    let mut replaced = 0u64;
    for c in &manifest.chunks {
        let read = || {
            let mut r = store
                .open_object(&lease, &c.digest, Some(c.len), true)
                .map_err(local)?;
            let mut buf = Vec::with_capacity(c.len as usize);
            r.read_to_end(&mut buf).map_err(local)?;
            Ok(Bytes::from(buf))
        };
        let path = layout.chunk(&c.digest);
        if verify {
            match upload_verified(client, &path, &c.digest, c.len, read)? {
                Upload::Kept => {}
                Upload::Created => uploaded += c.len,
                Upload::Replaced => {
                    uploaded += c.len;
                    replaced += 1;
                }
            }
        } else if upload_missing(client, &path, c.len, read)? {
            uploaded += c.len;
        }
    }
    let path = layout.manifest(m);
    let len = manifest_bytes.len() as u64;
    let body = || Ok(Bytes::from(manifest_bytes.clone()));
    if verify {
        if upload_verified(client, &path, m, len, body)? == Upload::Replaced {
            replaced += 1;
        }
    } else {
        upload_missing(client, &path, len, body)?;
    }
    let _ = lease.end();
    Ok((uploaded, replaced))
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
