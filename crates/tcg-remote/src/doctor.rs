//! Store qualification (FLEET.md §7): prove that the remote's conditional
//! writes are atomic before a fleet relies on single-flight and
//! first-writer-wins. The verdict is printed by the CLI and cached per
//! remote; a remote whose race fails is used without single-flight.

use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use object_store::{ObjectStoreExt, PutMode, PutOptions, PutPayload};
use sha2::{Digest as _, Sha256};
use tcg_cj::{Map, Value};
use tcg_core::{Code, Error, Result};

use crate::client::Fail;
use crate::layout::random_hex32;
use crate::Remote;

/// Racers in the create race.
pub const RACERS: usize = 16;

/// The doctor's findings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// A second conditional create of one name is refused.
    pub second_create_refused: bool,
    /// An update with a stale ETag is refused.
    pub stale_update_refused: bool,
    /// How many of the racers' creates succeeded (must be exactly 1).
    pub race_winners: usize,
    /// The object left by the race is one racer's body, intact.
    pub race_body_intact: bool,
    /// Whether an upload whose checksum does not match its bytes was refused
    /// (`None`: could not be told; reported, not required).
    pub checksum_refused: Option<bool>,
}

impl Verdict {
    /// Whether the fleet may rely on this remote's conditional writes.
    pub fn qualified(&self) -> bool {
        self.second_create_refused
            && self.stale_update_refused
            && self.race_winners == 1
            && self.race_body_intact
    }

    /// The verdict as JSON.
    pub fn to_value(&self, url: &str) -> Value {
        let mut m = Map::new();
        m.insert("remote".into(), url.into());
        m.insert("qualified".into(), Value::Bool(self.qualified()));
        m.insert(
            "second_create_refused".into(),
            Value::Bool(self.second_create_refused),
        );
        m.insert(
            "stale_update_refused".into(),
            Value::Bool(self.stale_update_refused),
        );
        m.insert("racers".into(), Value::Int(RACERS as i64));
        m.insert("race_winners".into(), Value::Int(self.race_winners as i64));
        m.insert(
            "race_body_intact".into(),
            Value::Bool(self.race_body_intact),
        );
        m.insert(
            "checksum_refused".into(),
            self.checksum_refused
                .map(Value::Bool)
                .unwrap_or(Value::Null),
        );
        Value::Object(m)
    }
}

fn cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    // Beside the default store root (`$XDG_CACHE_HOME/torch-compiled-graphs`),
    // never inside it: a store root holds a store and nothing else.
    Some(base.join("torch-compiled-graphs-fleet-doctor"))
}

fn cache_file(url: &str) -> Option<PathBuf> {
    Some(cache_dir()?.join(format!(
        "{}.json",
        hex::encode(Sha256::digest(url.as_bytes()))
    )))
}

/// The cached verdict of `url`: `Some(qualified)` once `fleet doctor` ran.
pub fn cached_verdict(url: &str) -> Option<bool> {
    let bytes = std::fs::read(cache_file(url)?).ok()?;
    let v = tcg_cj::parse_strict(&bytes).ok()?;
    match v.as_object()?.get("qualified")? {
        Value::Bool(b) => Some(*b),
        _ => None,
    }
}

