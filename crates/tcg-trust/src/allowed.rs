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

/// OpenSSH's `WHITESPACE` (misc.h): what separates the principals field.
const WHITESPACE: [char; 4] = [' ', '\t', '\r', '\n'];

/// The longest subpattern OpenSSH's `match_pattern_list` matches: a longer
/// one makes the whole list match nothing (its buffer is 1024 bytes).
pub const MAX_SUBPATTERN_BYTES: usize = 1022;

/// OpenSSH `strdelimw`: split off the principals field. A `"` anywhere in it
/// starts a quoted part (the quotes are dropped, whitespace inside is kept)
/// that ends the field at its closing quote. `None` when a quote is not
/// closed; the rest is `None` when nothing follows the field at all.
fn strdelimw(s: &str) -> Option<(String, Option<&str>)> {
    fn skip(r: &str) -> &str {
        r.trim_start_matches(WHITESPACE)
    }
    let Some(i) = s.find(|c: char| WHITESPACE.contains(&c) || c == '"') else {
        return Some((s.to_string(), None));
    };
    if s[i..].starts_with('"') {
        let inner = &s[i + 1..];
        let j = inner.find('"')?;
        let token = format!("{}{}", &s[..i], &inner[..j]);
        return Some((token, Some(skip(&inner[j + 1..]))));
    }
    Some((s[..i].to_string(), Some(skip(&s[i + 1..]))))
}

/// OpenSSH `sshkey_advance_past_options`: the options field runs to the
/// first blank outside double quotes (`\"` is an escaped quote). `None` for
/// an unterminated quote.
fn options_field(s: &str) -> Option<(&str, &str)> {
    let bytes = s.as_bytes();
    let mut quoted = false;
    let mut i = 0;
    while i < bytes.len() && (quoted || (bytes[i] != b' ' && bytes[i] != b'\t')) {
        if bytes[i] == b'\\' && bytes.get(i + 1) == Some(&b'"') {
            i += 1;
        } else if bytes[i] == b'"' {
            quoted = !quoted;
        }
        i += 1;
    }
    if quoted {
        return None;
    }
    Some((&s[..i], &s[i..]))
}

/// OpenSSH `opt_dequote`: a value must be a `"quoted string"` (`\"` inside
/// is a quote). Returns the value and what follows the closing quote.
fn dequote(s: &str) -> std::result::Result<(String, &str), &'static str> {
    let Some(mut rest) = s.strip_prefix('"') else {
        return Err("missing start quote (option values must be quoted)");
    };
    let mut out = String::new();
    loop {
        let Some(c) = rest.chars().next() else {
            return Err("missing end quote");
        };
        if c == '"' {
            return Ok((out, &rest[1..]));
        }
        if c == '\\' && rest[1..].starts_with('"') {
            out.push('"');
            rest = &rest[2..];
            continue;
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
}

/// Strip `prefix` from `s` ignoring ASCII case (OpenSSH's `strncasecmp`).
fn strip_prefix_ci<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &s[prefix.len()..])
}

/// The options of one line, as OpenSSH's `sshsigopt_parse` reads them.
#[derive(Default)]
struct LineOptions {
    cert_authority: bool,
    namespaces: Option<String>,
    valid_after: Option<i64>,
    valid_before: Option<i64>,
}

/// OpenSSH `sshsigopt_parse`, with this project's stricter time rule.
fn parse_options(mut opts: &str) -> std::result::Result<LineOptions, String> {
    let mut out = LineOptions::default();
    while !opts.is_empty() {
        if let Some(rest) = strip_prefix_ci(opts, "cert-authority") {
            out.cert_authority = true;
            opts = rest;
        } else if let Some(rest) = strip_prefix_ci(opts, "namespaces=") {
            if out.namespaces.is_some() {
                return Err("multiple \"namespaces\" clauses".into());
            }
            let (v, rest) = dequote(rest).map_err(|e| format!("namespaces: {e}"))?;
            out.namespaces = Some(v);
            opts = rest;
        } else if let Some((name, rest)) = strip_prefix_ci(opts, "valid-after=")
            .map(|r| ("valid-after", r))
            .or_else(|| strip_prefix_ci(opts, "valid-before=").map(|r| ("valid-before", r)))
        {
            let slot = if name == "valid-after" {
                &mut out.valid_after
            } else {
                &mut out.valid_before
            };
            if slot.is_some() {
                return Err(format!("multiple \"{name}\" clauses"));
            }
            let (v, rest) = dequote(rest).map_err(|e| format!("{name}: {e}"))?;
            let t = parse_time(&v)?;
            if t <= 0 {
                // OpenSSH refuses a time that is the epoch (or before).
                return Err(format!("invalid \"{name}\" time {v:?}"));
            }
            *slot = Some(t);
            opts = rest;
        }
        if opts.is_empty() {
            break;
        }
        let Some(rest) = opts.strip_prefix(',') else {
            let shown: String = opts.chars().take(40).collect();
            return Err(format!("unknown option at {shown:?}"));
        };
        if rest.is_empty() {
            return Err("unexpected end of options (a trailing comma)".into());
        }
        opts = rest;
    }
    Ok(out)
}

