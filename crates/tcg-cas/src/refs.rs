//! Refs and compare-and-swap (SPEC-v1 §9.4).

use std::fs::{self, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use tcg_cj::{Map, Value};

use crate::digest::name_hash;
use crate::error::{io_err, Result, StoreError};
use crate::fsutil;
use crate::{Digest, Store};

/// Ref records longer than this are refused.
const MAX_REF_RECORD_BYTES: u64 = 64 * 1024;
/// Ref names longer than this are refused.
pub const MAX_REF_NAME_BYTES: usize = 4096;

/// Whether GC expands a ref's target as a manifest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RefKind {
    /// The target is a manifest; its chunks are roots too.
    Manifest,
    /// The target is a plain object.
    Object,
}

impl RefKind {
    /// The record's `kind` string.
    pub fn as_str(self) -> &'static str {
        match self {
            RefKind::Manifest => "manifest",
            RefKind::Object => "object",
        }
    }
}

/// What a ref points at: a kind and a digest. Targets are equal only when both are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Target {
    /// How GC expands it.
    pub kind: RefKind,
    /// The target object.
    pub digest: Digest,
}

impl Target {
    /// A `manifest`-kind target.
    pub fn manifest(digest: Digest) -> Target {
        Target {
            kind: RefKind::Manifest,
            digest,
        }
    }

    /// An `object`-kind target.
    pub fn object(digest: Digest) -> Target {
        Target {
            kind: RefKind::Object,
            digest,
        }
    }
}

/// The result of [`Store::compare_and_swap`]. `AlreadyEqual` is not success:
/// someone else made the change (SPEC-v1 §14 pitfall 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CasOutcome {
    /// The ref equalled `expected` and now equals `desired`.
    Matched,
    /// The ref differed from `expected` but already equalled `desired`; nothing written.
    AlreadyEqual,
    /// Neither; nothing written. Carries the current value.
    Conflict(Option<Target>),
}

/// One ref and its target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefEntry {
    /// The ref name.
    pub name: String,
    /// Its target.
    pub target: Target,
}

/// The result of [`Store::list_refs`]: readable refs sorted by name, plus the
/// record files that could not be read (never silently skipped).
#[derive(Debug, Default)]
pub struct RefListing {
    /// Readable refs under the prefix, by name.
    pub entries: Vec<RefEntry>,
    /// Record files that failed to read (whatever their name), with why.
    pub unreadable: Vec<(PathBuf, StoreError)>,
}

/// Check a ref name: printable ASCII (0x20–0x7e), `/`-separated components,
/// none empty, `.` or `..`, at most [`MAX_REF_NAME_BYTES`] bytes.
pub fn validate_ref_name(name: &str) -> Result<()> {
    let bad = |reason: &str| StoreError::RefInvalid {
        name: name.to_string(),
        reason: reason.to_string(),
    };
    if name.is_empty() {
        return Err(bad("empty name"));
    }
    if name.len() > MAX_REF_NAME_BYTES {
        return Err(bad("name too long"));
    }
    if !name.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
        return Err(bad("name is not printable ascii"));
    }
    for comp in name.split('/') {
        if comp.is_empty() || comp == "." || comp == ".." {
            return Err(bad("empty, '.' or '..' component"));
        }
    }
    Ok(())
}

fn encode_record(name: &str, target: &Target) -> Vec<u8> {
    let mut m = Map::new();
    m.insert("format".into(), Value::Int(1));
    m.insert("kind".into(), Value::Str(target.kind.as_str().into()));
    m.insert("name".into(), Value::Str(name.into()));
    m.insert("target".into(), Value::Str(target.digest.to_prefixed()));
    tcg_cj::to_canonical(&Value::Object(m)).expect("ref records are always encodable")
}

