//! Signatures beside stored artifacts, signing at mint and after the fact,
//! the `.sig` document beside exported envelopes, and the trust policy
//! applied to imports.
//!
//! A signature record is one store object (the CJ of a
//! [`tcg_trust::SignedStatement`]) under its own ref,
//! `torch-compiled-graphs/v1/signatures/<key>/<envelope sha256 hex>/<signer fingerprint hex>`,
//! so several signers can vouch for one artifact and each is written once.
//! Records are verified before they are stored and bound to the envelope's
//! SHA-256, so a record can never stand for another envelope.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest as _, Sha256};
use tcg_cas::{CasOutcome, Digest, Lease, Target};
use tcg_cj::{Map, Value};
use tcg_trust::{SignedStatement, Signer, Subject, TrustPolicy, VerifiedSignature};

use super::{check_key, graph_ref, store_err, Engine};
use crate::artifact::publish::{fsync_parent, Temp};
use crate::artifact::{read_metadata_member, validate_metadata, Metadata};
use crate::identity::toolchain_axis;
use crate::{Code, Error, Result};

/// Prefix of the signature refs (wire identity of the local store).
pub const SIGNATURE_REF_PREFIX: &str = "torch-compiled-graphs/v1/signatures/";

/// Signature records larger than this are not read.
const MAX_RECORD_BYTES: u64 = 64 * 1024;

/// The signature ref of one signer's statement about one envelope.
pub fn signature_ref(key: &str, envelope_sha256: &str, fingerprint_hex: &str) -> String {
    format!("{SIGNATURE_REF_PREFIX}{key}/{envelope_sha256}/{fingerprint_hex}")
}

/// The `.sig` document path beside an envelope path (`graph.tar.gz.sig`).
pub fn sig_path(envelope: &Path) -> PathBuf {
    let mut s = envelope.as_os_str().to_owned();
    s.push(".sig");
    PathBuf::from(s)
}

/// The engine's signing and trust configuration.
#[derive(Debug, Clone, Default)]
pub struct TrustConfig {
    signer: Option<Arc<Signer>>,
    producer: Option<String>,
    policy: Option<Arc<TrustPolicy>>,
}

/// Where the configuration comes from: each `None` falls back to its
/// environment variable (`TORCH_COMPILED_GRAPHS_SIGNING_KEY`, `…_TRUST`,
/// `…_REVOKED_KEYS`, `…_PRODUCER`); an empty variable counts as unset.
#[derive(Debug, Clone, Default)]
pub struct TrustSettings {
    /// An OpenSSH ed25519 private key file to sign mints with.
    pub signing_key: Option<PathBuf>,
    /// An OpenSSH `allowed_signers` file: the trust policy.
    pub trust: Option<PathBuf>,
    /// A revoked-keys file (one public key per line).
    pub revoked_keys: Option<PathBuf>,
    /// The producer named in statements.
    pub producer: Option<String>,
}

fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

impl TrustSettings {
    /// Fill every unset field from its environment variable.
    pub fn with_env(mut self) -> TrustSettings {
        self.signing_key = self
            .signing_key
            .or_else(|| env_path(tcg_trust::ENV_SIGNING_KEY));
        self.trust = self.trust.or_else(|| env_path(tcg_trust::ENV_TRUST));
        self.revoked_keys = self
            .revoked_keys
            .or_else(|| env_path(tcg_trust::ENV_REVOKED_KEYS));
        self.producer = self.producer.or_else(|| {
            std::env::var(tcg_trust::ENV_PRODUCER)
                .ok()
                .filter(|v| !v.is_empty())
        });
        self
    }

    /// Load the files named. A revoked-keys file without a trust policy is an error.
    pub fn load(&self) -> Result<TrustConfig> {
        let signer = match &self.signing_key {
            Some(p) => Some(Arc::new(Signer::from_file(p).map_err(Error::from_trust)?)),
            None => None,
        };
        let policy = match (&self.trust, &self.revoked_keys) {
            (Some(t), r) => Some(Arc::new(
                TrustPolicy::load(t, r.as_deref()).map_err(Error::from_trust)?,
            )),
            (None, Some(r)) => {
                return Err(Error::new(
                    Code::TrustAllowedSignersInvalid,
                    format!(
                        "a revoked-keys file ({}) needs a trust policy (an allowed_signers file)",
                        r.display()
                    ),
                ))
            }
            (None, None) => None,
        };
        Ok(TrustConfig {
            signer,
            producer: self.producer.clone(),
            policy,
        })
    }
}

impl TrustConfig {
    /// Whether a trust policy is set.
    pub fn has_policy(&self) -> bool {
        self.policy.is_some()
    }

    /// The trust policy, if one is set.
    pub fn policy(&self) -> Option<&TrustPolicy> {
        self.policy.as_deref()
    }

    /// Whether mints are signed.
    pub fn has_signer(&self) -> bool {
        self.signer.is_some()
    }
}

