//! The object store client, built on first use, and every remote call with
//! its bound (FLEET.md §5): a hit path that never needs the remote never
//! builds a client, a runtime or a connection.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use object_store::path::Path;
use object_store::{
    ClientOptions, ObjectMeta, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload,
    RetryConfig, UpdateVersion,
};
use tcg_core::{Code, Error, Result};
use tokio::runtime::Runtime;

use crate::config::RemoteConfig;

/// Why a remote call failed, as the protocol needs to tell it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fail {
    /// The object does not exist.
    NotFound,
    /// A conditional create found the object (If-None-Match).
    Exists,
    /// A conditional update's ETag did not match.
    Precondition,
    /// Anything else: timeout, refused, reset, 4xx/5xx, throttling.
    Transport(String),
    /// A listing could not be completed: it holds more names than the
    /// caller's cap (a listing never ends early without saying so).
    Incomplete(String),
}

impl std::fmt::Display for Fail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fail::NotFound => f.write_str("not found"),
            Fail::Exists => f.write_str("already exists"),
            Fail::Precondition => f.write_str("precondition failed"),
            Fail::Transport(m) | Fail::Incomplete(m) => f.write_str(m),
        }
    }
}

fn classify(e: object_store::Error) -> Fail {
    match e {
        object_store::Error::NotFound { .. } => Fail::NotFound,
        object_store::Error::AlreadyExists { .. } => Fail::Exists,
        object_store::Error::Precondition { .. } | object_store::Error::NotModified { .. } => {
            Fail::Precondition
        }
        e => Fail::Transport(one_line(&e)),
    }
}

fn one_line(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        let t = inner.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        src = inner.source();
    }
    // Bounded: the guard caps error bodies, and a message is a sentence.
    let mut s: String = s.replace(['\n', '\r'], " ");
    if s.len() > MAX_MESSAGE_BYTES {
        let mut cut = MAX_MESSAGE_BYTES;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str(" …");
    }
    s
}

/// Longest error message kept from a remote failure.
pub const MAX_MESSAGE_BYTES: usize = 8192;

/// One listing: the objects, and the entries the guard could not parse
/// (each as "name: why"), skipped and reported rather than failing it.
#[derive(Debug, Clone, Default)]
pub struct Listing {
    /// The usable objects, in the store's order.
    pub objects: Vec<ObjectMeta>,
    /// The entries skipped, with why.
    pub skipped: Vec<crate::guard::SkippedEntry>,
}

/// A built client: the store, its runtime and the prefix inside it.
pub struct Client {
    pub(crate) store: Arc<dyn ObjectStore>,
    pub(crate) runtime: OwnedRuntime,
    pub(crate) config: RemoteConfig,
}

/// The client's runtime, shut down without waiting when the client goes:
/// every call on it has returned by then, and what is left (idle
/// connections, a cancelled task) needs no wait.
pub(crate) struct OwnedRuntime(Option<Runtime>);

impl std::ops::Deref for OwnedRuntime {
    type Target = Runtime;
    fn deref(&self) -> &Runtime {
        self.0
            .as_ref()
            .expect("the runtime lives as long as its client")
    }
}

impl Drop for OwnedRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// Split `scheme://bucket/prefix` into (`scheme://bucket`, prefix).
pub fn split_url(url: &str) -> (String, String) {
    let (scheme, rest) = url.split_once("://").unwrap_or(("s3", url));
    match rest.split_once('/') {
        Some((bucket, prefix)) => (format!("{scheme}://{bucket}"), prefix.to_string()),
        None => (url.to_string(), String::new()),
    }
}

fn build_store(config: &RemoteConfig) -> Result<Arc<dyn ObjectStore>> {
    build_store_with(config, false)
}

/// A store for `fleet doctor`'s wrong-checksum probe: every PUT body is
/// altered after its checksum was computed, and sent unsigned (tamper.rs).
/// `None` for stores other than S3 (the probe is S3's header).
pub(crate) fn tampering_store(config: &RemoteConfig) -> Option<Arc<dyn ObjectStore>> {
    let scheme = split_url(&config.url).0;
    let s3 = matches!(scheme.split("://").next(), Some("s3" | "s3a"));
    if !s3 {
        return None;
    }
    build_store_with(config, true).ok()
}