/// Parse a record; `label` names it in errors (the requested name, or the path).
fn parse_record(bytes: &[u8], label: &str, file_hash: &str) -> Result<(String, Target)> {
    let bad = |reason: &str| StoreError::RefInvalid {
        name: label.to_string(),
        reason: reason.to_string(),
    };
    let value = tcg_cj::parse_strict(bytes).map_err(|e| bad(&e.to_string()))?;
    let obj = value
        .as_object()
        .ok_or_else(|| bad("record is not a json object"))?;
    match obj.get("format") {
        Some(Value::Int(1)) => {}
        Some(Value::Int(f)) => {
            return Err(StoreError::RecordFormatUnsupported {
                digest: file_hash.to_string(),
                format: *f,
            })
        }
        _ => return Err(bad("record format is not an integer")),
    }
    if tcg_cj::to_canonical(&value).ok().as_deref() != Some(bytes) {
        return Err(bad("record is not canonical json"));
    }
    let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
    if keys != ["format", "kind", "name", "target"] {
        return Err(bad(
            "record members are not exactly format, kind, name, target",
        ));
    }
    let kind = match obj["kind"].as_str() {
        Some("manifest") => RefKind::Manifest,
        Some("object") => RefKind::Object,
        _ => return Err(bad("record kind is not \"manifest\" or \"object\"")),
    };
    let name = obj["name"]
        .as_str()
        .ok_or_else(|| bad("record name is not a string"))?;
    validate_ref_name(name).map_err(|_| bad("record name is not a valid ref name"))?;
    if name_hash(name) != file_hash {
        return Err(bad("record name does not hash to its file name"));
    }
    let digest = obj["target"]
        .as_str()
        .and_then(Digest::from_prefixed)
        .ok_or_else(|| bad("record target is not sha256:<64 hex>"))?;
    Ok((name.to_string(), Target { kind, digest }))
}

impl Store {
    fn ref_path(&self, hash: &str) -> PathBuf {
        self.dir("refs").join(hash)
    }

    /// Read a record file; `Ok(None)` when absent.
    pub(crate) fn read_ref_file(
        &self,
        path: &Path,
        label: &str,
    ) -> Result<Option<(String, Target)>> {
        let hash = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let opened = fsutil::open_regular(path).map_err(|e| match e {
            StoreError::NotRegularFile { found, .. } => StoreError::RefInvalid {
                name: label.to_string(),
                reason: format!("record is a {found}, not a regular file"),
            },
            e => e,
        })?;
        let Some((mut f, md)) = opened else {
            return Ok(None);
        };
        if md.len() > MAX_REF_RECORD_BYTES {
            return Err(StoreError::RefInvalid {
                name: label.to_string(),
                reason: "record too large".into(),
            });
        }
        let mut bytes = Vec::new();
        (&mut f)
            .take(MAX_REF_RECORD_BYTES)
            .read_to_end(&mut bytes)
            .map_err(io_err("read", path))?;
        parse_record(&bytes, label, &hash).map(Some)
    }

    /// The current target of ref `name`, or `None`. A record whose `name`
    /// differs, or that breaks any rule, is `store.ref_invalid`.
    pub fn get_ref(&self, name: &str) -> Result<Option<Target>> {
        validate_ref_name(name)?;
        let got = self.read_ref_file(&self.ref_path(&name_hash(name)), name)?;
        match got {
            None => Ok(None),
            Some((n, _)) if n != name => Err(StoreError::RefInvalid {
                name: name.to_string(),
                reason: format!("record names {n:?}"),
            }),
            Some((_, t)) => Ok(Some(t)),
        }
    }

    /// Compare-and-swap ref `name` from `expected` to `desired` (each a target
    /// or absent) under the shared store lock and the ref's stripe lock.
    /// Setting requires the target's closure to be present
    /// (`store.closure_missing`): pin it in a lease first.
    pub fn compare_and_swap(
        &self,
        name: &str,
        expected: Option<&Target>,
        desired: Option<&Target>,
    ) -> Result<CasOutcome> {
        validate_ref_name(name)?;
        let hash = name_hash(name);
        let _shared = self.shared_lock()?;
        let _stripe = self.ref_stripe(&hash)?;
        let current = self.get_ref(name)?;
        if current.as_ref() != expected {
            if current.as_ref() == desired {
                return Ok(CasOutcome::AlreadyEqual);
            }
            return Ok(CasOutcome::Conflict(current));
        }
        if current.as_ref() == desired {
            return Ok(CasOutcome::Matched);
        }
        match desired {
            Some(t) => {
                self.check_closure(name, t)?;
                self.write_ref_locked(name, &hash, t)?;
            }
            None => self.delete_ref_locked(&hash)?,
        }
        self.bump_ref_generation()?;
        Ok(CasOutcome::Matched)
    }

