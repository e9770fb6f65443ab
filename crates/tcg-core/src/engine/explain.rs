//! Explaining a miss: the stored neighbours of a requested key and how they
//! differ, fact by fact (the diff itself is `identity::diff_facts`).
//!
//! Two kinds of data are read: the stored metadata of each graph (which holds
//! every fact that made its key) and the canonical lines kept at mint time
//! under their own ref namespace,
//! `torch-compiled-graphs/v1/witness-lines/<key>` (an object ref; derived
//! data, never part of the envelope or the metadata, so artifacts stay
//! byte-compatible with 0.2.0 both ways). Both are read through the store's
//! verified reads. The scan is bounded by [`EXPLAIN_SCAN_MAX`] graph refs.

use std::io::Read;

use tcg_cas::{CasOutcome, Lease, Target, GRAPH_REF_PREFIX};
use tcg_cj::{Map, Value};

use super::{admitted_ref, check_key, graph_ref, store_err, Engine};
use crate::artifact::{
    read_metadata_member, validate_metadata, Metadata, MAX_METADATA_BYTES, METADATA_MEMBER,
};
use crate::identity::{
    diff_facts, differing_axes, graph_witness, toolchain_axis, KeyFacts, WitnessLines,
    WITNESS_LINES_MAX_BYTES,
};
use crate::Result;

/// Prefix of the refs that keep a graph's canonical lines (derived data).
pub const WITNESS_LINES_REF_PREFIX: &str = "torch-compiled-graphs/v1/witness-lines/";
/// Most graph refs one explanation reads the metadata of.
pub const EXPLAIN_SCAN_MAX: usize = 4096;
/// Neighbours reported by default.
pub const EXPLAIN_NEIGHBOURS: usize = 3;

/// Largest stored canonical-lines object: the lines cap plus JSON framing
/// (each line may grow by escaping, at most six bytes per byte).
const LINES_OBJECT_MAX: u64 = (WITNESS_LINES_MAX_BYTES as u64) * 6 + 65_536;

/// The canonical-lines ref of a key.
pub fn witness_lines_ref(key: &str) -> String {
    format!("{WITNESS_LINES_REF_PREFIX}{key}")
}

fn facts_of(md: &Metadata, lines: Option<WitnessLines>) -> KeyFacts {
    KeyFacts {
        key: md.key().to_string(),
        declaration: md.declaration().clone(),
        sm: md.sm().to_string(),
        toolchain: md.toolchain().clone(),
        lines,
    }
}

fn read_bounded(mut r: impl Read, max: u64) -> Option<Vec<u8>> {
    let mut bytes = Vec::new();
    r.by_ref().take(max + 1).read_to_end(&mut bytes).ok()?;
    (bytes.len() as u64 <= max).then_some(bytes)
}

impl Engine {
    /// Keep the canonical lines behind `witness` for `key`, bounded by the
    /// identity caps. Lines that do not hash to `witness` are not kept.
    /// Best effort for callers: the lines only serve explanations.
    pub fn record_witness_lines(&self, key: &str, witness: &str, lines: &[String]) -> Result<bool> {
        check_key(key)?;
        if graph_witness(lines) != witness {
            return Ok(false);
        }
        let kept = WitnessLines::bounded(lines);
        let bytes = kept.to_bytes(witness, lines.len());
        let lease = self.store.lease().map_err(store_err)?;
        let digest = self.store.put_bytes(&lease, &bytes).map_err(store_err)?;
        let name = witness_lines_ref(key);
        let desired = Target::object(digest);
        loop {
            let current = self.store.get_ref(&name).map_err(store_err)?;
            match self
                .store
                .compare_and_swap(&name, current.as_ref(), Some(&desired))
                .map_err(store_err)?
            {
                CasOutcome::Matched | CasOutcome::AlreadyEqual => break,
                CasOutcome::Conflict(_) => continue,
            }
        }
        lease.end().map_err(store_err)?;
        Ok(true)
    }

