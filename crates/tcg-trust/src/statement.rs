//! The signed statement: canonical JSON binding a signer to one artifact.

use tcg_cj::{Map, Value};

use crate::{Result, TrustError};

/// The `type` member of every statement (wire identity).
pub const STATEMENT_TYPE: &str = "torch-compiled-graphs.statement";

/// The statement format this crate writes and accepts.
pub const STATEMENT_FORMAT: i64 = 1;

/// Statements larger than this are refused before parsing.
pub const MAX_STATEMENT_BYTES: usize = 16 * 1024;

const MEMBERS: [&str; 8] = [
    "envelope_sha256",
    "format",
    "key",
    "producer",
    "signer",
    "time",
    "toolchain",
    "type",
];

/// What a signer asserts: "I produced (or vouch for) the envelope with this
/// SHA-256 as the compiled graph `key`, compiled by toolchain `toolchain`".
///
/// Its bytes are the CJ of the object with exactly the members
/// `envelope_sha256, format, key, producer, signer, time, toolchain, type`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Statement {
    /// The compiled-graph key the envelope states.
    pub key: String,
    /// SHA-256 of the whole envelope file, 64 lowercase hex.
    pub envelope_sha256: String,
    /// The toolchain axis (16 hex) recorded in the envelope's metadata.
    pub toolchain: String,
    /// Who produced it (matched against the principals of `allowed_signers`).
    pub producer: String,
    /// The signer's public key, OpenSSH form without comment (`ssh-ed25519 AAAA…`).
    pub signer: String,
    /// Signing time, Unix seconds.
    pub time: i64,
}

fn bad(why: impl std::fmt::Display) -> TrustError {
    TrustError::BadSignature(format!("the signed statement is malformed: {why}"))
}

impl Statement {
    /// The canonical bytes that are signed.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut m = Map::new();
        m.insert(
            "envelope_sha256".into(),
            self.envelope_sha256.clone().into(),
        );
        m.insert("format".into(), Value::Int(STATEMENT_FORMAT));
        m.insert("key".into(), self.key.clone().into());
        m.insert("producer".into(), self.producer.clone().into());
        m.insert("signer".into(), self.signer.clone().into());
        m.insert("time".into(), Value::Int(self.time));
        m.insert("toolchain".into(), self.toolchain.clone().into());
        m.insert("type".into(), STATEMENT_TYPE.into());
        tcg_cj::to_canonical(&Value::Object(m)).expect("a statement is strings and integers")
    }

    /// Parse statement bytes strictly: canonical CJ, exactly the members, the
    /// known type and format, well-formed digests and a non-negative time.
    pub fn parse(bytes: &[u8]) -> Result<Statement> {
        if bytes.len() > MAX_STATEMENT_BYTES {
            return Err(bad(format_args!("{} bytes", bytes.len())));
        }
        let value = tcg_cj::parse_strict(bytes).map_err(bad)?;
        let canonical = tcg_cj::to_canonical(&value).map_err(bad)?;
        if canonical != bytes {
            return Err(bad("not canonical JSON"));
        }
        let m = value.as_object().ok_or_else(|| bad("not an object"))?;
        let names: Vec<&str> = m.keys().map(String::as_str).collect();
        if names != MEMBERS {
            return Err(bad(format_args!("members {names:?}")));
        }
        let s = |k: &str| -> Result<String> {
            m[k].as_str()
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .ok_or_else(|| bad(format_args!("{k} is not a non-empty string")))
        };
        if s("type")? != STATEMENT_TYPE {
            return Err(bad("unknown type"));
        }
        if m["format"].as_i64() != Some(STATEMENT_FORMAT) {
            return Err(bad("unsupported format"));
        }
        let envelope_sha256 = s("envelope_sha256")?;
        if !tcg_cj::is_hex(&envelope_sha256, 64) {
            return Err(bad("envelope_sha256 is not 64 lowercase hex"));
        }
        let toolchain = s("toolchain")?;
        if !tcg_cj::is_hex(&toolchain, 16) {
            return Err(bad("toolchain is not 16 lowercase hex"));
        }
        let time = m["time"]
            .as_i64()
            .filter(|t| *t >= 0)
            .ok_or_else(|| bad("time is not a non-negative integer"))?;
        Ok(Statement {
            key: s("key")?,
            envelope_sha256,
            toolchain,
            producer: s("producer")?,
            signer: s("signer")?,
            time,
        })
    }

    /// `trust.statement_mismatch` unless the statement names this artifact.
    pub fn check_binds(&self, expected: &Subject) -> Result<()> {
        let mut wrong = Vec::new();
        if self.key != expected.key {
            wrong.push(format!("key {} (expected {})", self.key, expected.key));
        }
        if self.envelope_sha256 != expected.envelope_sha256 {
            wrong.push(format!(
                "envelope sha256 {} (expected {})",
                self.envelope_sha256, expected.envelope_sha256
            ));
        }
        if self.toolchain != expected.toolchain {
            wrong.push(format!(
                "toolchain {} (expected {})",
                self.toolchain, expected.toolchain
            ));
        }
        if wrong.is_empty() {
            Ok(())
        } else {
            Err(TrustError::StatementMismatch(format!(
                "the signature is for another artifact: {}",
                wrong.join(", ")
            )))
        }
    }
}