fn build_store_with(config: &RemoteConfig, tamper: bool) -> Result<Arc<dyn ObjectStore>> {
    let (base, _prefix) = split_url(&config.url);
    let invalid = |e: &dyn std::error::Error| {
        Error::new(
            Code::RemoteConfigInvalid,
            format!("remote {}: {}", config.url, one_line(e)),
        )
    };
    // Our own bounds wrap every call; the client's are a backstop with few
    // retries, so that a dead remote costs seconds, not minutes.
    let options = ClientOptions::new()
        .with_connect_timeout(config.timeout)
        .with_timeout(Duration::from_secs(3600))
        .with_pool_idle_timeout(Duration::from_secs(30));
    let retry = RetryConfig {
        max_retries: 2,
        retry_timeout: config.timeout,
        ..RetryConfig::default()
    };
    let scheme = base.split("://").next().unwrap_or("");
    match scheme {
        #[cfg(feature = "aws")]
        "s3" | "s3a" => {
            use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey, Checksum};
            let mut b = AmazonS3Builder::new()
                .with_client_options(options)
                .with_retry(retry)
                .with_checksum_algorithm(Checksum::SHA256);
            // The standard variables, applied over our defaults (as from_env does).
            for (k, v) in std::env::vars() {
                if k.starts_with("AWS_") {
                    if let Ok(key) = k.to_ascii_lowercase().parse::<AmazonS3ConfigKey>() {
                        b = b.with_config(key, v);
                    }
                }
            }
            for (k, v) in &config.options {
                let key = k.parse::<AmazonS3ConfigKey>().map_err(|e| invalid(&e))?;
                b = b.with_config(key, v);
            }
            if tamper {
                b = b.with_unsigned_payload(true);
            }
            b = b.with_http_connector(crate::guard::GuardConnector { tamper });
            let s = b.with_url(base.as_str()).build().map_err(|e| invalid(&e))?;
            Ok(Arc::new(s))
        }
        #[cfg(feature = "gcp")]
        "gs" => {
            let s = object_store::gcp::GoogleCloudStorageBuilder::from_env()
                .with_http_connector(crate::guard::GuardConnector::default())
                .with_client_options(options)
                .with_retry(retry)
                .with_url(base.as_str())
                .build()
                .map_err(|e| invalid(&e))?;
            Ok(Arc::new(s))
        }
        #[cfg(feature = "azure")]
        "az" | "abfs" | "abfss" => {
            let s = object_store::azure::MicrosoftAzureBuilder::from_env()
                .with_http_connector(crate::guard::GuardConnector::default())
                .with_client_options(options)
                .with_retry(retry)
                .with_url(base.as_str())
                .build()
                .map_err(|e| invalid(&e))?;
            Ok(Arc::new(s))
        }
        _ => {
            let _ = (options, retry, tamper);
            Err(Error::new(
                Code::RemoteConfigInvalid,
                format!(
                    "remote {}: this build does not support {scheme}:// (features aws, gcp, azure)",
                    config.url
                ),
            ))
        }
    }
}

/// `fut` within `limit`, its error classified.
async fn within<T>(
    limit: Duration,
    fut: impl std::future::Future<Output = std::result::Result<T, object_store::Error>>,
) -> std::result::Result<T, Fail> {
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => r.map_err(classify),
        Err(_) => Err(Fail::Transport(format!(
            "no answer within {:.1} s",
            limit.as_secs_f64()
        ))),
    }
}

