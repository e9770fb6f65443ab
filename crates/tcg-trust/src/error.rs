//! The error type of `tcg-trust`: one variant per refusal, each with a stable code.

use std::path::PathBuf;

/// A trust refusal or a configuration error of the trust layer.
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    /// No signature accompanies an artifact that the policy must admit.
    #[error("{0}")]
    Unsigned(String),
    /// A valid signature, but by a key (or for a principal) the allowed signers do not list.
    #[error("{0}")]
    UntrustedSigner(String),
    /// The signature does not verify over its statement, or is malformed.
    #[error("{0}")]
    BadSignature(String),
    /// The signature's namespace is not `torch-compiled-graphs`, or the signer's line excludes it.
    #[error("{0}")]
    Namespace(String),
    /// The signer's `valid-after` / `valid-before` window excludes now or the signing time.
    #[error("{0}")]
    Expired(String),
    /// The signer's key is listed in the revoked-keys file.
    #[error("{0}")]
    Revoked(String),
    /// A valid statement, but for another artifact (key, envelope digest or toolchain).
    #[error("{0}")]
    StatementMismatch(String),
    /// An `allowed_signers` or revoked-keys file cannot be parsed.
    #[error("{path}:{line}: {message}")]
    AllowedSignersInvalid {
        /// The file.
        path: PathBuf,
        /// The 1-based line.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// `cert-authority` lines are not supported.
    #[error(
        "{path}:{line}: cert-authority lines are not supported (list the signing keys themselves)"
    )]
    CertAuthorityUnsupported {
        /// The file.
        path: PathBuf,
        /// The 1-based line.
        line: usize,
    },
    /// A signatures document (`.sig` file or stored record) is malformed.
    #[error("{0}")]
    SignaturesInvalid(String),
    /// A signing key file cannot be used (unreadable, encrypted, not ed25519, too open).
    #[error("{0}")]
    SigningKeyInvalid(String),
    /// Reading a trust file failed.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error, with its errno.
        source: std::io::Error,
    },
}

impl TrustError {
    /// The stable code, `trust.<slug>` (or `io.error`).
    pub fn code(&self) -> &'static str {
        match self {
            TrustError::Unsigned(_) => "trust.unsigned",
            TrustError::UntrustedSigner(_) => "trust.untrusted_signer",
            TrustError::BadSignature(_) => "trust.bad_signature",
            TrustError::Namespace(_) => "trust.namespace",
            TrustError::Expired(_) => "trust.expired",
            TrustError::Revoked(_) => "trust.revoked",
            TrustError::StatementMismatch(_) => "trust.statement_mismatch",
            TrustError::AllowedSignersInvalid { .. } => "trust.allowed_signers_invalid",
            TrustError::CertAuthorityUnsupported { .. } => "trust.cert_authority_unsupported",
            TrustError::SignaturesInvalid(_) => "trust.signatures_invalid",
            TrustError::SigningKeyInvalid(_) => "trust.signing_key_invalid",
            TrustError::Io { .. } => "io.error",
        }
    }

    /// Whether this is a verdict on an artifact's signatures (as opposed to a
    /// configuration or I/O failure): such refusals make `ensure` compile locally.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            TrustError::Unsigned(_)
                | TrustError::UntrustedSigner(_)
                | TrustError::BadSignature(_)
                | TrustError::Namespace(_)
                | TrustError::Expired(_)
                | TrustError::Revoked(_)
                | TrustError::StatementMismatch(_)
                | TrustError::SignaturesInvalid(_)
        )
    }

    /// Rank used to report the most telling refusal among several signatures.
    pub(crate) fn rank(&self) -> u8 {
        match self {
            TrustError::Revoked(_) => 7,
            TrustError::Expired(_) => 6,
            TrustError::Namespace(_) => 5,
            TrustError::UntrustedSigner(_) => 4,
            TrustError::StatementMismatch(_) => 3,
            TrustError::BadSignature(_) => 2,
            TrustError::SignaturesInvalid(_) => 1,
            _ => 0,
        }
    }
}

/// The result type of `tcg-trust`.
pub type Result<T, E = TrustError> = std::result::Result<T, E>;
