//! Operator views of a store: `ls`, `gc`, `fsck` and `stats`, as JSON reports
//! (the CLI prints them; the bindings hand them to Python as dicts).

use std::fs::OpenOptions;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;

use tcg_cas::{FsckOptions, GcOptions, GRAPH_REF_PREFIX};
use tcg_cj::{Map, Value};

use super::{store_err, Engine};
use crate::artifact::read_metadata_member;
use crate::Result;

/// The engine's event counters, kept in the store so that every process
/// using the store adds to the same totals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    /// A resolve that served an artifact.
    Hit,
    /// A resolve that found nothing servable (absent, unreadable, quarantined).
    Miss,
    /// A mint published by `ensure`.
    Mint,
    /// A quarantine event.
    Quarantine,
    /// A local miss served by fetching from the remote tier.
    RemoteHit,
    /// A local miss the remote tier could not serve either.
    RemoteMiss,
    /// A remote failure (unreachable, refused, bad bytes): a miss and a warning.
    RemoteError,
    /// A mint this store published to the remote first (it created the ref).
    RemotePublished,
    /// Evidence of a bad remote record written under `reports/`.
    RemoteReport,
    /// A remote artifact a trusting worker did not take: the ref's artifact
    /// with no record by an allowed signer, or a candidate the policy refused.
    RemoteTrustRefused,
    /// A remote signature record skipped as malformed or misfiled.
    RemoteSignatureSkipped,
    /// A mint that was published but could not be signed (a warning).
    SigningFailure,
}

// New counters go at the end: a slot is a fixed offset in the stats file.
const COUNTERS: [(Counter, &str); 12] = [
    (Counter::Hit, "hits"),
    (Counter::Miss, "misses"),
    (Counter::Mint, "mints"),
    (Counter::Quarantine, "quarantines"),
    (Counter::RemoteHit, "remote_hits"),
    (Counter::RemoteMiss, "remote_misses"),
    (Counter::RemoteError, "remote_errors"),
    (Counter::RemotePublished, "remote_published"),
    (Counter::RemoteReport, "remote_reports"),
    (Counter::RemoteTrustRefused, "remote_trust_refused"),
    (Counter::RemoteSignatureSkipped, "remote_signatures_skipped"),
    (Counter::SigningFailure, "signing_failures"),
];

fn slot(c: Counter) -> u64 {
    COUNTERS
        .iter()
        .position(|(k, _)| *k == c)
        .expect("every counter has a slot") as u64
}

fn obj(pairs: Vec<(&str, Value)>) -> Value {
    Value::Object(
        pairs
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect::<Map>(),
    )
}

fn int(n: u64) -> Value {
    Value::Int(i64::try_from(n).unwrap_or(i64::MAX))
}

impl Engine {
    fn counters_path(&self) -> std::path::PathBuf {
        self.store.root().join("stats")
    }

    /// Add one to a counter. Best effort: statistics never fail an operation.
    pub(crate) fn count(&self, counter: Counter) {
        let _ = (|| -> std::io::Result<()> {
            // Never through a symlink, never a FIFO, never writable by others.
            let mut f = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                .open(self.counters_path())?;
            let md = f.metadata()?;
            if !md.is_file() || md.mode() & 0o022 != 0 {
                return Err(std::io::Error::from_raw_os_error(libc::EPERM));
            }
            // SAFETY: flock on a valid open descriptor; released when `f` closes.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let at = slot(counter) * 8;
            let mut buf = [0u8; 8];
            f.seek(SeekFrom::Start(at))?;
            let n = f.read(&mut buf)?;
            let value = if n == 8 { u64::from_le_bytes(buf) } else { 0 };
            f.seek(SeekFrom::Start(at))?;
            f.write_all(&(value + 1).to_le_bytes())
        })();
    }

