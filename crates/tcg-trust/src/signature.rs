//! SSHSIG signatures over statements, the signing key, and the signatures
//! document (`ENVELOPE.sig` and each stored signature record).

use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use ssh_key::{HashAlg, LineEnding, PrivateKey, PublicKey, SshSig};
use tcg_cj::{Map, Value};

use crate::statement::Statement;
use crate::{Result, TrustError, NAMESPACE};

/// The `type` member of a signatures document (wire identity).
pub const SIGNATURES_TYPE: &str = "torch-compiled-graphs.signatures";

/// At most this many signatures per document.
pub const MAX_SIGNATURES: usize = 64;

/// A signatures document (or a signing key file) larger than this is refused.
pub const MAX_DOCUMENT_BYTES: u64 = 1 << 20;

/// One signature: the exact statement bytes and the armored SSHSIG over them
/// (what `ssh-keygen -Y sign -n torch-compiled-graphs` writes for a file
/// holding those bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedStatement {
    /// The statement bytes (canonical JSON, UTF-8).
    pub statement: String,
    /// The armored signature, `-----BEGIN SSH SIGNATURE-----` … with a final LF.
    pub sshsig: String,
}

/// A signature that verified cryptographically, with its parsed statement.
#[derive(Debug, Clone)]
pub struct VerifiedSignature {
    /// The statement.
    pub statement: Statement,
    /// The signer's key.
    pub public_key: PublicKey,
    /// `SHA256:…` fingerprint of the signer's key, as `ssh-keygen -l` prints it.
    pub fingerprint: String,
}

/// The public key in OpenSSH form without its comment.
pub fn openssh_public(key: &PublicKey) -> String {
    let mut k = key.clone();
    k.set_comment("");
    k.to_openssh()
        .expect("an ed25519 public key encodes")
        .trim()
        .to_string()
}

/// The hex of the SHA-256 fingerprint of a key (names a signer in ref paths).
pub fn fingerprint_hex(key: &PublicKey) -> String {
    hex::encode(key.fingerprint(HashAlg::Sha256).as_bytes())
}

impl SignedStatement {
    /// Check the signature over the statement: armor, namespace, ed25519,
    /// the cryptographic signature, then the statement's own strict form and
    /// that it names the key that signed it. Says nothing about trust.
    pub fn verify(&self) -> Result<VerifiedSignature> {
        let sig = SshSig::from_pem(self.sshsig.as_bytes())
            .map_err(|e| TrustError::BadSignature(format!("unreadable SSH signature: {e}")))?;
        if sig.namespace() != NAMESPACE {
            return Err(TrustError::Namespace(format!(
                "signature namespace is {:?}, not {NAMESPACE:?}",
                sig.namespace()
            )));
        }
        if sig.algorithm() != ssh_key::Algorithm::Ed25519 {
            return Err(TrustError::BadSignature(format!(
                "signature algorithm {} is not ssh-ed25519",
                sig.algorithm()
            )));
        }
        let public_key = PublicKey::new(sig.public_key().clone(), "");
        public_key
            .verify(NAMESPACE, self.statement.as_bytes(), &sig)
            .map_err(|e| {
                TrustError::BadSignature(format!(
                    "signature by {} does not verify over its statement: {e}",
                    public_key.fingerprint(HashAlg::Sha256)
                ))
            })?;
        let statement = Statement::parse(self.statement.as_bytes())?;
        if statement.signer != openssh_public(&public_key) {
            return Err(TrustError::BadSignature(
                "the statement names another signer than the key that signed it".into(),
            ));
        }
        Ok(VerifiedSignature {
            statement,
            fingerprint: public_key.fingerprint(HashAlg::Sha256).to_string(),
            public_key,
        })
    }

    fn to_value(&self) -> Value {
        let mut m = Map::new();
        m.insert("sshsig".into(), self.sshsig.clone().into());
        m.insert("statement".into(), self.statement.clone().into());
        Value::Object(m)
    }

