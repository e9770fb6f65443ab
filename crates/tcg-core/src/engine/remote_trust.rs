//! The trust policy on the fleet tier (docs/trust.md, "The fleet";
//! docs/fleet.md, "Trust"): signature records on the remote are the index of
//! candidates a trusting worker may fetch, since first-writer-wins may have
//! given `refs/<key>` to a writer it does not trust.
//!
//! A trusting worker lists the records of the signers its `allowed_signers`
//! names, fetches the manifests they vouch for (the ref's first, then by
//! statement time), verifies each in full exactly like any fetch, and admits
//! the first whose records the policy accepts for the subject computed from
//! the verified bytes. A refused candidate is never served and never
//! reported as bad bytes: unsigned is not corrupt.

use std::collections::BTreeMap;

use tcg_cas::Digest;
use tcg_trust::{SignedStatement, Subject, VerifiedSignature};

use super::admin::Counter;
use super::remote::{warn, RemoteError, RemoteTier};
use super::{check_key, graph_ref, store_err, Engine, Source};
use crate::{Code, Error, Result};

/// Most signed candidates one miss fetches (each is a full download and
/// verification; a signer vouching for more artifacts of one key than this
/// is not a case the fleet needs).
pub const MAX_CANDIDATES: usize = 8;

/// One signature record as the remote holds it: its signer's fingerprint
/// and the manifest from its name, and its bytes (not yet verified).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteSignature {
    /// Hex SHA-256 fingerprint of the signer, from the record's name.
    pub fingerprint: String,
    /// The manifest the record's name says it is about.
    pub manifest: Digest,
    /// The record (CJ of a [`SignedStatement`]), SHA-256 checked against its name.
    pub record: Vec<u8>,
}

/// What [`RemoteTier::signature_records`] found for one key.
#[derive(Debug, Clone, Default)]
pub struct SignatureRecords {
    /// The manifest `refs/<key>` names (`None`: no ref, or a bad one).
    pub ref_manifest: Option<Digest>,
    /// The records, in listing order.
    pub records: Vec<RemoteSignature>,
    /// Why records were skipped (a malformed name, size or digest).
    pub skipped: Vec<String>,
}

/// A key's local signature records as the remote stores them: the manifest
/// of the artifact serving the key, and (signer fingerprint hex, record
/// bytes) pairs.
pub type LocalRecords = (Digest, Vec<(String, Vec<u8>)>);

/// The outcome of one remote fetch.
#[derive(Debug)]
pub(crate) enum Fetched {
    /// Verified, admitted and published locally.
    Published,
    /// Nothing fetched (absent, unavailable, bad bytes: counted already).
    Miss,
    /// The trust policy refused what the remote had (a `trust.*` error).
    Refused(Error),
}

impl Fetched {
    pub(crate) fn is_published(&self) -> bool {
        matches!(self, Fetched::Published)
    }
}

/// What `pull` did for one key.
#[derive(Debug)]
pub struct Pulled {
    /// Where the key's record is now from (`None`: nowhere).
    pub source: Option<Source>,
    /// The trust refusal, when a policy refused what the remote had.
    pub refused: Option<Error>,
    /// Signature records stored beside the fetched artifact.
    pub signatures: usize,
}

/// A manifest some allowed signer's records vouch for.
struct Candidate {
    entries: Vec<SignedStatement>,
    /// Earliest statement time among records the policy trusts (without the
    /// subject); `None` when none does.
    trusted_time: Option<i64>,
    refusal: Option<tcg_trust::TrustError>,
    /// The envelope digests (hex) the verified statements are about.
    envelopes: std::collections::BTreeSet<String>,
}

impl Engine {
    /// The policy's verdict on a fetched, verified artifact: the valid
    /// signatures bound to `subject` when one of `entries` admits it.
    pub(crate) fn admit_fetched(
        &self,
        entries: &[SignedStatement],
        subject: &Subject,
    ) -> Result<Vec<(SignedStatement, VerifiedSignature)>> {
        if let Some(policy) = self.trust().policy() {
            policy
                .admit(entries, subject, tcg_trust::unix_now())
                .map_err(Error::from_trust)?;
        }
        let verdicts = tcg_trust::verify_entries(entries, subject);
        Ok(entries
            .iter()
            .cloned()
            .zip(verdicts)
            .filter_map(|(e, v)| v.ok().map(|v| (e, v)))
            .collect())
    }

    fn skip_record(&self, key: &str, why: impl std::fmt::Display) {
        warn(format_args!("{key}: signature record skipped: {why}"));
        self.count(Counter::RemoteSignatureSkipped);
    }

    fn refuse(&self, key: &str, what: &str, e: &Error) {
        warn(format_args!(
            "{key}: {what} refused by the trust policy ({}): {}",
            e.code().as_str(),
            e.message()
        ));
        self.count(Counter::RemoteTrustRefused);
    }

