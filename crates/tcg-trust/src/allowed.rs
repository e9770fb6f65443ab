//! OpenSSH `allowed_signers` (ssh-keygen(1), "ALLOWED SIGNERS") and a
//! revoked-keys file (one public key per line, as `ssh-keygen -Y verify -r`
//! also accepts).

use std::path::{Path, PathBuf};

use ssh_key::public::KeyData;
use ssh_key::PublicKey;

use crate::signature::read_small_file;
use crate::{Result, TrustError};

/// One usable line of an `allowed_signers` file.
#[derive(Debug, Clone)]
pub struct AllowedSigner {
    /// The comma-separated principal patterns, verbatim.
    pub principals: String,
    /// `namespaces="…"` patterns, if the line restricts them.
    pub namespaces: Option<String>,
    /// `valid-after`, Unix seconds.
    pub valid_after: Option<i64>,
    /// `valid-before`, Unix seconds.
    pub valid_before: Option<i64>,
    /// The key.
    pub key: KeyData,
    /// The 1-based line in its file.
    pub line: usize,
}

/// A parsed `allowed_signers` file. Lines with key types other than
/// `ssh-ed25519` are kept out (they can never sign an artifact here).
#[derive(Debug, Clone)]
pub struct AllowedSigners {
    /// Where it was read from.
    pub path: PathBuf,
    /// The ed25519 lines.
    pub signers: Vec<AllowedSigner>,
    /// Hex SHA-256 of the file's exact text (part of the policy's digest).
    pub digest: String,
}

fn invalid(path: &Path, line: usize, message: impl Into<String>) -> TrustError {
    TrustError::AllowedSignersInvalid {
        path: path.to_path_buf(),
        line,
        message: message.into(),
    }
}

/// Split off one token: a `"quoted string"` (quotes removed) or a run of
/// non-blank characters.
fn token(s: &str) -> Option<(String, &str)> {
    let s = s.trim_start_matches([' ', '\t']);
    if s.is_empty() {
        return None;
    }
    if let Some(rest) = s.strip_prefix('"') {
        let end = rest.find('"')?;
        return Some((rest[..end].to_string(), &rest[end + 1..]));
    }
    let end = s.find([' ', '\t']).unwrap_or(s.len());
    Some((s[..end].to_string(), &s[end..]))
}

/// Split an option list at commas outside double quotes, up to the first blank
/// outside quotes. Returns the options and the rest of the line.
fn options(s: &str) -> Option<(Vec<String>, &str)> {
    let s = s.trim_start_matches([' ', '\t']);
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for (i, c) in s.char_indices() {
        match c {
            '"' => {
                quoted = !quoted;
                cur.push(c);
            }
            ',' if !quoted => out.push(std::mem::take(&mut cur)),
            ' ' | '\t' if !quoted => {
                out.push(cur);
                return Some((out, &s[i..]));
            }
            _ => cur.push(c),
        }
    }
    if quoted {
        return None;
    }
    out.push(cur);
    Some((out, ""))
}

fn unquote(v: &str) -> &str {
    v.strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or(v)
}

/// `YYYYMMDD[HHMM[SS]]Z` as Unix seconds. The `Z` (UTC) is required: OpenSSH
/// reads a time without it in the verifier's local zone, which would make the
/// same file mean different things on different hosts.
pub fn parse_time(v: &str) -> std::result::Result<i64, String> {
    let digits = v
        .strip_suffix('Z')
        .or_else(|| v.strip_suffix('z'))
        .ok_or_else(|| format!("time {v:?} must end with Z (UTC)"))?;
    if !digits.bytes().all(|b| b.is_ascii_digit()) || ![8, 12, 14].contains(&digits.len()) {
        return Err(format!("time {v:?} is not YYYYMMDD[HHMM[SS]]Z"));
    }
    let n = |a: usize, b: usize| digits[a..b].parse::<i64>().expect("digits");
    let (y, mo, d) = (n(0, 4), n(4, 6), n(6, 8));
    let (h, mi) = if digits.len() >= 12 {
        (n(8, 10), n(10, 12))
    } else {
        (0, 0)
    };
    let s = if digits.len() == 14 { n(12, 14) } else { 0 };
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || s > 60 {
        return Err(format!("time {v:?} is out of range"));
    }
    // Days from the civil date (proleptic Gregorian), H. Hinnant's algorithm.
    let y2 = if mo <= 2 { y - 1 } else { y };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Ok(days * 86_400 + h * 3600 + mi * 60 + s)
}