/// Key type names OpenSSH reads as a key (`sshkey_type_from_name`): a field
/// that is one of them starts the key; anything else is the options field.
const KEY_TYPES: [&str; 16] = [
    "ssh-ed25519",
    "ssh-rsa",
    "ssh-dss",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "sk-ssh-ed25519@openssh.com",
    "sk-ecdsa-sha2-nistp256@openssh.com",
    "ssh-ed25519-cert-v01@openssh.com",
    "ssh-rsa-cert-v01@openssh.com",
    "ssh-dss-cert-v01@openssh.com",
    "ecdsa-sha2-nistp256-cert-v01@openssh.com",
    "ecdsa-sha2-nistp384-cert-v01@openssh.com",
    "ecdsa-sha2-nistp521-cert-v01@openssh.com",
    "sk-ssh-ed25519-cert-v01@openssh.com",
    "sk-ecdsa-sha2-nistp256-cert-v01@openssh.com",
];

/// Refuse a pattern list with a subpattern OpenSSH cannot match.
fn check_patterns(what: &str, list: &str) -> std::result::Result<(), String> {
    for p in list.split(',') {
        let p = p.strip_prefix('!').unwrap_or(p);
        if p.len() > MAX_SUBPATTERN_BYTES {
            return Err(format!(
                "a {what} pattern of {} bytes (OpenSSH matches at most {MAX_SUBPATTERN_BYTES})",
                p.len()
            ));
        }
    }
    Ok(())
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

/// OpenSSH `match_pattern`: `*` and `?` wildcards, bytewise. Iterative
/// (backtracking only to the last `*`), so the work is at most
/// pattern × string even for patterns like `*a*a*a*b`; the result is the
/// same as OpenSSH's recursive matcher.
fn glob(pattern: &[u8], s: &[u8]) -> bool {
    let (mut p, mut i) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while i < s.len() {
        match pattern.get(p) {
            Some(b'*') => {
                star = Some((p, i));
                p += 1;
            }
            Some(b'?') => {
                p += 1;
                i += 1;
            }
            Some(&c) if c == s[i] => {
                p += 1;
                i += 1;
            }
            _ => match star {
                Some((sp, si)) => {
                    p = sp + 1;
                    i = si + 1;
                    star = Some((sp, si + 1));
                }
                None => return false,
            },
        }
    }
    pattern[p..].iter().all(|&c| c == b'*')
}

/// OpenSSH `match_pattern_list`: a negated pattern that matches vetoes; a
/// subpattern longer than [`MAX_SUBPATTERN_BYTES`] makes the list match
/// nothing (as OpenSSH's fixed buffer does).
pub fn match_pattern_list(s: &str, list: &str) -> bool {
    let mut matched = false;
    for p in list.split(',') {
        if p.strip_prefix('!').unwrap_or(p).len() > MAX_SUBPATTERN_BYTES {
            return false;
        }
        match p.strip_prefix('!') {
            Some(neg) if glob(neg.as_bytes(), s.as_bytes()) => return false,
            Some(_) => {}
            None if glob(p.as_bytes(), s.as_bytes()) => matched = true,
            None => {}
        }
    }
    matched
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

    /// Parse the text of a file named `path` (for messages). A line is
    /// read as OpenSSH's `ssh-keygen -Y verify` reads it (sshsig.c); a line
    /// OpenSSH would reject (and skip) refuses the whole file here, so a
    /// policy never silently means less than it says.
    pub fn parse(path: &Path, text: &str) -> Result<AllowedSigners> {
        let mut signers = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line_no = i + 1;
            let bad = |m: &str| invalid(path, line_no, m);
            if raw.contains(['\0', '\r']) {
                return Err(bad("a NUL or carriage return inside the line"));
            }
            let line = raw.trim_start_matches([' ', '\t']);
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (principals, rest) = strdelimw(line).ok_or_else(|| bad("unterminated quote"))?;
            let rest = rest.ok_or_else(|| bad("no key"))?;
            if principals.is_empty() {
                return Err(bad("empty principals"));
            }
            check_patterns("principal", &principals).map_err(|m| bad(&m))?;
            let first = rest.split([' ', '\t']).next().unwrap_or("");
            let (opts, rest) = if KEY_TYPES.contains(&first) {
                (LineOptions::default(), rest)
            } else {
                let (field, rest) = options_field(rest)
                    .ok_or_else(|| bad("invalid options (unterminated quote)"))?;
                let rest = rest.trim_start_matches([' ', '\t']);
                if rest.is_empty() {
                    return Err(bad("missing key"));
                }
                let opts = parse_options(field).map_err(|m| bad(&format!("bad options: {m}")))?;
                (opts, rest)
            };
            if opts.cert_authority {
                return Err(TrustError::CertAuthorityUnsupported {
                    path: path.to_path_buf(),
                    line: line_no,
                });
            }
            if let Some(ns) = &opts.namespaces {
                check_patterns("namespaces", ns).map_err(|m| bad(&m))?;
            }
            let mut fields = rest.split([' ', '\t']).filter(|f| !f.is_empty());
            let kind = fields.next().ok_or_else(|| bad("no key type"))?;
            let blob = fields.next().ok_or_else(|| bad("no key data"))?;
            if !KEY_TYPES.contains(&kind) {
                return Err(bad(&format!("invalid key: unknown key type {kind:?}")));
            }
            if kind != "ssh-ed25519" {
                // Another key type cannot sign artifacts here; keep git's lines usable.
                continue;
            }
            let key = PublicKey::from_openssh(&format!("{kind} {blob}"))
                .map_err(|e| bad(&format!("bad ssh-ed25519 key: {e}")))?;
            signers.push(AllowedSigner {
                principals,
                namespaces: opts.namespaces,
                valid_after: opts.valid_after,
                valid_before: opts.valid_before,
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
    fn globs_match_like_the_recursive_definition() {
        fn reference(p: &[u8], s: &[u8]) -> bool {
            match p.split_first() {
                None => s.is_empty(),
                Some((b'*', rest)) => (0..=s.len()).any(|i| reference(rest, &s[i..])),
                Some((b'?', rest)) => !s.is_empty() && reference(rest, &s[1..]),
                Some((c, rest)) => s.first() == Some(c) && reference(rest, &s[1..]),
            }
        }
        let alphabet = [b'a', b'b', b'*', b'?'];
        let mut patterns = vec![Vec::new()];
        for _ in 0..4 {
            let next: Vec<Vec<u8>> = patterns
                .iter()
                .flat_map(|p| alphabet.iter().map(move |&c| [p.clone(), vec![c]].concat()))
                .collect();
            patterns.extend(next);
        }
        patterns.sort();
        patterns.dedup();
        let strings: Vec<&[u8]> = vec![b"", b"a", b"b", b"ab", b"ba", b"aab", b"abab", b"bbb"];
        for p in &patterns {
            for s in &strings {
                assert_eq!(glob(p, s), reference(p, s), "{:?} {:?}", p, s);
            }
        }
        // Linear enough: a pathological pattern against 16 KiB answers at once.
        let long = vec![b'a'; 16 * 1024];
        assert!(!glob(b"*a*a*a*a*a*a*a*a*a*a*b", &long));
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
            "# fleet\n\n\"ci@a.example,ops@a.example\" namespaces=\"torch-compiled-graphs,git\",valid-after=\"20260101Z\",valid-before=\"20270101Z\" ssh-ed25519 {KEY} comment here\n\
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
