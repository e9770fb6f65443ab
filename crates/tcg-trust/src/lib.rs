//! Signed provenance for torch-compiled-graphs artifacts.
//!
//! A signer signs a canonical [`Statement`] (CJ) binding a compiled-graph key,
//! the envelope's SHA-256, the toolchain axis, the producer, the signer's key
//! and the time, with an SSH signature (the `SSHSIG` format of
//! `ssh-keygen -Y sign` and git) in the namespace [`NAMESPACE`]. Trust is an
//! OpenSSH `allowed_signers` file, optionally with a revoked-keys file
//! ([`TrustPolicy`]). Signatures travel as [`SignedStatement`]s: the exact
//! statement bytes plus the armored signature, so `ssh-keygen -Y verify`
//! checks them unchanged.
//!
//! This crate knows nothing about stores or envelopes: the engine computes
//! the [`Subject`] of an artifact from verified bytes and asks the policy.
#![deny(missing_docs)]

mod allowed;
mod error;
mod policy;
mod signature;
mod statement;

pub use allowed::{match_pattern_list, parse_time, AllowedSigner, AllowedSigners, RevokedKeys};
pub use error::{Result, TrustError};
pub use policy::{verify_entries, Admitted, TrustPolicy};
pub use signature::{
    document_bytes, fingerprint_hex, openssh_public, parse_document, read_small_file,
    SignedStatement, Signer, VerifiedSignature, MAX_DOCUMENT_BYTES, MAX_SIGNATURES,
    SIGNATURES_TYPE,
};
pub use ssh_key::PublicKey;
pub use statement::{Statement, Subject, MAX_STATEMENT_BYTES, STATEMENT_FORMAT, STATEMENT_TYPE};

/// The SSHSIG namespace of every signature (wire identity).
pub const NAMESPACE: &str = "torch-compiled-graphs";

/// Environment variable naming the OpenSSH private key a mint signs with.
pub const ENV_SIGNING_KEY: &str = "TORCH_COMPILED_GRAPHS_SIGNING_KEY";
/// Environment variable naming the `allowed_signers` file of the trust policy.
pub const ENV_TRUST: &str = "TORCH_COMPILED_GRAPHS_TRUST";
/// Environment variable naming a revoked-keys file.
pub const ENV_REVOKED_KEYS: &str = "TORCH_COMPILED_GRAPHS_REVOKED_KEYS";
/// Environment variable overriding the producer named in statements.
pub const ENV_PRODUCER: &str = "TORCH_COMPILED_GRAPHS_PRODUCER";

/// Seconds since the Unix epoch, now.
pub fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}
