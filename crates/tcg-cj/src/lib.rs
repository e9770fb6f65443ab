//! Canonical JSON (CJ) and the strict JSON reader (SPEC-v1 §2).
//!
//! CJ is the byte encoding of every hashed JSON value, every `metadata.json`,
//! every store record and every quarantine marker. It equals Python's
//! `json.dumps(x, sort_keys=True, separators=(",", ":"), ensure_ascii=True)`.
//! General-purpose serialisers produce other bytes, so the writer is our own.
//!
//! This crate sits below both `tcg-cas` and `tcg-core` so that the store and
//! the artifact code share one writer and one reader.
#![deny(missing_docs)]

mod float;
mod pretty;
mod reader;
mod value;
mod writer;

pub use pretty::to_python_indented;
pub use reader::{parse_strict, ParseError, MAX_DEPTH};
pub use value::{Map, Value};
pub use writer::{to_canonical, to_canonical_string, write_string, CjError, CjErrorCode};

/// The whitespace set **W** of SPEC-v1: exactly the characters for which
/// Python's `str.isspace()` is true.
pub fn is_w(c: char) -> bool {
    matches!(c,
        '\u{0009}'..='\u{000D}'
        | '\u{001C}'..='\u{001F}'
        | '\u{0020}'
        | '\u{0085}'
        | '\u{00A0}'
        | '\u{1680}'
        | '\u{2000}'..='\u{200A}'
        | '\u{2028}'
        | '\u{2029}'
        | '\u{202F}'
        | '\u{205F}'
        | '\u{3000}')
}

/// Remove leading and trailing characters of **W**.
pub fn trim_w(s: &str) -> &str {
    s.trim_matches(is_w)
}

/// A canonical string: non-empty, with no leading or trailing character of **W**.
pub fn is_canonical_string(s: &str) -> bool {
    !s.is_empty() && trim_w(s).len() == s.len()
}

/// Exactly `n` characters of `[0-9a-f]`.
pub fn is_hex(s: &str, n: usize) -> bool {
    s.len() == n && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn w_set_includes_information_separators_and_excludes_zero_width_space() {
        for c in [
            '\u{1c}', '\u{1f}', '\u{85}', '\u{a0}', '\u{3000}', ' ', '\t',
        ] {
            assert!(is_w(c), "{c:?}");
        }
        for c in ['\u{200b}', '\u{feff}', 'a', '\u{0}', '\u{180e}'] {
            assert!(!is_w(c), "{c:?}");
        }
        assert_eq!(trim_w("\u{1c} a b\u{3000}"), "a b");
        assert!(is_canonical_string("a b"));
        assert!(!is_canonical_string(""));
        assert!(!is_canonical_string(" a"));
    }

    #[test]
    fn hex_check_is_exact_and_lowercase() {
        assert!(is_hex("0123456789abcdef", 16));
        assert!(!is_hex("0123456789ABCDEF", 16));
        assert!(!is_hex("0123456789abcde", 16));
    }
}