/// OpenSSH `match_pattern`: `*` and `?` wildcards.
fn glob(pattern: &[u8], s: &[u8]) -> bool {
    match pattern.split_first() {
        None => s.is_empty(),
        Some((b'*', rest)) => (0..=s.len()).any(|i| glob(rest, &s[i..])),
        Some((b'?', rest)) => !s.is_empty() && glob(rest, &s[1..]),
        Some((c, rest)) => s.first() == Some(c) && glob(rest, &s[1..]),
    }
}

/// OpenSSH `match_pattern_list`: a negated pattern that matches vetoes.
pub fn match_pattern_list(s: &str, list: &str) -> bool {
    let mut matched = false;
    for p in list.split(',') {
        match p.strip_prefix('!') {
            Some(neg) if glob(neg.as_bytes(), s.as_bytes()) => return false,
            Some(_) => {}
            None if glob(p.as_bytes(), s.as_bytes()) => matched = true,
            None => {}
        }
    }
    matched
}

fn is_key_type(t: &str) -> bool {
    t.starts_with("ssh-")
        || t.starts_with("ecdsa-")
        || t.starts_with("sk-")
        || t.starts_with("rsa-")
}

impl AllowedSigners {
    /// The hex SHA-256 fingerprints of the listed keys, each once, in file
    /// order: the signer prefixes a trusting fleet worker lists.
    pub fn fingerprints_hex(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for s in &self.signers {
            let fp = crate::fingerprint_hex(&PublicKey::new(s.key.clone(), ""));
            if !out.contains(&fp) {
                out.push(fp);
            }
        }
        out
    }

    /// Read and parse a file.
    pub fn load(path: &Path) -> Result<AllowedSigners> {
        let bytes = read_small_file(path)?;
        let text = std::str::from_utf8(&bytes).map_err(|_| invalid(path, 0, "not UTF-8"))?;
        AllowedSigners::parse(path, text)
    }

    /// Parse the text of a file named `path` (for messages).
    pub fn parse(path: &Path, text: &str) -> Result<AllowedSigners> {
        let mut signers = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line_no = i + 1;
            let line = raw.trim_start_matches([' ', '\t']);
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = |m: &str| invalid(path, line_no, m);
            let (principals, rest) = token(line).ok_or_else(|| bad("unterminated quote"))?;
            if principals.is_empty() {
                return Err(bad("empty principals"));
            }
            let (first, _) = token(rest).ok_or_else(|| bad("no key"))?;
            let (opts, rest) = if is_key_type(&first) {
                (Vec::new(), rest)
            } else {
                options(rest).ok_or_else(|| bad("unterminated quote in options"))?
            };
            let mut namespaces = None;
            let mut valid_after = None;
            let mut valid_before = None;
            for opt in &opts {
                let (name, value) = match opt.split_once('=') {
                    Some((n, v)) => (n.to_ascii_lowercase(), Some(unquote(v))),
                    None => (opt.to_ascii_lowercase(), None),
                };
                match (name.as_str(), value) {
                    ("cert-authority", None) => {
                        return Err(TrustError::CertAuthorityUnsupported {
                            path: path.to_path_buf(),
                            line: line_no,
                        })
                    }
                    ("namespaces", Some(v)) => namespaces = Some(v.to_string()),
                    ("valid-after", Some(v)) => {
                        valid_after = Some(parse_time(v).map_err(|m| bad(&m))?)
                    }
                    ("valid-before", Some(v)) => {
                        valid_before = Some(parse_time(v).map_err(|m| bad(&m))?)
                    }
                    _ => return Err(bad(&format!("unknown option {opt:?}"))),
                }
            }
            let (kind, rest) = token(rest).ok_or_else(|| bad("no key type"))?;
            let (blob, _comment) = token(rest).ok_or_else(|| bad("no key data"))?;
            if kind != "ssh-ed25519" {
                // Another key type cannot sign artifacts here; keep git's lines usable.
                continue;
            }
            let key = PublicKey::from_openssh(&format!("{kind} {blob}"))
                .map_err(|e| bad(&format!("bad ssh-ed25519 key: {e}")))?;
            signers.push(AllowedSigner {
                principals,
                namespaces,
                valid_after,
                valid_before,
                key: key.key_data().clone(),
                line: line_no,
            });
        }
        Ok(AllowedSigners {
            path: path.to_path_buf(),
            signers,
            digest: sha256_hex(text.as_bytes()),
        })
    }
}

