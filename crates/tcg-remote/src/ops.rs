//! Operator commands over a remote: `push`, `pull`, `fleet ls`, `fleet
//! fsck`, `fleet gc --grace`, `fleet repair` (FLEET.md §5, §6). Every
//! report is JSON; the CLI prints it.

use std::collections::BTreeSet;
use std::time::Duration;

use bytes::Bytes;
use tcg_cas::Digest;
use tcg_cj::{Map, Value};
use tcg_core::engine::{graph_ref, store_err, Engine, RemoteError, StoreOutcome};
use tcg_core::{Code, Error, Result};

use crate::client::Fail;
use crate::fetch::{read_manifest, read_ref};
use crate::layout::{host_name, unix_now, RefRecord};
use crate::Remote;

/// The default of the most objects one operator listing may hold
/// ([`crate::RemoteConfig::list_cap`]; bounded memory on a hostile bucket).
pub const MAX_LIST: usize = crate::config::DEFAULT_LIST_CAP;

fn obj(pairs: Vec<(&str, Value)>) -> Value {
    Value::Object(
        pairs
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect::<Map>(),
    )
}

fn unavailable(what: &str, f: impl std::fmt::Display) -> Error {
    Error::new(Code::RemoteUnavailable, format!("{what}: {f}"))
}

fn remote_err(e: RemoteError) -> Error {
    match e {
        RemoteError::Unavailable(m) => Error::new(Code::RemoteUnavailable, m),
        RemoteError::Bad { why, .. } => Error::new(Code::RemoteRecordInvalid, why),
    }
}

/// The error of an operator command whose listing of `folder` failed:
/// `remote.listing_incomplete` when it could not be completed (too many
/// names, or a page claiming more without a token), `remote.unavailable`
/// otherwise. Either way nothing that depends on it was done.
pub fn listing_failed(command: &str, folder: &str, f: Fail) -> Error {
    match f {
        Fail::Incomplete(why) => Error::new(
            Code::RemoteListingIncomplete,
            format!(
                "{command}: the listing of {folder}/ is incomplete ({why}); nothing was changed. \
                 Delete junk names (fleet fsck lists them) or raise {} and run it again",
                crate::config::LIST_CAP_ENV
            ),
        ),
        f => Error::new(
            Code::RemoteUnavailable,
            format!("{command}: listing {folder}/ failed: {f}; nothing was changed"),
        ),
    }
}

/// One skipped listing entry as a report row (`{"name", "error"}`).
pub fn skipped_row(e: &crate::guard::SkippedEntry) -> Value {
    obj(vec![
        ("name", e.name.as_str().into()),
        ("error", e.why.as_str().into()),
    ])
}

/// Every key the remote has a ref for (from the listing of `refs/`, to its
/// end), and the names under `refs/` that are not a key's ref (unparseable
/// names, nested names, names that are not keys): skipped, each with why.
pub fn keys_listed(
    remote: &Remote,
    command: &str,
) -> Result<(Vec<String>, Vec<crate::guard::SkippedEntry>)> {
    let client = remote.client()?;
    let folder = remote.layout().folder("refs");
    let listed = client
        .list_all(&folder)
        .map_err(|f| listing_failed(command, "refs", f))?;
    let mut skipped = listed.skipped;
    let root = format!("{folder}/");
    let mut keys = Vec::new();
    for m in listed.objects {
        let name = m.location.to_string();
        let key = name.strip_prefix(&root).unwrap_or(&name);
        if key.contains('/') || tcg_core::engine::check_key(key).is_err() {
            skipped.push(crate::guard::SkippedEntry {
                name: name
                    .chars()
                    .take(crate::guard::MAX_SKIPPED_NAME_CHARS)
                    .collect(),
                why: "not the ref of a key (refs/<cg-key>)".into(),
            });
            continue;
        }
        keys.push(key.to_string());
    }
    Ok((keys, skipped))
}

/// Every key the remote has a ref for ([`keys_listed`]); each skipped name
/// is a warning.
pub fn keys(remote: &Remote) -> Result<Vec<String>> {
    let (keys, skipped) = keys_listed(remote, "fleet")?;
    for e in &skipped {
        tcg_core::engine::remote_warn(format_args!("refs: skipped {e}"));
    }
    Ok(keys)
}

