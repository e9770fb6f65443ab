//! The remote layout and its records (FLEET.md §1, §4): wire identity.

use object_store::path::Path;
use tcg_cas::Digest;
use tcg_cj::{Map, Value};

/// The root of the layout under the configured prefix.
pub const LAYOUT_ROOT: &str = "tcg/v1";
/// Largest ref record accepted from the remote.
pub const MAX_REF_BYTES: u64 = 4096;
/// Largest lease record accepted from the remote.
pub const MAX_LEASE_BYTES: u64 = 4096;
/// Largest manifest accepted from the remote: about 8000 chunks, far more
/// than the largest envelope (13 GB) needs at 64 MiB a chunk.
pub const MAX_MANIFEST_BYTES: u64 = 1 << 20;

/// Object names under one prefix.
#[derive(Debug, Clone)]
pub struct Layout {
    prefix: String,
}

impl Layout {
    /// The layout under `prefix` (no leading or trailing slash; may be empty).
    pub fn new(prefix: &str) -> Layout {
        let prefix = prefix.trim_matches('/');
        Layout {
            prefix: if prefix.is_empty() {
                LAYOUT_ROOT.to_string()
            } else {
                format!("{prefix}/{LAYOUT_ROOT}")
            },
        }
    }

    fn path(&self, rest: &str) -> Path {
        Path::from(format!("{}/{rest}", self.prefix))
    }

    /// `<prefix>/tcg/v1`.
    pub fn root(&self) -> Path {
        Path::from(self.prefix.as_str())
    }

    /// `chunks/sha256/<h0h1>/<64 hex>`.
    pub fn chunk(&self, d: &Digest) -> Path {
        let h = d.to_hex();
        self.path(&format!("chunks/sha256/{}/{h}", &h[..2]))
    }

    /// `manifests/sha256/<64 hex>`.
    pub fn manifest(&self, d: &Digest) -> Path {
        self.path(&format!("manifests/sha256/{}", d.to_hex()))
    }

    /// `refs/<cg-key>`.
    pub fn graph_ref(&self, key: &str) -> Path {
        self.path(&format!("refs/{key}"))
    }

    /// `leases/<cg-key>`.
    pub fn lease(&self, key: &str) -> Path {
        self.path(&format!("leases/{key}"))
    }

    /// `reports/<cg-key>/<manifest 64 hex>/<32 hex>`.
    pub fn report(&self, key: &str, manifest: &str, id: &str) -> Path {
        self.path(&format!("reports/{key}/{manifest}/{id}"))
    }

    /// A folder of the layout (`refs`, `chunks`, `manifests`, `reports`, `leases`, `doctor`).
    pub fn folder(&self, name: &str) -> Path {
        self.path(name)
    }
}

/// The ref record (FLEET.md §1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefRecord {
    /// The key it commits.
    pub key: String,
    /// The manifest of the envelope.
    pub manifest: Digest,
    /// Who wrote it (operators only).
    pub producer: String,
    /// When, unix seconds (operators only).
    pub created: i64,
}

impl RefRecord {
    /// CJ bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut m = Map::new();
        m.insert("created".into(), Value::Int(self.created));
        m.insert("format".into(), Value::Int(1));
        m.insert("key".into(), self.key.as_str().into());
        m.insert("manifest".into(), self.manifest.to_prefixed().into());
        m.insert("producer".into(), self.producer.as_str().into());
        tcg_cj::to_canonical(&Value::Object(m)).expect("a ref record is plain values")
    }

    /// Parse strictly: canonical JSON, exactly the five members, format 1.
    pub fn parse(bytes: &[u8]) -> std::result::Result<RefRecord, String> {
        let v = tcg_cj::parse_strict(bytes).map_err(|e| format!("ref is not json: {e}"))?;
        if tcg_cj::to_canonical(&v).ok().as_deref() != Some(bytes) {
            return Err("ref is not canonical json".into());
        }
        let o = v.as_object().ok_or("ref is not an object")?;
        let keys: Vec<&str> = o.keys().map(String::as_str).collect();
        if keys != ["created", "format", "key", "manifest", "producer"] {
            return Err(
                "ref members are not exactly created, format, key, manifest, producer".into(),
            );
        }
        if o["format"] != Value::Int(1) {
            return Err("ref format is not 1".into());
        }
        let key = o["key"].as_str().ok_or("ref key is not a string")?;
        let manifest = o["manifest"]
            .as_str()
            .and_then(Digest::from_prefixed)
            .ok_or("ref manifest is not sha256:<64 hex>")?;
        let producer = o["producer"]
            .as_str()
            .ok_or("ref producer is not a string")?;
        let Value::Int(created) = o["created"] else {
            return Err("ref created is not an integer".into());
        };
        Ok(RefRecord {
            key: key.to_string(),
            manifest,
            producer: producer.to_string(),
            created,
        })
    }
}

/// The lease record (FLEET.md §4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRecord {
    /// Random 32 hex naming the holder.
    pub holder: String,
    /// The holder's host name (operators only).
    pub host: String,
    /// Time to live in seconds after the server's last_modified.
    pub ttl_s: i64,
}

impl LeaseRecord {
    /// CJ bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut m = Map::new();
        m.insert("format".into(), Value::Int(1));
        m.insert("holder".into(), self.holder.as_str().into());
        m.insert("host".into(), self.host.as_str().into());
        m.insert("ttl_s".into(), Value::Int(self.ttl_s));
        tcg_cj::to_canonical(&Value::Object(m)).expect("a lease record is plain values")
    }

    /// Parse; an unreadable lease counts as expired (it guards nothing).
    pub fn parse(bytes: &[u8]) -> Option<LeaseRecord> {
        let v = tcg_cj::parse_strict(bytes).ok()?;
        let o = v.as_object()?;
        if o.get("format") != Some(&Value::Int(1)) {
            return None;
        }
        let Some(Value::Int(ttl_s)) = o.get("ttl_s") else {
            return None;
        };
        Some(LeaseRecord {
            holder: o.get("holder")?.as_str()?.to_string(),
            host: o.get("host")?.as_str()?.to_string(),
            ttl_s: (*ttl_s).clamp(1, 86_400),
        })
    }
}

/// 16 random bytes in hex.
pub fn random_hex32() -> String {
    let mut bytes = [0u8; 16];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        let _ = std::io::Read::read_exact(&mut f, &mut bytes);
    }
    hex::encode(bytes)
}

/// This host's name, for operators.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// Unix seconds now (operators only: never used for expiry).
pub fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}