    /// The kept canonical lines of `key`, checked against `witness`; `None`
    /// when none were kept (an artifact imported or minted without them) or
    /// what is kept does not hold.
    fn witness_lines(&self, lease: &Lease, key: &str, witness: &str) -> Option<WitnessLines> {
        let target = self.store.get_ref(&witness_lines_ref(key)).ok()??;
        let bytes = self
            .store
            .read_object(lease, &target.digest, LINES_OBJECT_MAX)
            .ok()?;
        WitnessLines::from_bytes(&bytes, witness)
    }

    /// The validated metadata of the record serving `key`: from its admitted
    /// copy when there is one, else from the envelope's first member. `None`
    /// when absent or unreadable (explaining never quarantines).
    fn stored_metadata(&self, lease: &Lease, key: &str) -> Result<Option<Metadata>> {
        let Some(target) = self.store.get_ref(&graph_ref(key)).map_err(store_err)? else {
            return Ok(None);
        };
        let admitted = admitted_ref(key, &target.digest, METADATA_MEMBER);
        let from_copy = match self.store.get_ref(&admitted) {
            Ok(Some(t)) => self
                .store
                .open_file(lease, &t.digest, true)
                .ok()
                .and_then(|r| read_bounded(r, MAX_METADATA_BYTES)),
            _ => None,
        };
        let bytes = match from_copy {
            Some(b) => Some(b),
            None => self
                .store
                .open_file(lease, &target.digest, true)
                .ok()
                .and_then(|r| read_metadata_member(r).ok()),
        };
        Ok(bytes
            .and_then(|b| validate_metadata(&b, None).ok())
            .filter(|md| md.key() == key))
    }

    /// The recorded facts of a stored key, with its kept canonical lines.
    pub fn stored_facts(&self, key: &str) -> Result<Option<KeyFacts>> {
        check_key(key)?;
        let lease = self.store.lease().map_err(store_err)?;
        let facts = self.stored_metadata(&lease, key)?.map(|md| {
            let lines = self.witness_lines(&lease, key, md.declaration().graph_witness());
            facts_of(&md, lines)
        });
        lease.end().map_err(store_err)?;
        Ok(facts)
    }

    /// Every stored entry of graph class `name` (bounded scan): the facts,
    /// how many refs were read and whether the scan stopped at its cap.
    fn scan_class(&self, name: &str) -> Result<(Vec<KeyFacts>, usize, bool)> {
        let listing = self.store.list_refs(GRAPH_REF_PREFIX).map_err(store_err)?;
        let truncated = listing.entries.len() > EXPLAIN_SCAN_MAX;
        let lease = self.store.lease().map_err(store_err)?;
        let mut found = Vec::new();
        let mut scanned = 0;
        for entry in listing.entries.iter().take(EXPLAIN_SCAN_MAX) {
            scanned += 1;
            let key = &entry.name[GRAPH_REF_PREFIX.len()..];
            if check_key(key).is_err() {
                continue;
            }
            if let Some(md) = self.stored_metadata(&lease, key)? {
                if md.name() == name {
                    let lines = self.witness_lines(&lease, key, md.declaration().graph_witness());
                    found.push(facts_of(&md, lines));
                }
            }
        }
        lease.end().map_err(store_err)?;
        Ok((found, scanned, truncated))
    }

    fn presence(&self, key: &str) -> Result<(bool, bool)> {
        match self.store.get_ref(&graph_ref(key)).map_err(store_err)? {
            Some(t) => Ok((true, self.quarantine_marker(key, &t.digest)?.is_some())),
            None => Ok((false, false)),
        }
    }