/// The producer named when `signer` signs without an explicit one: the key
/// file's comment (usually `user@host`), else this host's name.
pub fn default_producer(signer: &Signer) -> String {
    let comment = signer.comment().trim();
    if !comment.is_empty() {
        return comment.to_string();
    }
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// The subject of a verified envelope: its key, SHA-256 and toolchain axis.
pub fn subject_of(md: &Metadata, envelope_sha256: &Digest) -> Subject {
    Subject {
        key: md.key().to_string(),
        envelope_sha256: envelope_sha256.to_hex(),
        toolchain: toolchain_axis(md.toolchain()),
    }
}

/// A signature's summary for `inspect` and `ls`.
pub fn signature_summary(v: &VerifiedSignature) -> Value {
    let mut m = Map::new();
    m.insert("fingerprint".into(), v.fingerprint.clone().into());
    m.insert("producer".into(), v.statement.producer.clone().into());
    m.insert("signer".into(), v.statement.signer.clone().into());
    m.insert("time".into(), Value::Int(v.statement.time));
    Value::Object(m)
}

impl Engine {
    /// Use `config` for signing mints and admitting imports.
    pub fn with_trust(mut self, config: TrustConfig) -> Engine {
        self.trust = config;
        self
    }

    /// The signing and trust configuration.
    pub fn trust(&self) -> &TrustConfig {
        &self.trust
    }

    /// Store `entry` (already verified as `v` and bound to its subject) under
    /// its signer's ref. Create-only: a signer's first record for an envelope
    /// stays. Returns whether this call wrote it.
    pub(crate) fn store_signature(
        &self,
        lease: &Lease,
        entry: &SignedStatement,
        v: &VerifiedSignature,
    ) -> Result<bool> {
        let s = &v.statement;
        let name = signature_ref(
            &s.key,
            &s.envelope_sha256,
            &tcg_trust::fingerprint_hex(&v.public_key),
        );
        let digest = self
            .store
            .put_bytes(lease, &entry.to_bytes())
            .map_err(store_err)?;
        let outcome = self
            .store
            .compare_and_swap(&name, None, Some(&Target::object(digest)))
            .map_err(store_err)?;
        Ok(matches!(outcome, CasOutcome::Matched))
    }

    /// Every stored signature of (`key`, envelope `sha256`), each re-verified
    /// and bound to the subject; a record that fails is skipped (signatures
    /// only ever add trust, and a bad record is no evidence against the
    /// artifact).
    pub fn signatures(
        &self,
        subject: &Subject,
    ) -> Result<Vec<(SignedStatement, VerifiedSignature)>> {
        let prefix = format!(
            "{SIGNATURE_REF_PREFIX}{}/{}/",
            subject.key, subject.envelope_sha256
        );
        let listing = self.store.list_refs(&prefix).map_err(store_err)?;
        let lease = self.store.lease().map_err(store_err)?;
        let mut out = Vec::new();
        for entry in listing.entries {
            let Ok(bytes) = self
                .store
                .read_object(&lease, &entry.target.digest, MAX_RECORD_BYTES)
            else {
                continue;
            };
            let Ok(signed) = SignedStatement::parse(&bytes) else {
                continue;
            };
            let verdicts = tcg_trust::verify_entries(std::slice::from_ref(&signed), subject);
            if let Some(Ok(v)) = verdicts.into_iter().next() {
                out.push((signed, v));
            }
        }
        lease.end().map_err(store_err)?;
        Ok(out)
    }

    /// Sign `subject` with the configured signer (a mint by this node).
    pub(crate) fn sign_with_config(&self, lease: &Lease, subject: &Subject) -> Result<()> {
        if let Some(signer) = &self.trust.signer {
            let producer = self
                .trust
                .producer
                .clone()
                .unwrap_or_else(|| default_producer(signer));
            self.sign_subject(lease, signer, &producer, subject)?;
        }
        Ok(())
    }

    fn sign_subject(
        &self,
        lease: &Lease,
        signer: &Signer,
        producer: &str,
        subject: &Subject,
    ) -> Result<(SignedStatement, VerifiedSignature)> {
        let statement = signer.statement(subject, producer, tcg_trust::unix_now());
        let entry = signer.sign(&statement).map_err(Error::from_trust)?;
        let v = entry.verify().map_err(Error::from_trust)?;
        self.store_signature(lease, &entry, &v)?;
        Ok((entry, v))
    }

    /// Sign the artifact stored for `key` after the fact: export-verify the
    /// envelope the graph ref selects (full reader, SHA-256 of the exact
    /// bytes), then sign its statement with `signer` and store the record.
    /// `producer` defaults to the key's comment, else the host name.
    pub fn sign_stored(&self, key: &str, signer: &Signer, producer: Option<&str>) -> Result<Value> {
        check_key(key)?;
        let lease = self.store.lease().map_err(store_err)?;
        let stage = super::StoreStage::new(self, &lease)?;
        let exported = stage.path().join(crate::artifact::ENVELOPE_FILE_NAME);
        let subject = self.export_envelope(key, &exported)?;
        let producer = producer
            .map(str::to_owned)
            .unwrap_or_else(|| default_producer(signer));
        let (_, v) = self.sign_subject(&lease, signer, &producer, &subject)?;
        drop(stage);
        lease.end().map_err(store_err)?;
        let mut out = match signature_summary(&v) {
            Value::Object(m) => m,
            _ => unreachable!("a summary is an object"),
        };
        out.insert("key".into(), key.into());
        out.insert("envelope_sha256".into(), subject.envelope_sha256.into());
        Ok(Value::Object(out))
    }

    /// The manifest and subject of the record serving `key` locally.
    pub(crate) fn stored_subject(&self, key: &str) -> Result<Option<(Digest, Subject)>> {
        let Some(target) = self.store.get_ref(&graph_ref(key)).map_err(store_err)? else {
            return Ok(None);
        };
        let lease = self.store.lease().map_err(store_err)?;
        let manifest = self
            .store
            .load_manifest(&lease, &target.digest)
            .map_err(store_err)?;
        let reader = self
            .store
            .open_file(&lease, &target.digest, true)
            .map_err(store_err)?;
        let md = validate_metadata(&read_metadata_member(reader)?, None)?;
        lease.end().map_err(store_err)?;
        Ok(Some((
            target.digest,
            subject_of(&md, &manifest.file_digest),
        )))
    }

    /// The signatures of the envelope that serves `key` now, as summaries.
    pub fn signers(&self, key: &str) -> Result<Vec<Value>> {
        check_key(key)?;
        let Some((_, subject)) = self.stored_subject(key)? else {
            return Ok(Vec::new());
        };
        Ok(self
            .signatures(&subject)?
            .iter()
            .map(|(_, v)| signature_summary(v))
            .collect())
    }

    /// Import's signature step, after the envelope was verified and ingested
    /// and before any ref is written: read `path.sig` if present, apply the
    /// trust policy, and return the signatures worth keeping (valid and bound
    /// to this envelope).
    pub(crate) fn import_signatures(
        &self,
        path: &Path,
        subject: &Subject,
    ) -> Result<Vec<(SignedStatement, VerifiedSignature)>> {
        let sig = sig_path(path);
        let entries = match tcg_trust::read_small_file(&sig) {
            Ok(bytes) => tcg_trust::parse_document(&bytes)
                .map_err(|e| Error::from_trust(e).context(format_args!("{}", sig.display())))?,
            Err(tcg_trust::TrustError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                Vec::new()
            }
            Err(e) => return Err(Error::from_trust(e)),
        };
        if let Some(policy) = &self.trust.policy {
            policy
                .admit(&entries, subject, tcg_trust::unix_now())
                .map_err(Error::from_trust)?;
        }
        let verdicts = tcg_trust::verify_entries(&entries, subject);
        Ok(entries
            .into_iter()
            .zip(verdicts)
            .filter_map(|(e, v)| v.ok().map(|v| (e, v)))
            .collect())
    }

    /// Write the signatures document of `subject` beside an exported
    /// envelope, without clobbering (an identical existing file is accepted).
    /// Nothing is written when the artifact has no signature.
    pub(crate) fn export_signatures(&self, destination: &Path, subject: &Subject) -> Result<()> {
        let entries: Vec<SignedStatement> = self
            .signatures(subject)?
            .into_iter()
            .map(|(e, _)| e)
            .collect();
        if entries.is_empty() {
            return Ok(());
        }
        let doc = tcg_trust::document_bytes(&entries);
        let dest = sig_path(destination);
        let (temp, mut file) = Temp::file(&dest)?;
        file.write_all(&doc)
            .and_then(|_| file.sync_all())
            .map_err(|e| Error::io(format_args!("cannot write {}", temp.path().display()), &e))?;
        drop(file);
        match std::fs::hard_link(temp.path(), &dest) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let same = tcg_trust::read_small_file(&dest)
                    .map(|b| b == doc)
                    .unwrap_or(false);
                if !same {
                    return Err(super::destination::occupied(
                        &dest,
                        "it holds other signatures",
                    ));
                }
            }
            Err(e) => {
                return Err(Error::io(
                    format_args!("cannot publish {}", dest.display()),
                    &e,
                ))
            }
        }
        drop(temp);
        fsync_parent(&dest)
    }
}

/// The subject of an envelope file (SHA-256 of its bytes, key and toolchain
/// axis from its metadata). Reads the metadata member only: call it on a
/// file that is verified in full separately, or for display.
pub fn envelope_subject(path: &Path) -> Result<Subject> {
    let (sha, md) = digest_and_metadata(path)?;
    Ok(subject_of(&md, &sha))
}

fn digest_and_metadata(path: &Path) -> Result<(Digest, Metadata)> {
    let mut f = File::open(path)
        .map_err(|e| Error::io(format_args!("cannot open {}", path.display()), &e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| Error::io(format_args!("cannot read {}", path.display()), &e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    let f = File::open(path)
        .map_err(|e| Error::io(format_args!("cannot open {}", path.display()), &e))?;
    let md = validate_metadata(&read_metadata_member(f)?, None)?;
    Ok((Digest(h.finalize().into()), md))
}