    fn from_value(v: &Value) -> Result<SignedStatement> {
        let invalid = |why: &str| TrustError::SignaturesInvalid(format!("signature entry {why}"));
        let m = v.as_object().ok_or_else(|| invalid("is not an object"))?;
        if m.keys().map(String::as_str).ne(["sshsig", "statement"]) {
            return Err(invalid("must have exactly sshsig and statement"));
        }
        let text = |k: &str| {
            m[k].as_str()
                .map(str::to_owned)
                .ok_or_else(|| invalid("members must be strings"))
        };
        Ok(SignedStatement {
            sshsig: text("sshsig")?,
            statement: text("statement")?,
        })
    }

    /// CJ bytes of one entry (the stored form of a signature record).
    pub fn to_bytes(&self) -> Vec<u8> {
        tcg_cj::to_canonical(&self.to_value()).expect("strings encode")
    }

    /// Parse one stored entry strictly.
    pub fn parse(bytes: &[u8]) -> Result<SignedStatement> {
        let v = parse_canonical(bytes)?;
        SignedStatement::from_value(&v)
    }
}

fn parse_canonical(bytes: &[u8]) -> Result<Value> {
    if bytes.len() as u64 > MAX_DOCUMENT_BYTES {
        return Err(TrustError::SignaturesInvalid(format!(
            "signatures document of {} bytes exceeds {MAX_DOCUMENT_BYTES}",
            bytes.len()
        )));
    }
    let v = tcg_cj::parse_strict(bytes)
        .map_err(|e| TrustError::SignaturesInvalid(format!("not strict JSON: {e}")))?;
    if tcg_cj::to_canonical(&v).ok().as_deref() != Some(bytes) {
        return Err(TrustError::SignaturesInvalid("not canonical JSON".into()));
    }
    Ok(v)
}

/// The signatures document written beside an exported envelope:
/// CJ of `{"format":1,"signatures":[entry…],"type":"torch-compiled-graphs.signatures"}`
/// followed by one LF.
pub fn document_bytes(entries: &[SignedStatement]) -> Vec<u8> {
    let mut m = Map::new();
    m.insert("format".into(), Value::Int(1));
    m.insert(
        "signatures".into(),
        Value::Array(entries.iter().map(SignedStatement::to_value).collect()),
    );
    m.insert("type".into(), SIGNATURES_TYPE.into());
    let mut out = tcg_cj::to_canonical(&Value::Object(m)).expect("strings encode");
    out.push(b'\n');
    out
}

/// Parse a signatures document strictly (the trailing LF is required).
pub fn parse_document(bytes: &[u8]) -> Result<Vec<SignedStatement>> {
    let body = bytes
        .strip_suffix(b"\n")
        .ok_or_else(|| TrustError::SignaturesInvalid("the document must end with one LF".into()))?;
    let v = parse_canonical(body)?;
    let m = v
        .as_object()
        .ok_or_else(|| TrustError::SignaturesInvalid("not an object".into()))?;
    if m.keys()
        .map(String::as_str)
        .ne(["format", "signatures", "type"])
        || m["type"].as_str() != Some(SIGNATURES_TYPE)
        || m["format"].as_i64() != Some(1)
    {
        return Err(TrustError::SignaturesInvalid(
            "not a format 1 torch-compiled-graphs signatures document".into(),
        ));
    }
    let list = m["signatures"]
        .as_array()
        .ok_or_else(|| TrustError::SignaturesInvalid("signatures is not a list".into()))?;
    if list.len() > MAX_SIGNATURES {
        return Err(TrustError::SignaturesInvalid(format!(
            "{} signatures exceed the limit of {MAX_SIGNATURES}",
            list.len()
        )));
    }
    list.iter().map(SignedStatement::from_value).collect()
}