/// Publish the local records of `keys` to the remote; `progress` is called
/// after each key.
pub fn push(
    engine: &Engine,
    remote: &Remote,
    keys: &[String],
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Value> {
    let client = remote.client()?;
    let mut rows = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        tcg_core::engine::check_key(key)?;
        let row = match engine.store().get_ref(&graph_ref(key)).map_err(store_err)? {
            None => obj(vec![
                ("key", key.as_str().into()),
                ("outcome", "ABSENT".into()),
            ]),
            Some(t) => {
                match crate::publish::publish(
                    client,
                    remote.layout(),
                    engine.store(),
                    key,
                    &t.digest,
                ) {
                    Ok((p, uploaded)) => {
                        let signed = crate::signatures::push_records(engine, remote, key)?;
                        obj(vec![
                            ("key", key.as_str().into()),
                            ("outcome", p.outcome.as_str().into()),
                            ("manifest", p.manifest.into()),
                            ("uploaded_bytes", Value::Int(uploaded as i64)),
                            ("signatures", Value::Int(signed as i64)),
                        ])
                    }
                    Err(e) => obj(vec![
                        ("key", key.as_str().into()),
                        ("outcome", "ERROR".into()),
                        ("error", e.to_string().into()),
                    ]),
                }
            }
        };
        rows.push(row);
        progress(i + 1, keys.len());
    }
    Ok(Value::Array(rows))
}

/// Prefetch `keys` into the local store (verified like any fetch), with
/// their admitted copies when `admitted_copy` (otherwise each key's first
/// resolve records it).
pub fn pull(
    engine: &Engine,
    keys: &[String],
    admitted_copy: bool,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Value> {
    let mut rows = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let pulled = engine.pull_key(key, admitted_copy)?;
        let mut row = vec![
            ("key", key.as_str().into()),
            (
                "source",
                pulled
                    .source
                    .map(|s| Value::from(s.as_str()))
                    .unwrap_or(Value::Null),
            ),
            ("signatures", Value::Int(pulled.signatures as i64)),
        ];
        if let Some(e) = pulled.refused {
            row.push(("refused", e.code().as_str().into()));
            row.push(("error", e.message().into()));
        }
        rows.push(obj(row));
        progress(i + 1, keys.len());
    }
    Ok(Value::Array(rows))
}

/// The remote's refs with their manifests.
pub fn ls(remote: &Remote) -> Result<Value> {
    let client = remote.client()?;
    let mut rows = Vec::new();
    for key in keys(remote)? {
        let row = match read_ref(client, remote.layout(), &key) {
            Ok(Some(r)) => obj(vec![
                ("key", key.as_str().into()),
                ("manifest", r.manifest.to_hex().into()),
                ("producer", r.producer.into()),
                ("created", Value::Int(r.created)),
            ]),
            Ok(None) => continue,
            Err(e) => obj(vec![
                ("key", key.as_str().into()),
                ("error", e.to_string().into()),
            ]),
        };
        rows.push(row);
    }
    Ok(Value::Array(rows))
}

/// Check every ref, its manifest and its chunks' presence and sizes; with
/// `deep`, re-hash every chunk. Lists the evidence under `reports/`.
/// Returns the report and whether the remote is clean.
pub fn fsck(remote: &Remote, deep: bool) -> Result<(Value, bool)> {
    let client = remote.client()?;
    let layout = remote.layout();
    let mut bad = Vec::new();
    let mut checked = 0i64;
    let (keys, mut unparseable) = keys_listed(remote, "fleet fsck")?;
    for key in keys {
        checked += 1;
        let problem = (|| -> std::result::Result<Option<String>, RemoteError> {
            let Some(r) = read_ref(client, layout, &key)? else {
                return Ok(None);
            };
            let Some(m) = read_manifest(client, layout, &r.manifest)? else {
                return Ok(Some(format!("manifest {} is missing", r.manifest.to_hex())));
            };
            for c in &m.chunks {
                let path = layout.chunk(&c.digest);
                match client.head(&path) {
                    Ok(meta) if meta.size == c.len => {}
                    Ok(meta) => {
                        return Ok(Some(format!(
                            "chunk {} is {} bytes",
                            c.digest.to_hex(),
                            meta.size
                        )))
                    }
                    Err(Fail::NotFound) => {
                        return Ok(Some(format!("chunk {} is missing", c.digest.to_hex())))
                    }
                    Err(f) => return Err(RemoteError::Unavailable(f.to_string())),
                }
                if deep {
                    let (bytes, _) = client
                        .get_small(&path, c.len)
                        .map_err(|f| RemoteError::Unavailable(f.to_string()))?;
                    if Digest::of(&bytes) != c.digest {
                        return Ok(Some(format!("chunk {} has other bytes", c.digest.to_hex())));
                    }
                }
            }
            Ok(None)
        })();
        match problem {
            Ok(None) => {}
            Ok(Some(why)) => bad.push(obj(vec![
                ("key", key.as_str().into()),
                ("error", why.into()),
            ])),
            Err(RemoteError::Bad { why, .. }) => bad.push(obj(vec![
                ("key", key.as_str().into()),
                ("error", why.into()),
            ])),
            Err(e) => return Err(remote_err(e)),
        }
    }
    let listed = client
        .list_all(&layout.folder("reports"))
        .map_err(|f| listing_failed("fleet fsck", "reports", f))?;
    unparseable.extend(listed.skipped);
    let reports: Vec<Value> = listed
        .objects
        .into_iter()
        .map(|m| Value::from(m.location.to_string()))
        .collect();
    let (signatures_checked, bad_signatures) = crate::signatures::fsck_records(client, layout)?;
    // Every other folder, for the names its listing cannot parse (one such
    // name fails no listing, but an operator should delete it).
    for folder in ["signatures", "manifests", "chunks", "leases"] {
        let listed = client
            .list_all(&layout.folder(folder))
            .map_err(|f| listing_failed("fleet fsck", folder, f))?;
        unparseable.extend(listed.skipped);
    }
    let unparseable: Vec<Value> = unparseable.iter().map(skipped_row).collect();
    let clean =
        bad.is_empty() && reports.is_empty() && bad_signatures.is_empty() && unparseable.is_empty();
    Ok((
        obj(vec![
            ("refs_checked", Value::Int(checked)),
            ("bad", Value::Array(bad)),
            ("reports", Value::Array(reports)),
            ("signatures_checked", Value::Int(signatures_checked)),
            ("bad_signatures", Value::Array(bad_signatures)),
            ("unparseable", Value::Array(unparseable)),
            ("clean", Value::Bool(clean)),
        ]),
        clean,
    ))
}