fn write_cache(url: &str, v: &Value) {
    let Some(path) = cache_file(url) else { return };
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    if let Ok(bytes) = tcg_cj::to_canonical(v) {
        let tmp = path.with_extension(format!("tmp-{}", random_hex32()));
        if std::fs::write(&tmp, bytes).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
}

fn unavailable(what: &str, f: Fail) -> Error {
    Error::new(
        Code::RemoteUnavailable,
        format!("fleet doctor: {what}: {f}"),
    )
}

/// Send an upload whose bytes do not match its `x-amz-checksum-sha256`
/// (tamper.rs): `Some(true)` when the server refuses it for its checksum
/// (a 400 naming the checksum or digest), `Some(false)` when it stores the
/// altered bytes, `None` when that cannot be told (not S3, or another failure).
fn checksum_probe(remote: &Remote, client: &crate::client::Client, base: &str) -> Option<bool> {
    let store = {
        let _guard = client.runtime.enter();
        crate::client::tampering_store(remote.config())?
    };
    let path = remote.layout().folder(&format!("{base}/checksum"));
    let body = b"fleet doctor checksum probe ".repeat(16);
    let limit = remote.config().timeout * 4;
    let put = client.run(limit, store.put(&path, PutPayload::from(body.clone())));
    match put {
        Ok(_) => {
            // Accepted: read it back (through the honest client) to be sure
            // the bytes the server kept are the altered ones.
            let stored = client.run(limit, async {
                let r = client.store.get(&path).await?;
                r.bytes().await
            });
            let _ = client.delete(&path);
            match stored {
                Ok(b) if b.as_ref() != body.as_slice() && b.len() == body.len() => Some(false),
                _ => None,
            }
        }
        Err(Fail::Transport(m)) => {
            let m = m.to_ascii_lowercase();
            let about_checksum = m.contains("checksum") || m.contains("digest");
            (about_checksum && m.contains("400")).then_some(true)
        }
        Err(_) => None,
    }
}

/// Run every check against `remote`, cache the verdict and return it.
pub fn run(remote: &Remote) -> Result<Verdict> {
    let client = remote.client()?;
    let base = format!("doctor/{}", random_hex32());
    let one = remote.layout().folder(&format!("{base}/create"));
    let first = client
        .create(&one, Bytes::from_static(b"first"))
        .map_err(|f| unavailable("first create", f))?;
    let second_create_refused = matches!(
        client.create(&one, Bytes::from_static(b"second")),
        Err(Fail::Exists)
    );
    let stale = first.unwrap_or_default();
    let stale_update_refused = match client.update(&one, Bytes::from_static(b"update"), &stale) {
        Ok(_) => matches!(
            client.update(&one, Bytes::from_static(b"stale"), &stale),
            Err(Fail::Precondition)
        ),
        Err(f) => return Err(unavailable("conditional update", f)),
    };
    // The race: RACERS tasks released together by a barrier.
    let race = remote.layout().folder(&format!("{base}/race"));
    let store = Arc::clone(&client.store);
    let limit = remote.config().timeout * 4;
    let wins: Vec<Option<Vec<u8>>> = client.runtime.block_on(async {
        let barrier = Arc::new(tokio::sync::Barrier::new(RACERS));
        let mut tasks = Vec::new();
        for i in 0..RACERS {
            let (store, race, barrier) = (Arc::clone(&store), race.clone(), Arc::clone(&barrier));
            tasks.push(tokio::spawn(async move {
                let body = format!("racer {i:02} {}", "x".repeat(4096)).into_bytes();
                barrier.wait().await;
                let opts = PutOptions {
                    mode: PutMode::Create,
                    ..PutOptions::default()
                };
                let put = store.put_opts(&race, PutPayload::from(body.clone()), opts);
                match tokio::time::timeout(limit, put).await {
                    Ok(Ok(_)) => Some(body),
                    _ => None,
                }
            }));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap_or(None));
        }
        out
    });
    let winners: Vec<Vec<u8>> = wins.into_iter().flatten().collect();
    let stored = client
        .run(limit, async {
            let r = store.get(&race).await?;
            r.bytes().await
        })
        .map_err(|f| unavailable("reading the race's object", f))?;
    let race_body_intact = winners.iter().any(|w| w.as_slice() == stored.as_ref());
    for p in [&one, &race] {
        let _ = client.delete(p);
    }
    let checksum_refused = checksum_probe(remote, client, &base);
    let verdict = Verdict {
        second_create_refused,
        stale_update_refused,
        race_winners: winners.len(),
        race_body_intact,
        checksum_refused,
    };
    write_cache(
        &remote.config().url,
        &verdict.to_value(&remote.config().url),
    );
    Ok(verdict)
}
