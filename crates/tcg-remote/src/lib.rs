//! The fleet tier of torch-compiled-graphs (FLEET.md): many local stores
//! share one S3-compatible object store through the `object_store` crate.
//!
//! The remote is a source of envelopes and a place to publish them; the
//! local store stays the only place a worker serves from. [`Remote`]
//! implements the engine's [`RemoteTier`] hook; the engine calls it on a
//! local miss. The crate owns its tokio runtime, built on first use, so a
//! local hit never builds a client, a runtime or a connection.
#![deny(missing_docs)]

pub mod client;
pub mod config;
pub mod doctor;
pub mod fetch;
pub mod flight;
pub mod guard;
pub mod layout;
pub mod ops;
pub mod publish;
pub mod signatures;
mod tamper;

use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use tcg_cas::{Digest, Store};
use tcg_core::engine::{
    Flight, RemoteEnvelope, RemoteError, RemotePublication, RemoteTier, SignatureRecords,
};
use tcg_core::{Code, Error, Result};

pub use client::{Client, Fail};
pub use config::RemoteConfig;
pub use layout::{Layout, LeaseRecord, RefRecord};

/// One configured remote. Cheap to create: nothing is built or contacted
/// until the first call that needs the remote.
pub struct Remote {
    config: RemoteConfig,
    layout: Layout,
    client: OnceLock<std::result::Result<Arc<Client>, String>>,
    clock: flight::ServerClock,
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote")
            .field("url", &self.config.url)
            .finish_non_exhaustive()
    }
}

impl Remote {
    /// A remote for `config` (the URL is checked; nothing is contacted).
    pub fn new(config: RemoteConfig) -> Result<Remote> {
        let (_, prefix) = client::split_url(&config.url);
        Ok(Remote {
            layout: Layout::new(&prefix),
            config,
            client: OnceLock::new(),
            clock: flight::ServerClock::default(),
        })
    }

    /// [`Remote::new`] with the settings from the environment.
    pub fn from_url(url: &str) -> Result<Remote> {
        Remote::new(RemoteConfig::from_env(url)?)
    }

    /// The settings.
    pub fn config(&self) -> &RemoteConfig {
        &self.config
    }

    /// The object names.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Whether the client has been built (tests pin that a hit never builds it).
    pub fn is_connected(&self) -> bool {
        self.client.get().is_some()
    }

    /// The client, built on first use.
    pub fn client(&self) -> Result<&Arc<Client>> {
        self.client
            .get_or_init(|| {
                Client::build(&self.config)
                    .map(Arc::new)
                    .map_err(|e| e.message().to_string())
            })
            .as_ref()
            .map_err(|m| Error::new(Code::RemoteConfigInvalid, m.clone()))
    }

    fn tier_client(&self) -> std::result::Result<&Arc<Client>, RemoteError> {
        self.client()
            .map_err(|e| RemoteError::Unavailable(e.message().to_string()))
    }

    /// The single-flight decision for `key`, unless `fleet doctor` found
    /// that this remote lets two racers win a create.
    fn flight_allowed(&self) -> bool {
        doctor::cached_verdict(&self.config.url) != Some(false)
    }
}

impl RemoteTier for Remote {
    fn open(&self, key: &str) -> std::result::Result<Option<RemoteEnvelope>, RemoteError> {
        let client = self.tier_client()?;
        fetch::open(client, &self.layout, key)
    }

    fn publish(
        &self,
        store: &Store,
        key: &str,
        manifest: &Digest,
    ) -> std::result::Result<RemotePublication, RemoteError> {
        let client = self.tier_client()?;
        publish::publish(client, &self.layout, store, key, manifest).map(|(p, _)| p)
    }

    fn begin_flight(&self, key: &str) -> Flight {
        if !self.flight_allowed() {
            return Flight::Solo;
        }
        match self.tier_client() {
            Ok(c) => flight::begin(c, &self.layout, &self.clock, key),
            Err(_) => Flight::Solo,
        }
    }

    fn await_flight(&self, key: &str) -> bool {
        match self.tier_client() {
            Ok(c) => flight::await_ref(c, &self.layout, &self.clock, key),
            Err(_) => false,
        }
    }

    fn report(&self, key: &str, manifest: &str, why: &str) -> bool {
        let Ok(client) = self.tier_client() else {
            return false;
        };
        let manifest = if Digest::from_hex(manifest).is_some() {
            manifest.to_string()
        } else {
            "0".repeat(64)
        };
        let mut m = tcg_cj::Map::new();
        m.insert("format".into(), tcg_cj::Value::Int(1));
        m.insert("key".into(), key.into());
        m.insert("manifest".into(), format!("sha256:{manifest}").into());
        m.insert("reporter".into(), layout::host_name().into());
        m.insert("created".into(), tcg_cj::Value::Int(layout::unix_now()));
        // Bounded: evidence is a sentence, not a dump of hostile bytes.
        let why: String = why.chars().take(2000).collect();
        m.insert("why".into(), why.into());
        let body = tcg_cj::to_canonical(&tcg_cj::Value::Object(m)).unwrap_or_default();
        let path = self.layout.report(key, &manifest, &layout::random_hex32());
        client.create(&path, Bytes::from(body)).is_ok()
    }

    fn signature_records(
        &self,
        key: &str,
        fingerprints: Option<&[String]>,
    ) -> std::result::Result<SignatureRecords, RemoteError> {
        let client = self.tier_client()?;
        signatures::records(client, &self.layout, key, fingerprints)
    }

    fn open_manifest(
        &self,
        key: &str,
        manifest: &Digest,
    ) -> std::result::Result<Option<RemoteEnvelope>, RemoteError> {
        let _ = key;
        let client = self.tier_client()?;
        fetch::open_manifest(client, &self.layout, manifest)
    }

    fn publish_signature(
        &self,
        key: &str,
        manifest: &Digest,
        fingerprint_hex: &str,
        record: &[u8],
    ) -> std::result::Result<bool, RemoteError> {
        let client = self.tier_client()?;
        signatures::put_record(client, &self.layout, key, fingerprint_hex, manifest, record)
    }

    fn await_signed(&self, key: &str, fingerprints: &[String]) -> bool {
        match self.tier_client() {
            Ok(c) => flight::await_until(c, &self.layout, &self.clock, key, &|| {
                signatures::any_record(c, &self.layout, key, fingerprints).ok()
            }),
            Err(_) => false,
        }
    }

    fn has_ref(&self, key: &str) -> std::result::Result<Option<Digest>, RemoteError> {
        let client = self.tier_client()?;
        fetch::read_ref(client, &self.layout, key).map(|r| r.map(|rec| rec.manifest))
    }
}