/// The artifact a signature must be about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subject {
    /// The compiled-graph key.
    pub key: String,
    /// SHA-256 of the envelope file (64 hex).
    pub envelope_sha256: String,
    /// The toolchain axis (16 hex).
    pub toolchain: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Statement {
        Statement {
            key: format!("cg-key-v1-{}", "a".repeat(56)),
            envelope_sha256: "b".repeat(64),
            toolchain: "c".repeat(16),
            producer: "ci@builder".into(),
            signer: "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB".into(),
            time: 1_764_500_000,
        }
    }

    #[test]
    fn statement_bytes_are_pinned_and_round_trip() {
        let s = sample();
        let bytes = s.to_bytes();
        assert_eq!(
            String::from_utf8(bytes.clone()).unwrap(),
            format!(
                "{{\"envelope_sha256\":\"{}\",\"format\":1,\"key\":\"cg-key-v1-{}\",\"producer\":\"ci@builder\",\"signer\":\"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB\",\"time\":1764500000,\"toolchain\":\"{}\",\"type\":\"torch-compiled-graphs.statement\"}}",
                "b".repeat(64),
                "a".repeat(56),
                "c".repeat(16)
            )
        );
        assert_eq!(Statement::parse(&bytes).unwrap(), s);
    }

    #[test]
    fn statement_parse_refuses_non_canonical_extra_and_malformed() {
        let good = String::from_utf8(sample().to_bytes()).unwrap();
        for bad in [
            good.replace("{\"envelope", "{ \"envelope"),
            good.replace("\"format\":1,", "\"format\":1,\"extra\":1,"),
            good.replace("\"format\":1", "\"format\":2"),
            good.replace("torch-compiled-graphs.statement", "other"),
            good.replace("1764500000", "-1"),
            good.replace(&"c".repeat(16), "C".repeat(16).as_str()),
            good.replace(&"b".repeat(64), "b".repeat(63).as_str()),
            "[]".to_string(),
            "x".repeat(MAX_STATEMENT_BYTES + 1),
        ] {
            let err = Statement::parse(bad.as_bytes()).unwrap_err();
            assert_eq!(err.code(), "trust.bad_signature", "{bad}");
        }
    }

    #[test]
    fn check_binds_names_each_wrong_member() {
        let s = sample();
        let subject = Subject {
            key: s.key.clone(),
            envelope_sha256: "d".repeat(64),
            toolchain: s.toolchain.clone(),
        };
        let err = s.check_binds(&subject).unwrap_err();
        assert_eq!(err.code(), "trust.statement_mismatch");
        assert!(err.to_string().contains("envelope sha256"));
    }
}
