//! SHA-256 digests as store names.

use std::fmt;

use sha2::{Digest as _, Sha256};

/// A SHA-256 digest, the name of a store object.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Digest {
        Digest(Sha256::digest(bytes).into())
    }

    /// Parse exactly 64 lowercase hex characters (uppercase is refused).
    pub fn from_hex(s: &str) -> Option<Digest> {
        if !tcg_cj::is_hex(s, 64) {
            return None;
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).ok()?;
        Some(Digest(out))
    }

    /// Parse `"sha256:<64 hex>"`.
    pub fn from_prefixed(s: &str) -> Option<Digest> {
        s.strip_prefix("sha256:").and_then(Digest::from_hex)
    }

    /// 64 lowercase hex characters.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// `"sha256:<64 hex>"`.
    pub fn to_prefixed(&self) -> String {
        format!("sha256:{}", self.to_hex())
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.to_hex())
    }
}

/// `hex64(SHA-256(UTF-8 name))`, the file name of refs and mint locks.
pub fn name_hash(name: &str) -> String {
    Digest::of(name.as_bytes()).to_hex()
}

/// A streaming SHA-256.
#[derive(Clone, Default)]
pub(crate) struct Hasher(Sha256);

impl Hasher {
    pub(crate) fn from_state(state: Sha256) -> Hasher {
        Hasher(state)
    }
    pub(crate) fn update(&mut self, b: &[u8]) {
        self.0.update(b);
    }
    pub(crate) fn finish(self) -> Digest {
        Digest(self.0.finalize().into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_parse_only_lowercase_64_hex_with_the_sha256_prefix_where_asked() {
        let h = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert_eq!(Digest::of(b"abc").to_hex(), h);
        assert_eq!(Digest::from_hex(h), Some(Digest::of(b"abc")));
        assert_eq!(
            Digest::from_prefixed(&format!("sha256:{h}")),
            Some(Digest::of(b"abc"))
        );
        assert_eq!(Digest::from_hex(&h.to_uppercase()), None);
        assert_eq!(Digest::from_hex(&h[1..]), None);
        assert_eq!(Digest::from_prefixed(h), None);
        assert_eq!(Digest::from_prefixed(&format!("SHA256:{h}")), None);
        assert_eq!(name_hash("abc"), h);
    }
}