/// Sweep chunks and manifests no ref reaches and whose `last_modified` is
/// older than `grace` by the server's clock (FLEET.md §6). Refs are never
/// removed here. Aborts without sweeping if a ref or manifest cannot be
/// read (its chunks would look unreachable), and if any listing fails or
/// cannot be completed (`remote.listing_incomplete`): every listing is read
/// to its end before the first deletion. Names a listing cannot parse are
/// never deleted (counted in `unparseable`; `fleet fsck` names them).
pub fn gc(
    remote: &Remote,
    grace: Duration,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Value> {
    let client = remote.client()?;
    let layout = remote.layout();
    let mut manifests = BTreeSet::new();
    let mut chunks = BTreeSet::new();
    let (keys, skipped) = keys_listed(remote, "fleet gc")?;
    let mut unparseable = skipped.len();
    for key in keys {
        let r = read_ref(client, layout, &key).map_err(remote_err)?;
        let Some(r) = r else { continue };
        manifests.insert(layout.manifest(&r.manifest).to_string());
        match read_manifest(client, layout, &r.manifest).map_err(remote_err)? {
            Some(m) => {
                for c in m.chunks {
                    chunks.insert(layout.chunk(&c.digest).to_string());
                }
            }
            None => {
                return Err(Error::new(
                    Code::RemoteRecordInvalid,
                    format!(
                        "fleet gc: the manifest of {key} is missing or unreadable; nothing swept"
                    ),
                ))
            }
        }
    }
    // A manifest a signature record names is a root too: a trusted artifact
    // beside an untrusted ref must survive (docs/fleet.md, "Trust").
    let refs = manifests.len();
    let signed_roots =
        crate::signatures::mark_records(client, layout, &mut manifests, &mut chunks)?;
    let now = remote_now(remote)?;
    let cutoff = now - chrono::Duration::from_std(grace).unwrap_or(chrono::Duration::MAX);
    let mut candidates = Vec::new();
    for (folder, keep) in [("manifests", &manifests), ("chunks", &chunks)] {
        let listed = client
            .list_all(&layout.folder(folder))
            .map_err(|f| listing_failed("fleet gc", folder, f))?;
        unparseable += listed.skipped.len();
        for m in listed.objects {
            if !keep.contains(&m.location.to_string()) && m.last_modified < cutoff {
                candidates.push(m);
            }
        }
    }
    let (mut freed, mut freed_bytes) = (0i64, 0i64);
    for (i, m) in candidates.iter().enumerate() {
        client
            .delete(&m.location)
            .map_err(|f| unavailable("deleting", f))?;
        freed += 1;
        freed_bytes += m.size as i64;
        progress(i + 1, candidates.len());
    }
    Ok(obj(vec![
        ("refs", Value::Int(refs as i64)),
        ("signed_roots", Value::Int(signed_roots as i64)),
        ("kept_chunks", Value::Int(chunks.len() as i64)),
        ("freed_objects", Value::Int(freed)),
        ("freed_bytes", Value::Int(freed_bytes)),
        ("unparseable", Value::Int(unparseable as i64)),
        ("grace_s", Value::Int(grace.as_secs() as i64)),
    ]))
}

fn remote_now(remote: &Remote) -> Result<chrono::DateTime<chrono::Utc>> {
    let client = remote.client()?;
    remote
        .clock
        .now(client, remote.layout())
        .ok_or_else(|| Error::new(Code::RemoteUnavailable, "cannot read the remote's clock"))
}

/// Mend the fleet's copy of `key` from the local store's record (an
/// operator's repair of what verification proved wrong): the local record
/// is verified in full first; every chunk and the manifest on the remote
/// are read back and replaced when their bytes do not hash to their names
/// (content-addressed: proven wrong); the ref is created when missing and
/// replaced by `Update(etag)` when it is malformed or names another
/// manifest (two repairs cannot both win); the local signature records are
/// written beside it, replacing corrupt ones at their names. Everything
/// else stays create-only.
pub fn repair(engine: &Engine, remote: &Remote, key: &str) -> Result<Value> {
    tcg_core::engine::check_key(key)?;
    let client = remote.client()?;
    let layout = remote.layout();
    let Some(t) = engine.store().get_ref(&graph_ref(key)).map_err(store_err)? else {
        return Err(Error::new(
            Code::StoreAbsent,
            format!("fleet repair: the local store has no record of {key} to repair with"),
        ));
    };
    // Verify the local record fully before it becomes the fleet's.
    let check = tempdir_in(engine)?;
    let resolved = engine.resolve(key, &check.join("graph"));
    let _ = std::fs::remove_dir_all(&check);
    resolved?
        .ok_or_else(|| Error::new(Code::StoreAbsent, format!("{key} does not resolve locally")))?;
    let path = layout.graph_ref(key);
    let current = match client.head(&path) {
        Ok(m) => Some(m),
        Err(Fail::NotFound) => None,
        Err(f) => return Err(unavailable("reading the ref", f)),
    };
    let (_, replaced) =
        crate::publish::upload_objects(client, layout, engine.store(), &t.digest, true)
            .map_err(remote_err)?;
    // What the ref names now: `None` when absent; `Some(None)` when it is
    // proven wrong (unparseable, another key), replaced below.
    let incumbent: Option<Option<Digest>> = match read_ref(client, layout, key) {
        Ok(r) => r.map(|r| Some(r.manifest)),
        Err(RemoteError::Bad { .. }) => Some(None),
        Err(e) => return Err(remote_err(e)),
    };
    let record = RefRecord {
        key: key.to_string(),
        manifest: t.digest,
        producer: format!("fleet repair on {}", host_name()),
        created: unix_now(),
    };
    let outcome = match (incumbent, current) {
        (Some(Some(m)), _) if m == t.digest => {
            if replaced > 0 {
                "REPAIRED"
            } else {
                StoreOutcome::Present.as_str()
            }
        }
        (None, _) | (_, None) => {
            let p = crate::publish::create_ref(client, layout, &record).map_err(remote_err)?;
            if p.outcome != StoreOutcome::Stored && p.outcome != StoreOutcome::Present {
                return Err(Error::new(
                    Code::RemoteConflict,
                    format!(
                        "fleet repair: the ref of {key} changed meanwhile; run it again after checking"
                    ),
                ));
            }
            p.outcome.as_str()
        }
        (Some(_), Some(meta)) => {
            let etag = meta.e_tag.unwrap_or_default();
            match client.update(&path, Bytes::from(record.to_bytes()), &etag) {
                Ok(_) => "REPAIRED",
                Err(Fail::Precondition) => {
                    return Err(Error::new(
                        Code::RemoteConflict,
                        format!(
                            "fleet repair: the ref of {key} changed meanwhile; run it again after checking"
                        ),
                    ))
                }
                Err(f) => return Err(unavailable("replacing the ref", f)),
            }
        }
    };
    let signatures = crate::signatures::push_records(engine, remote, key)?;
    Ok(obj(vec![
        ("key", key.into()),
        ("outcome", outcome.into()),
        ("manifest", t.digest.to_hex().into()),
        ("replaced_objects", Value::Int(replaced as i64)),
        ("signatures", Value::Int(signatures as i64)),
    ]))
}

fn tempdir_in(engine: &Engine) -> Result<std::path::PathBuf> {
    let _ = engine;
    let p = std::env::temp_dir().join(format!(
        "tcg-repair-check-{}",
        crate::layout::random_hex32()
    ));
    std::fs::create_dir_all(&p).map_err(|e| Error::io("cannot create a check directory", &e))?;
    Ok(p)
}