    /// Whether the remote tier has a ref for `key`, for `explain`: `null`
    /// without a remote; `{"state": "present", "manifest": <64 hex>}`,
    /// `{"state": "absent"}`, or `{"state": "unknown", "reason": …}` when the
    /// remote cannot be asked (never an error: the remote is advisory here).
    pub fn remote_presence(&self, key: &str) -> Value {
        let Some(remote) = self.remote.as_ref() else {
            return Value::Null;
        };
        let mut m = Map::new();
        match remote.has_ref(key) {
            Ok(Some(d)) => {
                m.insert("state".into(), "present".into());
                m.insert("manifest".into(), d.to_hex().into());
            }
            Ok(None) => {
                m.insert("state".into(), "absent".into());
            }
            Err(e) => {
                m.insert("state".into(), "unknown".into());
                m.insert("reason".into(), e.to_string().into());
            }
        }
        Value::Object(m)
    }

    /// Explain `requested`: whether its key is stored here (and, with a
    /// remote tier, whether the remote has a ref for it), and the nearest
    /// stored entries of the same graph class name (at most `limit`), each
    /// with the axes and facts that differ. Nearest means fewest differing
    /// axes, then fewest differing facts, then key order.
    pub fn explain(&self, requested: &KeyFacts, limit: usize) -> Result<Value> {
        self.explain_report(requested, limit, true)
    }

    fn explain_report(
        &self,
        requested: &KeyFacts,
        limit: usize,
        ask_remote: bool,
    ) -> Result<Value> {
        check_key(&requested.key)?;
        let (present, quarantined) = self.presence(&requested.key)?;
        let (entries, scanned, truncated) = self.scan_class(requested.declaration.name())?;
        let mut neighbours: Vec<(usize, usize, Value)> = entries
            .iter()
            .filter(|e| e.key != requested.key)
            .map(|stored| {
                let diffs = diff_facts(requested, stored);
                let axes = differing_axes(&diffs);
                let (na, nd) = (axes.len(), diffs.len());
                (na, nd, neighbour_value(stored, &axes, &diffs))
            })
            .collect();
        // Stable: ties keep the listing order (key order).
        neighbours.sort_by_key(|n| (n.0, n.1));
        neighbours.truncate(limit);
        let mut m = Map::new();
        m.insert("key".into(), requested.key.as_str().into());
        m.insert("graph_class".into(), requested.declaration.name().into());
        m.insert("axes".into(), axes_value(requested));
        m.insert("present".into(), Value::Bool(present));
        m.insert("quarantined".into(), Value::Bool(quarantined));
        let remote = if ask_remote {
            self.remote_presence(&requested.key)
        } else {
            Value::Null
        };
        m.insert("remote".into(), remote);
        m.insert(
            "neighbours".into(),
            Value::Array(neighbours.into_iter().map(|(_, _, v)| v).collect()),
        );
        m.insert("scanned".into(), Value::Int(scanned as i64));
        m.insert("scan_truncated".into(), Value::Bool(truncated));
        Ok(Value::Object(m))
    }

    /// Explain a stored key against the other stored entries of its class.
    /// `None` when the key is not stored (or its record is unreadable). The
    /// remote is not asked (`remote` is null): this runs after a mint, whose
    /// `ensure` has just consulted and published to it.
    pub fn explain_stored(&self, key: &str, limit: usize) -> Result<Option<Value>> {
        match self.stored_facts(key)? {
            Some(facts) => self.explain_report(&facts, limit, false).map(Some),
            None => Ok(None),
        }
    }

    /// Diff two stored keys, `a` in the requested role. `Err(key)` names a
    /// key that is not stored.
    pub fn explain_keys(&self, a: &str, b: &str) -> Result<std::result::Result<Value, String>> {
        let Some(fa) = self.stored_facts(a)? else {
            return Ok(Err(a.to_string()));
        };
        let Some(fb) = self.stored_facts(b)? else {
            return Ok(Err(b.to_string()));
        };
        Ok(Ok(pair_report(&fa, &fb)))
    }

