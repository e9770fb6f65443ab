//! The trust policy: which signatures admit an artifact.

use std::path::Path;

use crate::allowed::{match_pattern_list, AllowedSigners, RevokedKeys};
use crate::signature::{SignedStatement, VerifiedSignature};
use crate::statement::Subject;
use crate::{Result, TrustError, NAMESPACE};

/// An `allowed_signers` file and an optional revoked-keys file.
#[derive(Debug, Clone)]
pub struct TrustPolicy {
    allowed: AllowedSigners,
    revoked: RevokedKeys,
}

/// The signature that admitted an artifact.
#[derive(Debug, Clone)]
pub struct Admitted {
    /// The verified signature.
    pub signature: VerifiedSignature,
    /// The `allowed_signers` line that trusted it.
    pub line: usize,
}

/// Check each entry cryptographically and that it names `subject`; keep the
/// verdict per entry (used to carry only meaningful signatures).
pub fn verify_entries(
    entries: &[SignedStatement],
    subject: &Subject,
) -> Vec<Result<VerifiedSignature>> {
    entries
        .iter()
        .map(|e| {
            let v = e.verify()?;
            v.statement.check_binds(subject)?;
            Ok(v)
        })
        .collect()
}

impl TrustPolicy {
    /// Load the policy files.
    pub fn load(allowed_signers: &Path, revoked: Option<&Path>) -> Result<TrustPolicy> {
        Ok(TrustPolicy {
            allowed: AllowedSigners::load(allowed_signers)?,
            revoked: match revoked {
                Some(p) => RevokedKeys::load(p)?,
                None => RevokedKeys::default(),
            },
        })
    }

    /// A policy from parsed parts.
    pub fn new(allowed: AllowedSigners, revoked: RevokedKeys) -> TrustPolicy {
        TrustPolicy { allowed, revoked }
    }

    /// The `allowed_signers` file.
    pub fn allowed(&self) -> &AllowedSigners {
        &self.allowed
    }

    /// The policy's digest: hex SHA-256 of a framing of the exact bytes of
    /// its `allowed_signers` file and of its revoked-keys file (if any). Two
    /// engines with the same files have the same digest; any edit to either
    /// file (a key revoked, a signer added) changes it. A store keys its
    /// admission records by this digest.
    pub fn digest_hex(&self) -> String {
        let text = format!(
            "torch-compiled-graphs.policy/1\nallowed_signers {}\nrevoked_keys {}\n",
            self.allowed.digest,
            self.revoked.digest().unwrap_or("-")
        );
        crate::allowed::sha256_hex(text.as_bytes())
    }

    /// Whether one verified signature is trusted at `now` (Unix seconds):
    /// not revoked; a line with its key whose principals match the
    /// statement's producer, whose `namespaces` admit ours, and whose validity
    /// window holds both `now` and the signing time.
    pub fn trust(&self, v: &VerifiedSignature, now: i64) -> Result<usize> {
        let key = v.public_key.key_data();
        let who = format!("{} ({})", v.fingerprint, v.statement.producer);
        if self.revoked.contains(key) {
            return Err(TrustError::Revoked(format!("signer {who} is revoked")));
        }
        let lines: Vec<_> = self
            .allowed
            .signers
            .iter()
            .filter(|s| &s.key == key)
            .collect();
        if lines.is_empty() {
            return Err(TrustError::UntrustedSigner(format!(
                "signer {who} is not in {}",
                self.allowed.path.display()
            )));
        }
        let mut best: Option<TrustError> = None;
        for line in lines {
            let refusal = if !match_pattern_list(&v.statement.producer, &line.principals) {
                TrustError::UntrustedSigner(format!(
                    "signer {who}: line {} of {} does not allow principal {:?}",
                    line.line,
                    self.allowed.path.display(),
                    v.statement.producer
                ))
            } else if line
                .namespaces
                .as_deref()
                .is_some_and(|ns| !match_pattern_list(NAMESPACE, ns))
            {
                TrustError::Namespace(format!(
                    "signer {who}: line {} of {} does not allow namespace {NAMESPACE}",
                    line.line,
                    self.allowed.path.display()
                ))
            } else if let Some(t) = line
                .valid_after
                .filter(|t| now < *t || v.statement.time < *t)
            {
                TrustError::Expired(format!(
                    "signer {who} is not valid before {t} (line {} of {})",
                    line.line,
                    self.allowed.path.display()
                ))
            } else if let Some(t) = line
                .valid_before
                .filter(|t| now > *t || v.statement.time > *t)
            {
                TrustError::Expired(format!(
                    "signer {who} expired at {t} (line {} of {})",
                    line.line,
                    self.allowed.path.display()
                ))
            } else {
                return Ok(line.line);
            };
            if best.as_ref().is_none_or(|b| refusal.rank() > b.rank()) {
                best = Some(refusal);
            }
        }
        Err(best.expect("at least one line"))
    }

    /// Admit `subject` if one of `entries` is a valid signature of a
    /// statement about it by a trusted signer. Otherwise the most telling
    /// refusal: `trust.unsigned` when there is no signature at all.
    pub fn admit(
        &self,
        entries: &[SignedStatement],
        subject: &Subject,
        now: i64,
    ) -> Result<Admitted> {
        if entries.is_empty() {
            return Err(TrustError::Unsigned(format!(
                "compiled graph {} has no signature, and a trust policy ({}) is set",
                subject.key,
                self.allowed.path.display()
            )));
        }
        let mut best: Option<TrustError> = None;
        for verdict in verify_entries(entries, subject) {
            let refusal = match verdict.and_then(|v| self.trust(&v, now).map(|line| (v, line))) {
                Ok((signature, line)) => return Ok(Admitted { signature, line }),
                Err(e) => e,
            };
            if best.as_ref().is_none_or(|b| refusal.rank() > b.rank()) {
                best = Some(refusal);
            }
        }
        let err = best.expect("at least one entry");
        let prefix = format!("compiled graph {} is not admitted", subject.key);
        Err(match err {
            TrustError::Revoked(m) => TrustError::Revoked(format!("{prefix}: {m}")),
            TrustError::Expired(m) => TrustError::Expired(format!("{prefix}: {m}")),
            TrustError::Namespace(m) => TrustError::Namespace(format!("{prefix}: {m}")),
            TrustError::UntrustedSigner(m) => TrustError::UntrustedSigner(format!("{prefix}: {m}")),
            TrustError::StatementMismatch(m) => {
                TrustError::StatementMismatch(format!("{prefix}: {m}"))
            }
            TrustError::BadSignature(m) => TrustError::BadSignature(format!("{prefix}: {m}")),
            other => other,
        })
    }
}