    fn counter_values(&self) -> Vec<(&'static str, u64)> {
        let bytes = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(self.counters_path())
            .ok()
            .filter(|f| f.metadata().is_ok_and(|m| m.is_file()))
            .map(|f| {
                let mut b = Vec::new();
                // Bounded by the slots we know (a hostile file is not read whole).
                let _ = f.take(COUNTERS.len() as u64 * 8).read_to_end(&mut b);
                b
            })
            .unwrap_or_default();
        COUNTERS
            .iter()
            .map(|(c, name)| {
                let at = slot(*c) as usize * 8;
                let v = bytes
                    .get(at..at + 8)
                    .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
                    .unwrap_or(0);
                (*name, v)
            })
            .collect()
    }

    /// Remove admitted copies whose (key, envelope) no longer serves the key,
    /// or whose record is quarantined. Returns how many copies were dropped.
    fn drop_stale_admitted(&self) -> Result<u64> {
        let listing = self
            .store
            .list_refs(super::ADMITTED_REF_PREFIX)
            .map_err(store_err)?;
        let mut dropped = std::collections::BTreeSet::new();
        for entry in listing.entries {
            let rest = &entry.name[super::ADMITTED_REF_PREFIX.len()..];
            let mut parts = rest.splitn(3, '/');
            let (Some(key), Some(m)) = (parts.next(), parts.next()) else {
                continue;
            };
            let Some(m) = tcg_cas::Digest::from_hex(m) else {
                continue;
            };
            // An unreadable graph ref serves nothing: its copies are stale
            // (GC then reports the record itself).
            let current = match self.store.get_ref(&super::graph_ref(key)) {
                Ok(c) => c,
                Err(e @ tcg_cas::StoreError::Io { .. }) => return Err(store_err(e)),
                Err(_) => None,
            };
            let serving = current.is_some_and(|t| t.digest == m)
                && self.quarantine_marker(key, &m)?.is_none();
            if !serving && dropped.insert((key.to_string(), m)) {
                self.drop_admitted(key, &m);
            }
        }
        Ok(dropped.len() as u64)
    }

    /// Every stored key with its graph class, sm, envelope size and last use.
    pub fn list(&self) -> Result<Value> {
        let listing = self.store.list_refs(GRAPH_REF_PREFIX).map_err(store_err)?;
        let lease = self.store.lease().map_err(store_err)?;
        let mut rows = Vec::new();
        for entry in listing.entries {
            let key = entry.name[GRAPH_REF_PREFIX.len()..].to_string();
            let mut row = vec![
                ("key", Value::from(key.as_str())),
                ("manifest", Value::from(entry.target.digest.to_hex())),
                ("last_use_ns", int(self.store.last_use(&entry.name))),
                (
                    "quarantined",
                    Value::Bool(
                        self.quarantine_marker(&key, &entry.target.digest)?
                            .is_some(),
                    ),
                ),
            ];
            match self.store.open_file(&lease, &entry.target.digest, true) {
                Ok(reader) => {
                    row.push(("size", int(reader.manifest().size)));
                    if let Ok(md) = read_metadata_member(reader)
                        .and_then(|b| crate::artifact::validate_metadata(&b, None))
                    {
                        row.push(("graph_class", Value::from(md.name())));
                        row.push(("sm", Value::from(md.sm())));
                        row.push(("class_hash", Value::from(md.declaration().class_hash())));
                    }
                }
                Err(e) => row.push(("error", Value::from(e.to_string()))),
            }
            rows.push(obj(row));
        }
        for (path, err) in listing.unreadable {
            rows.push(obj(vec![
                ("unreadable_ref", Value::from(path.display().to_string())),
                ("error", Value::from(err.to_string())),
            ]));
        }
        lease.end().map_err(store_err)?;
        Ok(Value::Array(rows))
    }