    /// What is stored for graph class `name`: every entry (key order), each
    /// after the first diffed against the first.
    pub fn explain_class(&self, name: &str) -> Result<Value> {
        let (mut entries, scanned, truncated) = self.scan_class(name)?;
        entries.sort_by(|a, b| a.key.cmp(&b.key));
        let rows: Vec<Value> = entries
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let mut row = match entry_value(e) {
                    Value::Object(m) => m,
                    _ => unreachable!("entry_value is an object"),
                };
                if i > 0 {
                    let diffs = diff_facts(e, &entries[0]);
                    row.insert("against".into(), entries[0].key.as_str().into());
                    row.insert(
                        "differing_axes".into(),
                        Value::Array(
                            differing_axes(&diffs)
                                .into_iter()
                                .map(Value::from)
                                .collect(),
                        ),
                    );
                    row.insert(
                        "differences".into(),
                        Value::Array(diffs.iter().map(|d| d.to_value()).collect()),
                    );
                }
                Value::Object(row)
            })
            .collect();
        let mut m = Map::new();
        m.insert("graph_class".into(), name.into());
        m.insert("entries".into(), Value::Array(rows));
        m.insert("scanned".into(), Value::Int(scanned as i64));
        m.insert("scan_truncated".into(), Value::Bool(truncated));
        Ok(Value::Object(m))
    }

    /// Drop canonical-lines refs whose key is no longer stored (GC).
    pub(crate) fn drop_stale_witness_lines(&self) -> Result<u64> {
        let listing = self
            .store
            .list_refs(WITNESS_LINES_REF_PREFIX)
            .map_err(store_err)?;
        let mut dropped = 0;
        for entry in listing.entries {
            let key = &entry.name[WITNESS_LINES_REF_PREFIX.len()..];
            if self
                .store
                .get_ref(&graph_ref(key))
                .map_err(store_err)?
                .is_none()
                && self
                    .store
                    .compare_and_swap(&entry.name, Some(&entry.target), None)
                    .map_err(store_err)?
                    == CasOutcome::Matched
            {
                dropped += 1;
            }
        }
        Ok(dropped)
    }
}

fn axes_value(f: &KeyFacts) -> Value {
    let mut m = Map::new();
    m.insert("graph".into(), f.declaration.class_hash().into());
    m.insert("sm".into(), f.sm.as_str().into());
    m.insert("toolchain".into(), toolchain_axis(&f.toolchain).into());
    Value::Object(m)
}

/// The report of two keys' facts, `a` in the requested role: each side's
/// entry, the differing axes and every difference (what `explain KEY_A
/// KEY_B` prints through [`crate::engine::render_pair`]).
pub fn pair_report(a: &KeyFacts, b: &KeyFacts) -> Value {
    let diffs = diff_facts(a, b);
    let mut m = Map::new();
    m.insert("a".into(), entry_value(a));
    m.insert("b".into(), entry_value(b));
    m.insert(
        "differing_axes".into(),
        Value::Array(
            differing_axes(&diffs)
                .into_iter()
                .map(Value::from)
                .collect(),
        ),
    );
    m.insert(
        "differences".into(),
        Value::Array(diffs.iter().map(|d| d.to_value()).collect()),
    );
    Value::Object(m)
}

fn entry_value(f: &KeyFacts) -> Value {
    let mut m = Map::new();
    m.insert("key".into(), f.key.as_str().into());
    m.insert("axes".into(), axes_value(f));
    m.insert("lines_kept".into(), Value::Bool(f.lines.is_some()));
    Value::Object(m)
}

fn neighbour_value(
    stored: &KeyFacts,
    axes: &[&'static str],
    diffs: &[crate::identity::Difference],
) -> Value {
    let mut m = match entry_value(stored) {
        Value::Object(m) => m,
        _ => unreachable!("entry_value is an object"),
    };
    m.insert(
        "differing_axes".into(),
        Value::Array(axes.iter().map(|a| Value::from(*a)).collect()),
    );
    m.insert(
        "differences".into(),
        Value::Array(diffs.iter().map(|d| d.to_value()).collect()),
    );
    m.into()
}
