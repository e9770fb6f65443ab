//! Admission records: which local records a trust policy admitted.
//!
//! A store may be shared by engines with different policies (an untrusting
//! `pull`, then a trusting worker). A record the untrusting engine fetched or
//! imported must never be served as a local hit by the trusting one, so a
//! trusting engine serves a record only when the store says it was admitted
//! on a basis this engine accepts:
//!
//! - `minted`: this store minted it (a mint never crossed a trust boundary),
//! - `policy-<digest>`: an engine with exactly this policy (the digest of its
//!   `allowed_signers` and revoked-keys files, [`tcg_trust::TrustPolicy::digest_hex`])
//!   admitted it.
//!
//! A record with neither (fetched or imported without a policy, adopted, or
//! written by an older version) counts as admitted without a policy: a
//! trusting engine re-checks its local signature records against its policy
//! on first use and records the admission when one is trusted, or treats the
//! key as a miss. Layout (derived data, one object per record):
//!
//! `torch-compiled-graphs/v1/admissions/<key>/<envelope manifest hex>/<basis>`
//!
//! whose object is the CJ of
//! `{"basis":…,"format":1,"key":…,"manifest":"sha256:…","type":"torch-compiled-graphs.admission"}`,
//! compared byte for byte when read, so a ref re-pointed at another object
//! admits nothing. Admission is keyed by the envelope manifest, that is by
//! exact bytes: the same bytes stay admitted whoever stores them again.

use tcg_cas::{CasOutcome, Digest, Lease, Target};
use tcg_cj::{Map, Value};

use super::{store_err, Engine};
use crate::artifact::{read_metadata_member, validate_metadata};
use crate::Result;

/// Prefix of the admission refs (derived data of the local store).
pub const ADMISSION_REF_PREFIX: &str = "torch-compiled-graphs/v1/admissions/";

/// Admission records are tiny; anything longer is not one.
const MAX_RECORD_BYTES: u64 = 4096;

/// On what basis a record was admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Basis {
    /// Minted by this store.
    Minted,
    /// Admitted under the policy with this digest (64 hex).
    Policy(String),
}

impl Basis {
    /// The last component of the admission ref.
    pub fn name(&self) -> String {
        match self {
            Basis::Minted => "minted".into(),
            Basis::Policy(d) => format!("policy-{d}"),
        }
    }
}

/// The admission ref of (key, envelope manifest, basis).
pub fn admission_ref(key: &str, manifest: &Digest, basis: &Basis) -> String {
    format!(
        "{ADMISSION_REF_PREFIX}{key}/{}/{}",
        manifest.to_hex(),
        basis.name()
    )
}

fn record_bytes(key: &str, manifest: &Digest, basis: &Basis) -> Vec<u8> {
    let mut o = Map::new();
    o.insert("basis".into(), Value::Str(basis.name()));
    o.insert("format".into(), Value::Int(1));
    o.insert("key".into(), Value::Str(key.into()));
    o.insert("manifest".into(), Value::Str(manifest.to_prefixed()));
    o.insert(
        "type".into(),
        Value::Str("torch-compiled-graphs.admission".into()),
    );
    tcg_cj::to_canonical(&Value::Object(o)).expect("an admission record is plain strings")
}

impl Engine {
    /// Record that (key, manifest) was admitted on `basis`. Create-only; a
    /// ref that already names the right record is fine, one that names
    /// anything else is replaced (it admitted nothing).
    pub(crate) fn record_admission(
        &self,
        lease: &Lease,
        key: &str,
        manifest: &Digest,
        basis: &Basis,
    ) -> Result<()> {
        let name = admission_ref(key, manifest, basis);
        let digest = self
            .store
            .put_bytes(lease, &record_bytes(key, manifest, basis))
            .map_err(store_err)?;
        let desired = Target::object(digest);
        let mut current = None;
        loop {
            match self
                .store
                .compare_and_swap(&name, current.as_ref(), Some(&desired))
                .map_err(store_err)?
            {
                CasOutcome::Matched | CasOutcome::AlreadyEqual => return Ok(()),
                CasOutcome::Conflict(c) => current = c,
            }
        }
    }

    /// Whether the store holds a valid admission of (key, manifest) on `basis`.
    pub(crate) fn has_admission(
        &self,
        lease: &Lease,
        key: &str,
        manifest: &Digest,
        basis: &Basis,
    ) -> Result<bool> {
        let name = admission_ref(key, manifest, basis);
        let target = match self.store.get_ref(&name) {
            Ok(Some(t)) => t,
            Ok(None) => return Ok(false),
            Err(e @ tcg_cas::StoreError::Io { .. }) => return Err(store_err(e)),
            Err(_) => return Ok(false),
        };
        match self
            .store
            .read_object(lease, &target.digest, MAX_RECORD_BYTES)
        {
            Ok(bytes) => Ok(bytes == record_bytes(key, manifest, basis)),
            Err(e @ tcg_cas::StoreError::Io { .. }) => Err(store_err(e)),
            Err(_) => Ok(false),
        }
    }

    /// Whether this engine may serve the local record `manifest` of `key`.
    /// Without a policy: always. With one: when the store minted it, when
    /// this exact policy admitted it before, or when its local signature
    /// records admit it now (then the admission is recorded). A record whose
    /// subject cannot be read is not admitted.
    pub(crate) fn admits_stored(
        &self,
        lease: &Lease,
        key: &str,
        manifest: &Digest,
    ) -> Result<bool> {
        let Some(policy) = self.trust.policy() else {
            return Ok(true);
        };
        let basis = Basis::Policy(policy.digest_hex());
        if self.has_admission(lease, key, manifest, &Basis::Minted)?
            || self.has_admission(lease, key, manifest, &basis)?
        {
            return Ok(true);
        }
        let Ok(m) = self.store.load_manifest(lease, manifest) else {
            return Ok(false);
        };
        let md = match self.store.open_file(lease, manifest, true) {
            Ok(reader) => {
                match read_metadata_member(reader).and_then(|b| validate_metadata(&b, None)) {
                    Ok(md) => md,
                    Err(_) => return Ok(false),
                }
            }
            Err(e @ tcg_cas::StoreError::Io { .. }) => return Err(store_err(e)),
            Err(_) => return Ok(false),
        };
        if md.key() != key {
            return Ok(false);
        }
        let subject = super::subject_of(&md, &m.file_digest);
        let entries: Vec<_> = self
            .signatures(&subject)?
            .into_iter()
            .map(|(e, _)| e)
            .collect();
        if policy
            .admit(&entries, &subject, tcg_trust::unix_now())
            .is_err()
        {
            return Ok(false);
        }
        // Best effort: without the record the next use checks again.
        let _ = self.record_admission(lease, key, manifest, &basis);
        Ok(true)
    }
}