    /// Pin the closure of ref `name` in `lease` so that it stays readable: pin
    /// the target (and, for a manifest, its chunks), then re-read the ref and
    /// retry if it moved meanwhile. When this returns `Some(t)`, `t`'s closure
    /// cannot be collected while the lease lives. A manifest that does not load
    /// is reported with its typed error (after the same re-check).
    pub fn pin_ref(&self, lease: &crate::Lease, name: &str) -> Result<Option<Target>> {
        loop {
            let Some(t) = self.get_ref(name)? else {
                return Ok(None);
            };
            lease.pin(std::slice::from_ref(&t.digest))?;
            let loaded = if t.kind == RefKind::Manifest {
                match self.load_manifest_pinned(&t.digest) {
                    Ok(m) => {
                        let ds: Vec<Digest> = m.chunks.iter().map(|c| c.digest).collect();
                        lease.pin(&ds)
                    }
                    Err(e) => Err(e),
                }
            } else {
                Ok(())
            };
            if self.get_ref(name)? != Some(t) {
                continue;
            }
            return loaded.map(|()| Some(t));
        }
    }

    /// Remove the record of `name` if (and only if) it cannot be read, so that
    /// a corrupt record can be replaced. Returns whether it removed one.
    pub fn remove_unreadable_ref(&self, name: &str) -> Result<bool> {
        validate_ref_name(name)?;
        let hash = name_hash(name);
        let _shared = self.shared_lock()?;
        let _stripe = self.ref_stripe(&hash)?;
        match self.get_ref(name) {
            Ok(_) => Ok(false),
            Err(e @ StoreError::Io { .. }) => Err(e),
            Err(_) => {
                self.delete_ref_locked(&hash)?;
                self.bump_ref_generation()?;
                Ok(true)
            }
        }
    }

    /// Closure check by `lstat` (and manifest load), without rehashing chunks.
    pub(crate) fn check_closure(&self, name: &str, t: &Target) -> Result<()> {
        let missing = |d: &Digest, reason: String| StoreError::ClosureMissing {
            name: name.to_string(),
            digest: d.to_hex(),
            reason,
        };
        match self.object_len(&t.digest) {
            Ok(Some(_)) => {}
            Ok(None) => return Err(missing(&t.digest, "target object is absent".into())),
            Err(e @ StoreError::Io { .. }) => return Err(e),
            Err(e) => return Err(missing(&t.digest, e.to_string())),
        }
        if t.kind == RefKind::Manifest {
            let m = match self.load_manifest_pinned(&t.digest) {
                Ok(m) => m,
                Err(e @ StoreError::Io { .. }) => return Err(e),
                Err(e) => return Err(missing(&t.digest, e.to_string())),
            };
            for c in &m.chunks {
                match self.object_len(&c.digest) {
                    Ok(Some(l)) if l == c.len => {}
                    Ok(Some(l)) => {
                        return Err(missing(
                            &c.digest,
                            format!("chunk has {l} bytes, not {}", c.len),
                        ))
                    }
                    Ok(None) => return Err(missing(&c.digest, "chunk is absent".into())),
                    Err(e @ StoreError::Io { .. }) => return Err(e),
                    Err(e) => return Err(missing(&c.digest, e.to_string())),
                }
            }
        }
        Ok(())
    }

