//! Signature records on the remote (docs/fleet.md, "Trust"):
//! `signatures/<cg-key>/<signer fingerprint hex>/<manifest 64 hex>/<sha256 hex of the record>`,
//! create-only. The name says who signed (a trusting worker lists only the
//! prefixes of signers it trusts), what about (the manifest to fetch), and
//! the record's own digest (a squatter can only occupy a name no real record
//! takes). Reading is bounded: records per listing, bytes per record.

use bytes::Bytes;
use object_store::path::Path;
use tcg_cas::Digest;
use tcg_core::engine::{RemoteError, RemoteSignature, SignatureRecords};

use crate::client::{Client, Fail};
use crate::fetch::read_ref;
use crate::layout::Layout;

/// Largest signature record read (a record is a statement and an armored
/// ed25519 signature: well under 2 KiB).
pub const MAX_RECORD_BYTES: u64 = 16 * 1024;
/// Most records read under one signer's prefix of one key.
pub const MAX_RECORDS_PER_SIGNER: usize = 64;
/// Most records read under one key when every signer is listed (`pull`
/// without a policy, `fleet fsck`).
pub const MAX_RECORDS_PER_KEY: usize = 1024;

fn is_hex64(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

impl Layout {
    /// `signatures/<cg-key>/`.
    pub fn signatures_of(&self, key: &str) -> Path {
        self.folder(&format!("signatures/{key}"))
    }

    /// `signatures/<cg-key>/<fingerprint hex>/`.
    pub fn signatures_by(&self, key: &str, fingerprint_hex: &str) -> Path {
        self.folder(&format!("signatures/{key}/{fingerprint_hex}"))
    }

    /// `signatures/<cg-key>/<fingerprint hex>/<manifest hex>/<record sha256 hex>`.
    pub fn signature(
        &self,
        key: &str,
        fingerprint_hex: &str,
        manifest: &Digest,
        record: &[u8],
    ) -> Path {
        self.folder(&format!(
            "signatures/{key}/{fingerprint_hex}/{}/{}",
            manifest.to_hex(),
            Digest::of(record).to_hex()
        ))
    }
}

/// A record's name taken apart: (key, fingerprint hex, manifest, record digest).
pub fn parse_name(layout: &Layout, path: &Path) -> Option<(String, String, Digest, Digest)> {
    let root = layout.folder("signatures").to_string();
    let rest = path.as_ref().strip_prefix(&root)?.strip_prefix('/')?;
    let parts: Vec<&str> = rest.split('/').collect();
    let [key, fp, m, r] = parts.as_slice() else {
        return None;
    };
    if !is_hex64(fp) || !is_hex64(m) || !is_hex64(r) || tcg_core::engine::check_key(key).is_err() {
        return None;
    }
    Some((
        key.to_string(),
        fp.to_string(),
        Digest::from_hex(m)?,
        Digest::from_hex(r)?,
    ))
}

/// Read the record at `path` (listed with `size`): bounded, and its SHA-256
/// must equal its name. `Err(Ok(why))`: skip it; `Err(Err(_))`: the remote failed.
fn read_record(
    client: &Client,
    path: &Path,
    size: u64,
    named: &Digest,
) -> Result<Vec<u8>, Result<String, RemoteError>> {
    if size > MAX_RECORD_BYTES {
        return Err(Ok(format!(
            "{path} is {size} bytes, over the limit of {MAX_RECORD_BYTES}"
        )));
    }
    let bytes = match client.get_small(path, MAX_RECORD_BYTES) {
        Ok((b, _)) => b,
        // Deleted between listing and reading: gone, not hostile.
        Err(Fail::NotFound) => return Err(Ok(format!("{path} disappeared"))),
        Err(f) => {
            return Err(Err(RemoteError::Unavailable(format!(
                "reading a signature record: {f}"
            ))))
        }
    };
    if Digest::of(&bytes) != *named {
        return Err(Ok(format!("{path} does not hash to its name")));
    }
    Ok(bytes.to_vec())
}

/// The records of `key` under each signer in `fingerprints` (`None`: every
/// signer), and the manifest the ref names. Bounded; a malformed name, an
/// oversized record or one that does not hash to its name is skipped with
/// its reason.
pub fn records(
    client: &Client,
    layout: &Layout,
    key: &str,
    fingerprints: Option<&[String]>,
) -> Result<SignatureRecords, RemoteError> {
    let mut out = SignatureRecords {
        ref_manifest: match read_ref(client, layout, key) {
            Ok(r) => r.map(|r| r.manifest),
            // A bad ref is no candidate (the ref reader reports it to
            // workers without a policy); the records may still name one.
            Err(RemoteError::Bad { .. }) => None,
            Err(e) => return Err(e),
        },
        ..SignatureRecords::default()
    };
    let prefixes: Vec<(Path, usize)> = match fingerprints {
        Some(fps) => fps
            .iter()
            .filter(|fp| is_hex64(fp))
            .map(|fp| (layout.signatures_by(key, fp), MAX_RECORDS_PER_SIGNER))
            .collect(),
        None => vec![(layout.signatures_of(key), MAX_RECORDS_PER_KEY)],
    };
    // On the resolve path: each listing within the metadata timeout, in all.
    let limit = client.config.timeout;
    for (prefix, cap) in prefixes {
        let (listed, complete) = client
            .list_first(&prefix, cap, limit)
            .map_err(|f| RemoteError::Unavailable(format!("listing signatures: {f}")))?;
        if !complete {
            out.skipped.push(format!(
                "{prefix} holds more than {cap} records; the rest are not read"
            ));
        }
        for entry in &listed.skipped {
            out.skipped
                .push(format!("{prefix}: an unparseable name skipped: {entry}"));
        }
        let listed = listed.objects;
        for meta in listed {
            let Some((k, fp, manifest, named)) = parse_name(layout, &meta.location) else {
                out.skipped.push(format!(
                    "{} is not a signature record's name",
                    meta.location
                ));
                continue;
            };
            if k != key {
                out.skipped
                    .push(format!("{} is filed under another key", meta.location));
                continue;
            }
            match read_record(client, &meta.location, meta.size, &named) {
                Ok(record) => out.records.push(RemoteSignature {
                    fingerprint: fp,
                    manifest,
                    record,
                }),
                Err(Ok(why)) => out.skipped.push(why),
                Err(Err(e)) => return Err(e),
            }
        }
    }
    Ok(out)
}

/// Write one record create-only. `Ok(true)`: written; `Ok(false)`: the
/// same bytes were there. Other bytes at the name are proven wrong (the
/// name is the SHA-256 of our bytes: an overwritten or corrupt record) and
/// are replaced by a conditional update on their ETag (`push`, `sign` and
/// `fleet repair` all mend it); anything else is never overwritten.
pub fn put_record(
    client: &Client,
    layout: &Layout,
    key: &str,
    fingerprint_hex: &str,
    manifest: &Digest,
    record: &[u8],
) -> Result<bool, RemoteError> {
    if !is_hex64(fingerprint_hex) || record.len() as u64 > MAX_RECORD_BYTES {
        return Err(RemoteError::Unavailable(format!(
            "a signature record of {} bytes by {fingerprint_hex:?} cannot be published",
            record.len()
        )));
    }
    let path = layout.signature(key, fingerprint_hex, manifest, record);
    match client.create(&path, Bytes::copy_from_slice(record)) {
        Ok(_) => Ok(true),
        Err(Fail::Exists) => {
            let meta = match client.head(&path) {
                Ok(m) => m,
                Err(f) => {
                    return Err(RemoteError::Unavailable(format!(
                        "reading back a signature record: {f}"
                    )))
                }
            };
            // The incumbent is read only as far as its name allows: more
            // bytes than a record may have cannot be the record.
            let same = meta.size == record.len() as u64
                && match client.get_small(&path, MAX_RECORD_BYTES) {
                    Ok((b, _)) => b.as_ref() == record,
                    Err(Fail::NotFound) => false,
                    Err(f) => {
                        return Err(RemoteError::Unavailable(format!(
                            "reading back a signature record: {f}"
                        )))
                    }
                };
            if same {
                return Ok(false);
            }
            let etag = meta.e_tag.unwrap_or_default();
            match client.update(&path, Bytes::copy_from_slice(record), &etag) {
                Ok(_) => Ok(true),
                // Replaced meanwhile (by another mender, with these bytes, or
                // by a writer again): what is there now decides.
                Err(Fail::Precondition) => match client.get_small(&path, MAX_RECORD_BYTES) {
                    Ok((b, _)) if b.as_ref() == record => Ok(false),
                    _ => Err(RemoteError::Bad {
                        manifest: Some(manifest.to_hex()),
                        why: format!("{path} changed while it was being replaced; run it again"),
                    }),
                },
                Err(f) => Err(RemoteError::Unavailable(format!(
                    "replacing a corrupt signature record: {f}"
                ))),
            }
        }
        Err(f) => Err(RemoteError::Unavailable(format!(
            "writing a signature record: {f}"
        ))),
    }
}

/// Whether any record of `key` by one of `fingerprints` exists (a trusting
/// follower's signal that the leader's signed artifact is there).
pub fn any_record(
    client: &Client,
    layout: &Layout,
    key: &str,
    fingerprints: &[String],
) -> Result<bool, Fail> {
    for fp in fingerprints.iter().filter(|fp| is_hex64(fp)) {
        let (listed, _) =
            client.list_first(&layout.signatures_by(key, fp), 1, client.config.timeout)?;
        if !listed.objects.is_empty() {
            return Ok(true);
        }
    }
    Ok(false)
}

/// `push`'s signature step: upload the local records of the artifact
/// serving `key` beside it. Returns how many were written.
pub fn push_records(
    engine: &tcg_core::engine::Engine,
    remote: &crate::Remote,
    key: &str,
) -> tcg_core::Result<usize> {
    let client = remote.client()?;
    let Some((manifest, records)) = engine.remote_signature_records(key)? else {
        return Ok(0);
    };
    let mut written = 0;
    for (fp, bytes) in &records {
        match put_record(client, remote.layout(), key, fp, &manifest, bytes) {
            Ok(true) => written += 1,
            Ok(false) => {}
            Err(e) => tcg_core::engine::remote_warn(format_args!("{key}: {e}")),
        }
    }
    Ok(written)
}

/// `fleet gc`'s marking from signature records: every manifest a record
/// names is a root (its chunks are kept). A record naming an absent or
/// malformed manifest keeps nothing more (junk must not stop the sweep).
/// Returns how many distinct manifests records name.
pub fn mark_records(
    client: &Client,
    layout: &Layout,
    manifests: &mut std::collections::BTreeSet<String>,
    chunks: &mut std::collections::BTreeSet<String>,
) -> tcg_core::Result<usize> {
    let listed = client
        .list_all(&layout.folder("signatures"))
        .map_err(|f| crate::ops::listing_failed("fleet gc", "signatures", f))?;
    let mut named = std::collections::BTreeSet::new();
    for meta in listed.objects {
        if let Some((_, _, m, _)) = parse_name(layout, &meta.location) {
            named.insert(m);
        }
    }
    for m in &named {
        if !manifests.insert(layout.manifest(m).to_string()) {
            continue;
        }
        match crate::fetch::read_manifest(client, layout, m) {
            Ok(Some(man)) => {
                for c in man.chunks {
                    chunks.insert(layout.chunk(&c.digest).to_string());
                }
            }
            Ok(None) | Err(RemoteError::Bad { .. }) => {}
            Err(RemoteError::Unavailable(why)) => {
                return Err(tcg_core::Error::new(
                    tcg_core::Code::RemoteUnavailable,
                    format!("fleet gc: reading a signed manifest: {why}; nothing swept"),
                ))
            }
        }
    }
    Ok(named.len())
}

/// What is wrong with one stored record, if anything: its name, size,
/// digest, form, signature, signer, key, and that its statement is about
/// the manifest its name gives.
fn record_problem(
    client: &Client,
    layout: &Layout,
    meta: &object_store::ObjectMeta,
) -> Result<Option<String>, RemoteError> {
    let Some((key, fp, manifest, named)) = parse_name(layout, &meta.location) else {
        return Ok(Some("not a signature record's name".into()));
    };
    let bytes = match read_record(client, &meta.location, meta.size, &named) {
        Ok(b) => b,
        Err(Ok(why)) => return Ok(Some(why)),
        Err(Err(e)) => return Err(e),
    };
    let v = match tcg_trust::SignedStatement::parse(&bytes).and_then(|e| e.verify()) {
        Ok(v) => v,
        Err(e) => return Ok(Some(format!("{}: {e}", e.code()))),
    };
    if tcg_trust::fingerprint_hex(&v.public_key) != fp {
        return Ok(Some(format!(
            "signed by {}, filed under {fp}",
            v.fingerprint
        )));
    }
    if v.statement.key != key {
        return Ok(Some(format!("a statement about {}", v.statement.key)));
    }
    match crate::fetch::read_manifest(client, layout, &manifest) {
        Ok(Some(m)) if m.file_digest.to_hex() == v.statement.envelope_sha256 => Ok(None),
        Ok(Some(_)) => Ok(Some(format!(
            "the statement is about envelope {}, not manifest {}",
            v.statement.envelope_sha256,
            manifest.to_hex()
        ))),
        Ok(None) => Ok(Some(format!("manifest {} is missing", manifest.to_hex()))),
        Err(RemoteError::Bad { why, .. }) => Ok(Some(why)),
        Err(e) => Err(e),
    }
}

/// `fleet fsck`'s check of every signature record. Returns how many were
/// checked and the bad ones (`{"record", "error"}`); names the listing
/// could not parse are `fleet fsck`'s `unparseable`.
pub fn fsck_records(
    client: &Client,
    layout: &Layout,
) -> tcg_core::Result<(i64, Vec<tcg_cj::Value>)> {
    let unavailable = |why: String| tcg_core::Error::new(tcg_core::Code::RemoteUnavailable, why);
    let listed = client
        .list_all(&layout.folder("signatures"))
        .map_err(|f| crate::ops::listing_failed("fleet fsck", "signatures", f))?
        .objects;
    let mut bad = Vec::new();
    for meta in &listed {
        if let Some(why) =
            record_problem(client, layout, meta).map_err(|e| unavailable(e.to_string()))?
        {
            let mut m = tcg_cj::Map::new();
            m.insert("record".into(), meta.location.to_string().into());
            m.insert("error".into(), why.into());
            bad.push(tcg_cj::Value::Object(m));
        }
    }
    Ok((listed.len() as i64, bad))
}