/// Read a small file the caller named (a policy, a key, a `.sig` beside an
/// envelope), refusing anything but a regular file of at most
/// [`MAX_DOCUMENT_BYTES`]. Symlinks are followed: these are the operator's
/// paths, not store paths (a Kubernetes ConfigMap, for one, mounts files as
/// symlinks); `O_NONBLOCK` keeps a FIFO from hanging the open.
pub fn read_small_file(path: &Path) -> Result<Vec<u8>> {
    let io = |source| TrustError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(io)?;
    let md = f.metadata().map_err(io)?;
    if !md.file_type().is_file() {
        return Err(io(std::io::Error::other("not a regular file")));
    }
    if md.size() > MAX_DOCUMENT_BYTES {
        return Err(io(std::io::Error::other(format!(
            "larger than {MAX_DOCUMENT_BYTES} bytes"
        ))));
    }
    let mut out = Vec::new();
    (&mut f)
        .take(MAX_DOCUMENT_BYTES + 1)
        .read_to_end(&mut out)
        .map_err(io)?;
    if out.len() as u64 > MAX_DOCUMENT_BYTES {
        return Err(io(std::io::Error::other("grew while read")));
    }
    Ok(out)
}

/// An ed25519 signing key loaded from an OpenSSH private key file.
pub struct Signer {
    key: PrivateKey,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer")
            .field("public", &openssh_public(self.key.public_key()))
            .finish()
    }
}

impl Signer {
    /// Load an unencrypted OpenSSH ed25519 private key. Like `ssh-keygen`,
    /// refuse a file that group or others can read.
    pub fn from_file(path: &Path) -> Result<Signer> {
        let invalid = |why: String| {
            TrustError::SigningKeyInvalid(format!("signing key {}: {why}", path.display()))
        };
        let md = std::fs::metadata(path).map_err(|source| TrustError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        if md.mode() & 0o077 != 0 {
            return Err(invalid(format!(
                "permissions {:04o} are too open (chmod 600)",
                md.mode() & 0o7777
            )));
        }
        let bytes = read_small_file(path)?;
        let text = String::from_utf8(bytes).map_err(|_| invalid("not UTF-8".into()))?;
        Signer::from_openssh(&text).map_err(|e| match e {
            TrustError::SigningKeyInvalid(m) => invalid(m),
            other => other,
        })
    }

    /// Parse an unencrypted OpenSSH ed25519 private key.
    pub fn from_openssh(text: &str) -> Result<Signer> {
        let key = PrivateKey::from_openssh(text).map_err(|e| {
            TrustError::SigningKeyInvalid(format!("not an OpenSSH private key: {e}"))
        })?;
        if key.is_encrypted() {
            return Err(TrustError::SigningKeyInvalid(
                "the key is passphrase-protected; use an unencrypted key file for unattended signing"
                    .into(),
            ));
        }
        if key.algorithm() != ssh_key::Algorithm::Ed25519 {
            return Err(TrustError::SigningKeyInvalid(format!(
                "the key is {}, only ssh-ed25519 is supported",
                key.algorithm()
            )));
        }
        Ok(Signer { key })
    }

    /// The public key.
    pub fn public_key(&self) -> &PublicKey {
        self.key.public_key()
    }

    /// The key file's comment (often `user@host`), used as the default producer.
    pub fn comment(&self) -> &str {
        self.key.comment()
    }

    /// Sign a statement (SHA-512 message hash, as `ssh-keygen -Y sign` uses).
    pub fn sign(&self, statement: &Statement) -> Result<SignedStatement> {
        let bytes = statement.to_bytes();
        let sig = self
            .key
            .sign(NAMESPACE, HashAlg::Sha512, &bytes)
            .map_err(|e| TrustError::SigningKeyInvalid(format!("cannot sign: {e}")))?;
        let sshsig = sig
            .to_pem(LineEnding::LF)
            .map_err(|e| TrustError::SigningKeyInvalid(format!("cannot encode signature: {e}")))?;
        let mut sshsig = sshsig;
        if !sshsig.ends_with('\n') {
            sshsig.push('\n');
        }
        Ok(SignedStatement {
            statement: String::from_utf8(bytes).expect("CJ is ASCII"),
            sshsig,
        })
    }

    /// A statement about `subject` by this signer, timed `time`.
    pub fn statement(&self, subject: &crate::Subject, producer: &str, time: i64) -> Statement {
        Statement {
            key: subject.key.clone(),
            envelope_sha256: subject.envelope_sha256.clone(),
            toolchain: subject.toolchain.clone(),
            producer: producer.to_string(),
            signer: openssh_public(self.public_key()),
            time,
        }
    }
}