    fn write_ref_locked(&self, name: &str, hash: &str, t: &Target) -> Result<()> {
        let tmp = self.anonymous_temp("ref");
        let res = (|| {
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o644)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&tmp)
                .map_err(io_err("create temp", &tmp))?;
            f.write_all(&encode_record(name, t))
                .map_err(io_err("write", &tmp))?;
            f.sync_all().map_err(io_err("fsync", &tmp))?;
            let dest = self.ref_path(hash);
            fs::rename(&tmp, &dest).map_err(io_err("rename", &dest))?;
            fsutil::fsync_dir(&self.dir("refs"))
        })();
        if res.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        res
    }

    pub(crate) fn delete_ref_locked(&self, hash: &str) -> Result<()> {
        let p = self.ref_path(hash);
        match fs::remove_file(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_err("unlink", &p)(e)),
        }
        let _ = fs::remove_file(self.dir("uses").join(hash));
        fsutil::fsync_dir(&self.dir("refs"))
    }

    /// Every readable ref whose name starts with `prefix`, sorted by name, and
    /// every record that could not be read.
    pub fn list_refs(&self, prefix: &str) -> Result<RefListing> {
        let dir = self.dir("refs");
        let mut out = RefListing::default();
        for e in fs::read_dir(&dir).map_err(io_err("read directory", &dir))? {
            let e = e.map_err(io_err("read directory", &dir))?;
            let path = e.path();
            let label = path.display().to_string();
            match self.read_ref_file(&path, &label) {
                Ok(Some((name, target))) => {
                    if name.starts_with(prefix) {
                        out.entries.push(RefEntry { name, target });
                    }
                }
                Ok(None) => {}
                Err(err) => out.unreadable.push((path, err)),
            }
        }
        out.entries.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// The ref generation: incremented by every ref change (SPEC-v1 §9.7).
    pub fn ref_generation(&self) -> Result<u64> {
        let lock = fsutil::lock_path(&self.dir("locks/ref-generation"), false)?;
        read_u64(&lock.file, &self.dir("locks/ref-generation"))
    }

    pub(crate) fn bump_ref_generation(&self) -> Result<u64> {
        let path = self.dir("locks/ref-generation");
        let lock = fsutil::lock_path(&path, true)?;
        let next = read_u64(&lock.file, &path)?.wrapping_add(1);
        lock.file
            .write_all_at(&next.to_le_bytes(), 0)
            .map_err(io_err("write", &path))?;
        Ok(next)
    }

    /// Record that ref `name` was just used (for size-budget eviction, LRU).
    /// Best effort and not fsynced: a small file `uses/<hex64(sha256(name))>`
    /// holding nanoseconds since the epoch. Never a reachability input.
    pub fn record_use(&self, name: &str) -> Result<()> {
        validate_ref_name(name)?;
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let _shared = self.shared_lock()?;
        let tmp = self.anonymous_temp("use");
        let res = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
            .and_then(|mut f| f.write_all(format!("{nanos}\n").as_bytes()))
            .map_err(io_err("write", &tmp))
            .and_then(|()| {
                let dest = self.dir("uses").join(name_hash(name));
                fs::rename(&tmp, &dest).map_err(io_err("rename", &dest))
            });
        if res.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        res
    }

    /// The last recorded use of ref `name` (0 when never recorded).
    pub fn last_use(&self, name: &str) -> u64 {
        self.last_use_by_hash(&name_hash(name))
    }

    pub(crate) fn last_use_by_hash(&self, hash: &str) -> u64 {
        // Never through a symlink, never blocking on a FIFO, never more than a stamp.
        let Ok(Some((f, _))) = fsutil::open_regular(&self.dir("uses").join(hash)) else {
            return 0;
        };
        let mut text = String::new();
        let _ = f.take(64).read_to_string(&mut text);
        text.trim().parse().unwrap_or(0)
    }
}

fn read_u64(f: &fs::File, path: &Path) -> Result<u64> {
    let mut b = [0u8; 8];
    let mut got = 0;
    while got < 8 {
        match f.read_at(&mut b[got..], got as u64) {
            Ok(0) => return Ok(0),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err("read", path)(e)),
        }
    }
    Ok(u64::from_le_bytes(b))
}