/// A list of revoked public keys.
#[derive(Debug, Clone, Default)]
pub struct RevokedKeys {
    keys: Vec<KeyData>,
    /// Hex SHA-256 of the file's exact bytes; `None` without a file.
    digest: Option<String>,
}

pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest as _, Sha256};
    hex::encode(Sha256::digest(bytes))
}

impl RevokedKeys {
    /// Read a text file of public keys (`type base64 [comment]`, `#` comments).
    /// Binary KRLs are refused.
    pub fn load(path: &Path) -> Result<RevokedKeys> {
        let bytes = read_small_file(path)?;
        let text = std::str::from_utf8(&bytes)
            .map_err(|_| invalid(path, 0, "not UTF-8 (binary KRLs are not supported)"))?;
        let mut keys = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let key = PublicKey::from_openssh(line)
                .map_err(|e| invalid(path, i + 1, format!("not an OpenSSH public key: {e}")))?;
            keys.push(key.key_data().clone());
        }
        Ok(RevokedKeys {
            keys,
            digest: Some(sha256_hex(&bytes)),
        })
    }

    /// Hex SHA-256 of the file's bytes (`None` when no file was given).
    pub fn digest(&self) -> Option<&str> {
        self.digest.as_deref()
    }

    /// Whether `key` is revoked.
    pub fn contains(&self, key: &KeyData) -> bool {
        self.keys.iter().any(|k| k == key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "AAAAC3NzaC1lZDI1NTE5AAAAIM8/Ssb8+9zQKzH0AcJDKbLEyz3vvMaMa2i0jPbrfG6M";

    #[test]
    fn times_are_utc_and_checked() {
        assert_eq!(parse_time("19700101Z").unwrap(), 0);
        assert_eq!(parse_time("20260101Z").unwrap(), 1_767_225_600);
        assert_eq!(parse_time("202601010000Z").unwrap(), 1_767_225_600);
        assert_eq!(parse_time("20260101000001Z").unwrap(), 1_767_225_601);
        assert!(parse_time("20260101").is_err());
        assert!(parse_time("20261301Z").is_err());
        assert!(parse_time("2026010Z").is_err());
    }

    #[test]
    fn patterns_follow_openssh() {
        assert!(match_pattern_list("ci@a.example", "*@a.example"));
        assert!(!match_pattern_list("ci@b.example", "*@a.example"));
        assert!(!match_pattern_list("bad@a.example", "*@a.example,!bad@*"));
        assert!(match_pattern_list("x", "y,?"));
    }

    #[test]
    fn parses_options_quotes_and_skips_other_key_types() {
        let text = format!(
            "# fleet\n\n\"ci@a.example,ops@a.example\" namespaces=\"torch-compiled-graphs,git\",valid-after=\"20260101Z\",valid-before=20270101Z ssh-ed25519 {KEY} comment here\n\
             git@a.example ssh-rsa AAAAB3NzaC1yc2E= rsa key\n\
             * ssh-ed25519 {KEY}\n"
        );
        let a = AllowedSigners::parse(Path::new("as"), &text).unwrap();
        assert_eq!(a.signers.len(), 2);
        let s = &a.signers[0];
        assert_eq!(s.principals, "ci@a.example,ops@a.example");
        assert_eq!(s.namespaces.as_deref(), Some("torch-compiled-graphs,git"));
        assert_eq!(s.valid_after, Some(1_767_225_600));
        assert!(s.valid_before.is_some());
        assert_eq!(s.line, 3);
        assert_eq!(a.signers[1].principals, "*");
    }

    #[test]
    fn refuses_cert_authority_unknown_options_and_bad_keys() {
        for (text, code) in [
            (
                format!("* cert-authority ssh-ed25519 {KEY}"),
                "trust.cert_authority_unsupported",
            ),
            (
                format!("* frobnicate ssh-ed25519 {KEY}"),
                "trust.allowed_signers_invalid",
            ),
            (
                format!("* valid-after=20260101 ssh-ed25519 {KEY}"),
                "trust.allowed_signers_invalid",
            ),
            (
                "* ssh-ed25519 AAAAnotakey".to_string(),
                "trust.allowed_signers_invalid",
            ),
            (
                "\"unterminated ssh-ed25519".to_string(),
                "trust.allowed_signers_invalid",
            ),
            ("onlyprincipal".to_string(), "trust.allowed_signers_invalid"),
        ] {
            let err = AllowedSigners::parse(Path::new("as"), &text).unwrap_err();
            assert_eq!(err.code(), code, "{text}");
        }
    }
}