    /// A trusting worker's fetch on a local miss (docs/fleet.md, "Trust").
    pub(crate) fn fetch_remote_trusted(
        &self,
        key: &str,
        remote: &dyn RemoteTier,
        members: super::Members,
    ) -> Fetched {
        let Some(policy) = self.trust().policy() else {
            return Fetched::Miss;
        };
        let fingerprints = policy.allowed().fingerprints_hex();
        let found = match remote.signature_records(key, Some(&fingerprints)) {
            Ok(f) => f,
            Err(e) => {
                warn(format_args!("{key}: {e}"));
                self.count(Counter::RemoteError);
                return Fetched::Miss;
            }
        };
        for why in &found.skipped {
            self.skip_record(key, why);
        }
        let now = tcg_trust::unix_now();
        let mut candidates: BTreeMap<Digest, Candidate> = BTreeMap::new();
        for r in found.records {
            let entry = match SignedStatement::parse(&r.record) {
                Ok(e) => e,
                Err(e) => {
                    self.skip_record(key, format_args!("{}: {e}", r.fingerprint));
                    continue;
                }
            };
            let v = match entry.verify() {
                Ok(v) => v,
                Err(e) => {
                    self.skip_record(key, format_args!("{}: {e}", r.fingerprint));
                    continue;
                }
            };
            if tcg_trust::fingerprint_hex(&v.public_key) != r.fingerprint {
                self.skip_record(
                    key,
                    format_args!(
                        "filed under signer {} but signed by {}",
                        r.fingerprint, v.fingerprint
                    ),
                );
                continue;
            }
            if v.statement.key != key {
                self.skip_record(
                    key,
                    format_args!("a statement about another key ({})", v.statement.key),
                );
                continue;
            }
            let c = candidates.entry(r.manifest).or_insert(Candidate {
                entries: Vec::new(),
                trusted_time: None,
                refusal: None,
                envelopes: Default::default(),
            });
            c.envelopes.insert(v.statement.envelope_sha256.clone());
            match policy.trust(&v, now) {
                Ok(_) => {
                    let t = v.statement.time;
                    c.trusted_time = Some(c.trusted_time.map_or(t, |old| old.min(t)));
                }
                Err(e) => {
                    if c.refusal.is_none() {
                        c.refusal = Some(e);
                    }
                }
            }
            c.entries.push(entry);
        }
        let mut refused: Option<Error> = None;
        let mut order: Vec<(bool, i64, Digest)> = Vec::new();
        for (m, c) in candidates.iter_mut() {
            match c.trusted_time {
                Some(t) => order.push((Some(*m) != found.ref_manifest, t, *m)),
                None => {
                    // No record by a signer the policy trusts: refused unfetched.
                    let e = Error::from_trust(c.refusal.take().unwrap_or_else(|| {
                        tcg_trust::TrustError::Unsigned(format!("{key}: no usable record"))
                    }));
                    self.refuse(key, &format!("candidate {}", m.to_hex()), &e);
                    refused = Some(e);
                }
            }
        }
        // The ref's artifact first, then the earliest signed.
        order.sort();
        for (_, _, m) in order.into_iter().take(MAX_CANDIDATES) {
            let envelope = match remote.open_manifest(key, &m) {
                Ok(Some(e)) => e,
                Ok(None) => continue,
                Err(RemoteError::Unavailable(why)) => {
                    warn(format_args!("{key}: {why}"));
                    self.count(Counter::RemoteError);
                    return Fetched::Miss;
                }
                Err(RemoteError::Bad { manifest, why }) => {
                    let bad = manifest.unwrap_or_else(|| m.to_hex());
                    self.remote_bad(remote, key, &bad, &why);
                    continue;
                }
            };
            // Decided from the manifest before any chunk is fetched: records
            // about another envelope (a genuine record copied under this
            // manifest's name) cannot admit it.
            if !candidates[&m]
                .envelopes
                .contains(&envelope.file_digest.to_hex())
            {
                let e = Error::from_trust(tcg_trust::TrustError::StatementMismatch(format!(
                    "the records filed under manifest {} are about another envelope than \
                     the one it states ({}); nothing was fetched",
                    m.to_hex(),
                    envelope.file_digest.to_hex()
                )));
                self.refuse(key, &format!("candidate {}", m.to_hex()), &e);
                refused = Some(e);
                continue;
            }
            let entries = &candidates[&m].entries;
            match self.ingest_remote(remote, key, envelope, Some(entries), members) {
                Fetched::Published => return Fetched::Published,
                Fetched::Refused(e) => {
                    self.refuse(key, &format!("candidate {}", m.to_hex()), &e);
                    refused = Some(e);
                }
                Fetched::Miss => {}
            }
        }
        if let Some(e) = refused {
            return Fetched::Refused(e);
        }
        match found.ref_manifest {
            Some(m0) if !candidates.contains_key(&m0) => {
                let e = Error::new(
                    Code::TrustUnsigned,
                    format!(
                        "the remote's artifact of {key} (manifest {}) has no signature by a \
                         signer in {}",
                        m0.to_hex(),
                        policy.allowed().path.display()
                    ),
                );
                self.refuse(key, "the remote's artifact", &e);
                Fetched::Refused(e)
            }
            _ => {
                self.count(Counter::RemoteMiss);
                Fetched::Miss
            }
        }
    }