    /// Collect garbage; with `max_bytes`, evict admitted copies first, then
    /// the least recently resolved graph refs, until the store fits.
    pub fn gc(&self, max_bytes: Option<u64>) -> Result<Value> {
        let stale = self.drop_stale_admitted()?;
        let stale_lines = self.drop_stale_witness_lines()?;
        let pass = |prefix: &str| {
            self.store
                .gc(&GcOptions {
                    max_bytes,
                    evict_prefix: prefix.to_string(),
                })
                .map_err(store_err)
        };
        // The admitted copies are derived: under a budget they go before any graph.
        let mut r = pass(super::ADMITTED_REF_PREFIX)?;
        if max_bytes.is_some_and(|budget| r.kept_bytes > budget) {
            let first = r;
            r = pass(GRAPH_REF_PREFIX)?;
            r.freed_objects += first.freed_objects;
            r.freed_bytes += first.freed_bytes;
            // Admitted copies and kept lines of evicted graphs are stale now.
            self.drop_stale_admitted()?;
            self.drop_stale_witness_lines()?;
        }
        let evicted: Vec<Value> = r
            .evicted_refs
            .iter()
            .map(|n| Value::from(n.strip_prefix(GRAPH_REF_PREFIX).unwrap_or(n)))
            .collect();
        Ok(obj(vec![
            ("examined_objects", int(r.examined_objects)),
            ("kept_objects", int(r.kept_objects)),
            ("kept_bytes", int(r.kept_bytes)),
            ("freed_objects", int(r.freed_objects)),
            ("freed_bytes", int(r.freed_bytes)),
            ("evicted_keys", Value::Array(evicted)),
            ("stale_admitted_copies", int(stale)),
            ("stale_witness_lines", int(stale_lines)),
            ("reaped_leases", int(r.reaped_leases)),
            ("reaped_temps", int(r.reaped_temps)),
        ]))
    }

    /// Re-hash every object; with `quarantine`, move corrupt ones aside.
    /// Returns the report and whether the store is clean.
    pub fn fsck(&self, quarantine: bool) -> Result<(Value, bool)> {
        let r = self
            .store
            .fsck(FsckOptions { quarantine })
            .map_err(store_err)?;
        let corrupt: Vec<Value> = r
            .corrupt
            .iter()
            .map(|c| {
                obj(vec![
                    (
                        "digest",
                        c.digest
                            .map(|d| Value::from(d.to_hex()))
                            .unwrap_or(Value::Null),
                    ),
                    ("path", Value::from(c.path.display().to_string())),
                    ("code", Value::from(c.error.code())),
                    ("error", Value::from(c.error.to_string())),
                    (
                        "moved_to",
                        c.moved_to
                            .as_ref()
                            .map(|p| Value::from(p.display().to_string()))
                            .unwrap_or(Value::Null),
                    ),
                ])
            })
            .collect();
        let dangling: Vec<Value> = r
            .dangling_refs
            .iter()
            .map(|d| {
                obj(vec![
                    ("ref", Value::from(d.name.as_str())),
                    ("code", Value::from(d.error.code())),
                    ("error", Value::from(d.error.to_string())),
                ])
            })
            .collect();
        let clean = r.is_clean();
        Ok((
            obj(vec![
                ("objects_checked", int(r.objects_checked)),
                ("bytes_checked", int(r.bytes_checked)),
                ("refs_checked", int(r.refs_checked)),
                ("corrupt", Value::Array(corrupt)),
                ("dangling_refs", Value::Array(dangling)),
                ("clean", Value::Bool(clean)),
            ]),
            clean,
        ))
    }

    /// Counters (hits, misses, mints, quarantines) and the store's size.
    pub fn stats(&self) -> Result<Value> {
        let s = self.store.stats().map_err(store_err)?;
        let keys = self
            .store
            .list_refs(GRAPH_REF_PREFIX)
            .map_err(store_err)?
            .entries
            .len() as u64;
        let mut pairs: Vec<(&str, Value)> = self
            .counter_values()
            .into_iter()
            .map(|(k, v)| (k, int(v)))
            .collect();
        pairs.extend([
            ("keys", int(keys)),
            ("objects", int(s.objects)),
            ("bytes", int(s.object_bytes)),
            ("refs", int(s.refs)),
            ("leases", int(s.leases)),
        ]);
        Ok(obj(pairs))
    }
}
