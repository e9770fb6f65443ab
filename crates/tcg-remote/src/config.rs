//! Remote configuration: a URL (`s3://bucket/prefix`), the store's own
//! standard variables (`AWS_*` for S3) and a few bounds of our own.

use std::time::Duration;

use tcg_core::{Code, Error, Result};

/// The environment variable that names the remote when none is passed.
pub const REMOTE_ENV: &str = "TORCH_COMPILED_GRAPHS_REMOTE";
/// Metadata request timeout in seconds (connect and request).
pub const TIMEOUT_ENV: &str = "TORCH_COMPILED_GRAPHS_REMOTE_TIMEOUT_S";
/// The slowest transfer rate (bytes per second) a data request is allowed.
pub const MIN_RATE_ENV: &str = "TORCH_COMPILED_GRAPHS_REMOTE_MIN_RATE";
/// The fleet lease's time to live in seconds.
pub const LEASE_TTL_ENV: &str = "TORCH_COMPILED_GRAPHS_REMOTE_LEASE_TTL_S";
/// How long a worker waits for another worker's compile, in seconds.
pub const WAIT_ENV: &str = "TORCH_COMPILED_GRAPHS_REMOTE_WAIT_S";
/// Most objects an operator command's listing of one folder may hold.
pub const LIST_CAP_ENV: &str = "TORCH_COMPILED_GRAPHS_REMOTE_LIST_CAP";
/// Default of [`RemoteConfig::list_cap`].
pub const DEFAULT_LIST_CAP: usize = 1_000_000;
/// An operator command's listing may take this many metadata timeouts.
pub const OPERATOR_LIST_TIMEOUTS: u32 = 60;

/// Settings of one remote.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteConfig {
    /// `s3://bucket/prefix` (or `gs://`, `az://` where built with those features).
    pub url: String,
    /// Bound of every metadata request (refs, manifests, leases, HEAD), and
    /// of connecting.
    pub timeout: Duration,
    /// A data request (one chunk) may take `timeout + len / min_rate`.
    pub min_rate: u64,
    /// The lease's time to live (renewed every third of it).
    pub lease_ttl: Duration,
    /// The longest wait for another worker's compile (about 1.5x a compile).
    pub wait: Duration,
    /// Most objects an operator command's listing of one folder may hold
    /// (`fleet ls`, `fsck`, `gc`, `pull` of every key): a listing past it
    /// fails (`remote.listing_incomplete`), it is never cut short.
    pub list_cap: usize,
    /// Store options applied over the environment's (`aws_endpoint`, …):
    /// for callers that configure a remote in code rather than by `AWS_*`.
    pub options: Vec<(String, String)>,
}

fn env_number(name: &str) -> Result<Option<f64>> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => match v.trim().parse::<f64>() {
            Ok(n) if n.is_finite() && n > 0.0 => Ok(Some(n)),
            _ => Err(Error::new(
                Code::RemoteConfigInvalid,
                format!("{name}={v:?} is not a positive number"),
            )),
        },
        _ => Ok(None),
    }
}

impl RemoteConfig {
    /// Defaults for `url`: 5 s metadata timeout, 4 MiB/s minimum rate, a 60 s
    /// lease and a 15 min wait.
    pub fn new(url: &str) -> Result<RemoteConfig> {
        let url = url.trim();
        let scheme_ok = ["s3://", "s3a://", "gs://", "az://", "abfs://", "abfss://"]
            .iter()
            .any(|s| url.starts_with(s));
        if !scheme_ok || url.contains(['?', '#']) {
            return Err(Error::new(
                Code::RemoteConfigInvalid,
                format!("remote {url:?} is not an s3://bucket/prefix URL (or gs://, az://)"),
            ));
        }
        Ok(RemoteConfig {
            url: url.trim_end_matches('/').to_string(),
            timeout: Duration::from_secs(5),
            min_rate: 4 << 20,
            lease_ttl: Duration::from_secs(60),
            wait: Duration::from_secs(900),
            list_cap: DEFAULT_LIST_CAP,
            options: Vec::new(),
        })
    }

    /// [`RemoteConfig::new`] with the `TORCH_COMPILED_GRAPHS_REMOTE_*`
    /// overrides from the environment.
    pub fn from_env(url: &str) -> Result<RemoteConfig> {
        let mut c = RemoteConfig::new(url)?;
        if let Some(s) = env_number(TIMEOUT_ENV)? {
            c.timeout = Duration::from_secs_f64(s);
        }
        if let Some(r) = env_number(MIN_RATE_ENV)? {
            c.min_rate = r as u64;
        }
        if let Some(s) = env_number(LEASE_TTL_ENV)? {
            c.lease_ttl = Duration::from_secs_f64(s.max(1.0));
        }
        if let Some(s) = env_number(WAIT_ENV)? {
            c.wait = Duration::from_secs_f64(s);
        }
        if let Some(n) = env_number(LIST_CAP_ENV)? {
            c.list_cap = (n as usize).max(1);
        }
        Ok(c)
    }

    /// The remote named by `TORCH_COMPILED_GRAPHS_REMOTE`, if set.
    pub fn env_url() -> Option<String> {
        std::env::var(REMOTE_ENV)
            .ok()
            .filter(|v| !v.trim().is_empty())
    }

    /// The bound of an operator command's listing of one folder, in all
    /// (every page): [`OPERATOR_LIST_TIMEOUTS`] metadata timeouts. A
    /// listing on the resolve path is bounded by the metadata timeout.
    pub fn list_timeout(&self) -> Duration {
        self.timeout * OPERATOR_LIST_TIMEOUTS
    }

    /// The bound of a data request of `len` bytes.
    pub fn data_timeout(&self, len: u64) -> Duration {
        self.timeout + Duration::from_secs_f64(len as f64 / self.min_rate.max(1) as f64)
    }
}