    /// The local signature records of the artifact serving `key`, as the
    /// remote stores them: its manifest and (signer fingerprint hex, record
    /// bytes) pairs. `None` when the key has no local record.
    pub fn remote_signature_records(&self, key: &str) -> Result<Option<LocalRecords>> {
        check_key(key)?;
        let Some((manifest, subject)) = self.stored_subject(key)? else {
            return Ok(None);
        };
        let records = self
            .signatures(&subject)?
            .into_iter()
            .map(|(e, v)| (tcg_trust::fingerprint_hex(&v.public_key), e.to_bytes()))
            .collect();
        Ok(Some((manifest, records)))
    }

    /// After a mint's remote publication (whatever its outcome): write the
    /// local signature records of `key` beside it, so that trusting workers
    /// find the artifact even when the ref names another. Returns how many
    /// were written; failures are warnings.
    pub(crate) fn publish_remote_signatures(&self, key: &str) -> usize {
        let Some(remote) = self.remote.as_ref() else {
            return 0;
        };
        let records = match self.remote_signature_records(key) {
            Ok(Some(r)) => r,
            Ok(None) => return 0,
            Err(e) => {
                warn(format_args!(
                    "{key}: reading local signatures: {}",
                    e.message()
                ));
                return 0;
            }
        };
        let (manifest, records) = records;
        let mut written = 0;
        for (fp, bytes) in &records {
            match remote.publish_signature(key, &manifest, fp, bytes) {
                Ok(true) => written += 1,
                Ok(false) => {}
                Err(e) => {
                    warn(format_args!("{key}: publishing a signature failed: {e}"));
                    self.count(Counter::RemoteError);
                }
            }
        }
        written
    }

    /// `pull` of one key: bring it into the local store with its signature
    /// records. With a trust policy, admission is [`Engine::fetch_remote_trusted`]'s
    /// (an unsigned or untrusted artifact is refused with its `trust.*`
    /// error); without one, the ref's artifact is fetched and the records
    /// about it that verify are stored as received. The envelope is verified
    /// in full either way; with `admitted_copy` its members are stored as
    /// the admitted copy too, otherwise the first resolve of the key records
    /// it (reading the envelope once).
    pub fn pull_key(&self, key: &str, admitted_copy: bool) -> Result<Pulled> {
        let members = if admitted_copy {
            super::Members::Store
        } else {
            super::Members::Stage
        };
        check_key(key)?;
        // Under a trust policy a local record counts only when the policy
        // admits it (docs/trust.md, "Admission records"); otherwise the
        // trusted fetch below may replace it.
        let present = match self.store.get_ref(&graph_ref(key)).map_err(store_err)? {
            None => false,
            Some(t) => {
                let lease = self.store.lease().map_err(store_err)?;
                let admitted = self.admits_stored(&lease, key, &t.digest)?;
                lease.end().map_err(store_err)?;
                admitted
            }
        };
        let mut out = Pulled {
            source: None,
            refused: None,
            signatures: 0,
        };
        if present {
            out.source = Some(Source::Local);
            return Ok(out);
        }
        let Some(remote) = self.remote.clone() else {
            return Ok(out);
        };
        if self.trust().has_policy() {
            match self.fetch_remote_trusted(key, &*remote, members) {
                Fetched::Published => {
                    out.source = Some(Source::Remote);
                    if let Some((_, subject)) = self.stored_subject(key)? {
                        out.signatures = self.signatures(&subject)?.len();
                    }
                }
                Fetched::Refused(e) => out.refused = Some(e),
                Fetched::Miss => {}
            }
            return Ok(out);
        }
        // The signature records are listed while the artifact streams: one
        // listing, wasted on a miss, which does not wait for it.
        let listing = {
            let (remote, key) = (std::sync::Arc::clone(&remote), key.to_string());
            std::thread::spawn(move || remote.signature_records(&key, None))
        };
        if !self.fetch_remote_with(key, members) {
            return Ok(out);
        }
        out.source = Some(Source::Remote);
        let Some((manifest, subject)) = self.stored_subject(key)? else {
            return Ok(out);
        };
        let listed = match listing.join() {
            Ok(l) => l,
            Err(p) => std::panic::resume_unwind(p),
        };
        let found = match listed {
            Ok(f) => f,
            Err(e) => {
                warn(format_args!("{key}: listing signatures: {e}"));
                return Ok(out);
            }
        };
        let entries: Vec<SignedStatement> = found
            .records
            .iter()
            .filter(|r| r.manifest == manifest)
            .filter_map(|r| SignedStatement::parse(&r.record).ok())
            .collect();
        let keep = self.admit_fetched(&entries, &subject)?;
        let lease = self.store.lease().map_err(store_err)?;
        for (entry, v) in &keep {
            self.store_signature(&lease, entry, v)?;
            out.signatures += 1;
        }
        lease.end().map_err(store_err)?;
        Ok(out)
    }
}
