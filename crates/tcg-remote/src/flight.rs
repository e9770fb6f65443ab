//! Fleet-wide single-flight with lease objects (FLEET.md §4). An
//! optimisation: correctness never depends on it.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use chrono::{DateTime, Utc};
use object_store::path::Path;
use object_store::{PutMode, PutOptions, PutPayload, UpdateVersion};
use tcg_core::engine::Flight;

use crate::client::{Client, Fail};
use crate::layout::{host_name, random_hex32, Layout, LeaseRecord, MAX_LEASE_BYTES};

/// The server's clock, read once from an object's `last_modified` and
/// advanced by this process's monotonic clock: expiry never reads the local
/// wall clock.
#[derive(Debug, Default)]
pub struct ServerClock(Mutex<Option<(DateTime<Utc>, Instant)>>);

impl ServerClock {
    /// The server's time now, probing once.
    pub fn now(&self, client: &Client, layout: &Layout) -> Option<DateTime<Utc>> {
        let mut slot = self.0.lock().ok()?;
        if slot.is_none() {
            let probe = layout.folder(&format!("clock/{}", random_hex32()));
            client.put(&probe, Bytes::new(), PutMode::Overwrite).ok()?;
            let meta = client.head(&probe).ok();
            let _ = client.delete(&probe);
            *slot = Some((meta?.last_modified, Instant::now()));
        }
        let (at, when) = (*slot)?;
        Some(at + chrono::Duration::from_std(when.elapsed()).ok()?)
    }
}

/// Holding the lease: renewed in the background every ttl/3, deleted on drop.
pub struct LeaseGuard {
    client: Arc<Client>,
    path: Path,
    etag: Arc<Mutex<String>>,
    renew: tokio::task::JoinHandle<()>,
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        self.renew.abort();
        // Delete only what is still ours: a taker-over's lease is left alone.
        let ours = self.etag.lock().map(|e| e.clone()).unwrap_or_default();
        if let Ok(meta) = self.client.head(&self.path) {
            if meta.e_tag.as_deref() == Some(ours.as_str()) {
                let _ = self.client.delete(&self.path);
            }
        }
    }
}

fn lead(client: &Arc<Client>, path: Path, body: Bytes, etag: String, ttl: Duration) -> Flight {
    let etag = Arc::new(Mutex::new(etag));
    let store = Arc::clone(&client.store);
    let (p, e) = (path.clone(), Arc::clone(&etag));
    let timeout = client.config.timeout;
    let renew = client.runtime.spawn(async move {
        loop {
            tokio::time::sleep(ttl / 3).await;
            let current = e.lock().map(|g| g.clone()).unwrap_or_default();
            let opts = PutOptions {
                mode: PutMode::Update(UpdateVersion {
                    e_tag: Some(current),
                    version: None,
                }),
                ..PutOptions::default()
            };
            let put = store.put_opts(&p, PutPayload::from(body.clone()), opts);
            match tokio::time::timeout(timeout, put).await {
                Ok(Ok(r)) => {
                    if let (Some(tag), Ok(mut g)) = (r.e_tag, e.lock()) {
                        *g = tag;
                    }
                }
                // Lost (taken over) or unreachable: the compile goes on
                // without the lease; the ref still decides.
                Ok(Err(_)) => return,
                Err(_) => continue,
            }
        }
    });
    Flight::Lead(Box::new(LeaseGuard {
        client: Arc::clone(client),
        path,
        etag,
        renew,
    }))
}

/// Whether the lease described by (`last_modified`, `body`) has expired by
/// the server's clock.
fn expired(
    clock: &ServerClock,
    client: &Client,
    layout: &Layout,
    last_modified: DateTime<Utc>,
    body: &[u8],
) -> bool {
    let ttl = LeaseRecord::parse(body).map(|r| r.ttl_s).unwrap_or(0);
    match clock.now(client, layout) {
        Some(now) => last_modified + chrono::Duration::seconds(ttl) < now,
        None => false,
    }
}

/// Take the lease of `key`, take over an expired one, or follow a live one.
pub fn begin(client: &Arc<Client>, layout: &Layout, clock: &ServerClock, key: &str) -> Flight {
    let ttl = client.config.lease_ttl;
    let path = layout.lease(key);
    let body = Bytes::from(
        LeaseRecord {
            holder: random_hex32(),
            host: host_name(),
            ttl_s: ttl.as_secs().max(1) as i64,
        }
        .to_bytes(),
    );
    for _ in 0..2 {
        match client.create(&path, body.clone()) {
            Ok(Some(etag)) => return lead(client, path, body, etag, ttl),
            Ok(None) => return Flight::Solo,
            Err(Fail::Exists) => {}
            Err(_) => return Flight::Solo,
        }
        match client.get_small(&path, MAX_LEASE_BYTES) {
            Ok((held, meta)) => {
                if !expired(clock, client, layout, meta.last_modified, &held) {
                    return Flight::Follow;
                }
                let Some(stale) = meta.e_tag else {
                    return Flight::Follow;
                };
                return match client.update(&path, body.clone(), &stale) {
                    Ok(Some(etag)) => lead(client, path, body, etag, ttl),
                    Ok(None) => Flight::Solo,
                    // Another worker took it over first.
                    Err(Fail::Precondition) => Flight::Follow,
                    Err(_) => Flight::Solo,
                };
            }
            // Released meanwhile: try the create once more.
            Err(Fail::NotFound) => continue,
            Err(_) => return Flight::Solo,
        }
    }
    Flight::Follow
}

/// Wait for another worker's ref with jittered backoff, up to the
/// configured wait; stop early when the lease is gone or expired.
///
/// The pause grows from 0.1 s to at most 1 s (plus up to 0.2 s of jitter):
/// a follower sees the leader's ref at most ~1.2 s after it appears, which
/// is small against a compile, while a waiting follower costs the bucket at
/// most two small GETs a second.
pub fn await_ref(client: &Client, layout: &Layout, clock: &ServerClock, key: &str) -> bool {
    await_until(
        client,
        layout,
        clock,
        key,
        &|| match crate::fetch::read_ref(client, layout, key) {
            Ok(r) => Some(r.is_some()),
            Err(_) => None,
        },
    )
}

/// Wait until `done` says `Some(true)` (`None`: stop, the remote failed),
/// with jittered backoff up to the configured wait; stop early when the
/// lease of `key` is gone or expired (then `done` decides once more).
pub fn await_until(
    client: &Client,
    layout: &Layout,
    clock: &ServerClock,
    key: &str,
    done: &dyn Fn() -> Option<bool>,
) -> bool {
    let deadline = Instant::now() + client.config.wait;
    let mut pause = Duration::from_millis(100);
    loop {
        match done() {
            Some(true) => return true,
            Some(false) => {}
            None => return false,
        }
        match client.get_small(&layout.lease(key), MAX_LEASE_BYTES) {
            Ok((held, meta)) => {
                if expired(clock, client, layout, meta.last_modified, &held) {
                    return false;
                }
            }
            // No lease and no ref: the leader gave up; one last look.
            Err(Fail::NotFound) => return done() == Some(true),
            Err(_) => {}
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        let jitter =
            Duration::from_millis(u64::from_str_radix(&random_hex32()[..4], 16).unwrap_or(0) % 200);
        std::thread::sleep((pause + jitter).min(deadline - now));
        pause = (pause * 3 / 2).min(Duration::from_secs(1));
    }
}
