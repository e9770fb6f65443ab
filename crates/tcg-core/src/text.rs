//! Untrusted text in human output and logs.
//!
//! Strings that come from outside (a graph class name in an artifact's
//! metadata, a name read from an old store, a bucket or server string, the
//! producer of an unverified statement, an error message that embeds any of
//! these) must not be able to drive the terminal or forge output lines. Every
//! such string goes through [`untrusted`] before it is printed for a person
//! or written to a log: control characters (C0, DEL, C1), bidirectional
//! overrides and isolates, zero-width and other invisible format characters,
//! line and paragraph separators, and the backslash itself are escaped
//! (`\x1b`, `\u{202e}`, `\\`), and the result is capped. `--json` output is
//! never passed through here: JSON escaping alone keeps it exact.

use std::borrow::Cow;
use std::fmt::Write as _;

use tcg_cj::{Map, Value};

/// Characters of one untrusted string shown by [`untrusted`], before the cap.
pub const MAX_SHOWN_CHARS: usize = 256;

/// Characters of an error message or a log line shown, before the cap.
pub const MAX_MESSAGE_CHARS: usize = 4096;

/// Whether `c` must be escaped in human output.
pub fn is_dangerous(c: char) -> bool {
    matches!(c,
        '\u{0}'..='\u{1f}' | '\u{7f}'..='\u{9f}' // C0, DEL, C1 (CSI is U+009B)
        | '\u{ad}'                               // soft hyphen
        | '\u{61c}'                              // Arabic letter mark
        | '\u{180e}'                             // Mongolian vowel separator
        | '\u{200b}'..='\u{200f}'                // zero width, LRM, RLM
        | '\u{2028}'..='\u{202e}'                // separators, bidi embeddings and overrides
        | '\u{2060}'..='\u{206f}'                // word joiner, invisible operators, bidi isolates
        | '\u{feff}'                             // zero width no-break space (BOM)
        | '\u{fff9}'..='\u{fffb}'                // interlinear annotations
        | '\u{e0000}'..='\u{e007f}'              // tags
    )
}

/// `s` with every dangerous character (and `\`) escaped, uncapped.
pub fn escape(s: &str) -> Cow<'_, str> {
    if !s.chars().any(|c| c == '\\' || is_dangerous(c)) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        push_escaped(&mut out, c);
    }
    Cow::Owned(out)
}

fn push_escaped(out: &mut String, c: char) {
    match c {
        '\\' => out.push_str("\\\\"),
        '\n' => out.push_str("\\n"),
        '\r' => out.push_str("\\r"),
        '\t' => out.push_str("\\t"),
        c if (c as u32) < 0x80 && is_dangerous(c) => {
            let _ = write!(out, "\\x{:02x}", c as u32);
        }
        c if is_dangerous(c) => {
            let _ = write!(out, "\\u{{{:x}}}", c as u32);
        }
        c => out.push(c),
    }
}

/// `s` escaped and capped at `max` characters of the original, with a
/// marker saying how much was left out.
pub fn untrusted_capped(s: &str, max: usize) -> String {
    let mut out = String::new();
    for (shown, (i, c)) in s.char_indices().enumerate() {
        if shown == max {
            let _ = write!(out, "…[{} more bytes]", s.len() - i);
            return out;
        }
        push_escaped(&mut out, c);
    }
    out
}

/// An untrusted string for human output: escaped, at most
/// [`MAX_SHOWN_CHARS`] characters of it.
pub fn untrusted(s: &str) -> String {
    untrusted_capped(s, MAX_SHOWN_CHARS)
}

/// An error message or log line for a person: escaped (so it is one line),
/// at most [`MAX_MESSAGE_CHARS`] characters of it.
pub fn message(s: &str) -> String {
    untrusted_capped(s, MAX_MESSAGE_CHARS)
}

/// `v` with every string (object keys included) passed through
/// [`untrusted`]: a report made safe to render for a person.
pub fn untrusted_value(v: &Value) -> Value {
    match v {
        Value::Str(s) => Value::Str(untrusted(s)),
        Value::Array(items) => Value::Array(items.iter().map(untrusted_value).collect()),
        Value::Object(m) => {
            let mut out = Map::new();
            for (k, v) in m {
                out.insert(untrusted(k), untrusted_value(v));
            }
            Value::Object(out)
        }
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dangerous_characters_are_escaped_and_text_is_capped() {
        assert_eq!(escape("fleet/mlp-v2.serve"), "fleet/mlp-v2.serve");
        assert_eq!(
            untrusted("a\x1b[31mred\x07\nerror: forged"),
            "a\\x1b[31mred\\x07\\nerror: forged"
        );
        assert_eq!(untrusted("\u{9b}31m"), "\\u{9b}31m");
        assert_eq!(untrusted("abc\u{202e}gpj.exe"), "abc\\u{202e}gpj.exe");
        assert_eq!(untrusted("x\u{2066}y\u{200b}"), "x\\u{2066}y\\u{200b}");
        assert_eq!(untrusted("back\\slash"), "back\\\\slash");
        assert_eq!(untrusted("naïve ünïcode ✓"), "naïve ünïcode ✓");
        let long = "a".repeat(1000);
        let shown = untrusted(&long);
        assert!(shown.starts_with(&"a".repeat(MAX_SHOWN_CHARS)));
        assert!(shown.ends_with("…[744 more bytes]"), "{shown}");
        let v = tcg_cj::parse_strict(br#"{"k\u001b":["x\u0007",1]}"#).unwrap();
        assert_eq!(
            tcg_cj::to_canonical_string(&untrusted_value(&v)).unwrap(),
            r#"{"k\\x1b":["x\\x07",1]}"#
        );
    }
}