impl Client {
    /// Build the client and its runtime (two worker threads).
    pub fn build(config: &RemoteConfig) -> Result<Client> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("tcg-remote")
            .enable_all()
            .build()
            .map_err(|e| Error::io("cannot start the remote tier's runtime", &e))?;
        // Building the reqwest client needs a runtime context.
        let store = {
            let _guard = runtime.enter();
            build_store(config)?
        };
        Ok(Client {
            store,
            runtime: OwnedRuntime(Some(runtime)),
            config: config.clone(),
        })
    }

    /// Run `fut` on the client's runtime within `limit`.
    pub fn run<T>(
        &self,
        limit: Duration,
        fut: impl std::future::Future<Output = std::result::Result<T, object_store::Error>>,
    ) -> std::result::Result<T, Fail> {
        self.runtime.block_on(within(limit, fut))
    }

    /// GET a small object, refusing one longer than `cap` before reading it.
    pub fn get_small(
        &self,
        path: &Path,
        cap: u64,
    ) -> std::result::Result<(Bytes, ObjectMeta), Fail> {
        let store = Arc::clone(&self.store);
        let limit = self.config.data_timeout(cap);
        self.run(limit, async move {
            let r = store.get(path).await?;
            let meta = r.meta.clone();
            if meta.size > cap {
                return Err(object_store::Error::Generic {
                    store: "tcg-remote",
                    source: format!("{path} is {} bytes, over the limit of {cap}", meta.size)
                        .into(),
                });
            }
            let bytes = r.bytes().await?;
            Ok((bytes, meta))
        })
    }

    /// HEAD.
    pub fn head(&self, path: &Path) -> std::result::Result<ObjectMeta, Fail> {
        let store = Arc::clone(&self.store);
        self.run(self.config.timeout, async move { store.head(path).await })
    }

    /// PUT with a mode; returns the new ETag.
    pub fn put(
        &self,
        path: &Path,
        bytes: Bytes,
        mode: PutMode,
    ) -> std::result::Result<Option<String>, Fail> {
        let store = Arc::clone(&self.store);
        let limit = self.config.data_timeout(bytes.len() as u64);
        let opts = PutOptions {
            mode,
            ..PutOptions::default()
        };
        self.run(limit, async move {
            store
                .put_opts(path, PutPayload::from(bytes), opts)
                .await
                .map(|r| r.e_tag)
        })
    }

    /// PUT if absent (`If-None-Match: *`).
    pub fn create(&self, path: &Path, bytes: Bytes) -> std::result::Result<Option<String>, Fail> {
        self.put(path, bytes, PutMode::Create)
    }

    /// PUT if the ETag still matches (`If-Match`).
    pub fn update(
        &self,
        path: &Path,
        bytes: Bytes,
        etag: &str,
    ) -> std::result::Result<Option<String>, Fail> {
        self.put(
            path,
            bytes,
            PutMode::Update(UpdateVersion {
                e_tag: Some(etag.to_string()),
                version: None,
            }),
        )
    }

    /// DELETE (absent is fine).
    pub fn delete(&self, path: &Path) -> std::result::Result<(), Fail> {
        let store = Arc::clone(&self.store);
        match self.run(self.config.timeout, async move { store.delete(path).await }) {
            Ok(()) | Err(Fail::NotFound) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// LIST `prefix` to its end (following the store's continuation
    /// tokens) within `limit` in all: more than `max` objects is
    /// [`Fail::Incomplete`], never a shorter listing. Entries the guard
    /// cannot parse are skipped and named in [`Listing::skipped`].
    pub fn list_within(
        &self,
        prefix: &Path,
        max: usize,
        limit: Duration,
    ) -> std::result::Result<Listing, Fail> {
        match self.list_first(prefix, max, limit)? {
            (listing, true) => Ok(listing),
            (_, false) => Err(Fail::Incomplete(format!(
                "{prefix} holds more than {max} objects; the listing was not completed"
            ))),
        }
    }

    /// The first `max` objects under `prefix` within `limit`, and whether
    /// that is all of them (`false`: there are more, not read). For readers
    /// that may act on a part (never for a deletion).
    pub fn list_first(
        &self,
        prefix: &Path,
        max: usize,
        limit: Duration,
    ) -> std::result::Result<(Listing, bool), Fail> {
        use futures_util::StreamExt;
        let store = Arc::clone(&self.store);
        let listing = async move {
            let mut out = Vec::new();
            let mut s = store.list(Some(prefix));
            while let Some(m) = s.next().await {
                let m = m?;
                if out.len() == max {
                    return Ok((out, false));
                }
                out.push(m);
            }
            Ok((out, true))
        };
        let (listed, skipped) = self
            .runtime
            .block_on(crate::guard::collect_skipped(within(limit, listing)));
        let (objects, complete) = listed?;
        Ok((Listing { objects, skipped }, complete))
    }

    /// An operator command's listing of `prefix` ([`Client::list_within`]
    /// with the configured cap and the operator bound).
    pub fn list_all(&self, prefix: &Path) -> std::result::Result<Listing, Fail> {
        self.list_within(prefix, self.config.list_cap, self.config.list_timeout())
    }

    /// The objects under `prefix`, at most `max` of them (more is
    /// [`Fail::Incomplete`]), within the operator bound.
    pub fn list(&self, prefix: &Path, max: usize) -> std::result::Result<Vec<ObjectMeta>, Fail> {
        self.list_within(prefix, max, self.config.list_timeout())
            .map(|l| l.objects)
    }
}
