//! The one strict JSON reader (SPEC-v1 §2.5).

use crate::value::{Map, Value};

/// Nesting deeper than this is refused.
pub const MAX_DEPTH: usize = 128;

/// Why bytes were refused, with the byte offset where it was noticed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid json at byte {offset}: {message}")]
pub struct ParseError {
    /// Byte offset into the input.
    pub offset: usize,
    /// What is wrong, in lowercase prose.
    pub message: String,
}

/// Parse `input` strictly: UTF-8, RFC 8259, no duplicate keys at any depth,
/// integers within i64, finite floats, no lone surrogates, nothing trailing
/// but whitespace.
pub fn parse_strict(input: &[u8]) -> Result<Value, ParseError> {
    if let Err(e) = std::str::from_utf8(input) {
        return Err(ParseError {
            offset: e.valid_up_to(),
            message: "input is not utf-8".into(),
        });
    }
    let mut p = Parser { b: input, i: 0 };
    p.ws();
    let v = p.value(0)?;
    p.ws();
    if p.i != p.b.len() {
        return Err(p.err("trailing bytes after the json value"));
    }
    Ok(v)
}

struct Parser<'a> {
    b: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn err(&self, message: impl Into<String>) -> ParseError {
        ParseError {
            offset: self.i,
            message: message.into(),
        }
    }

    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.i += 1;
        }
    }

    fn expect(&mut self, lit: &[u8]) -> Result<(), ParseError> {
        if self.b[self.i..].starts_with(lit) {
            self.i += lit.len();
            Ok(())
        } else {
            Err(self.err("unexpected token"))
        }
    }

    fn value(&mut self, depth: usize) -> Result<Value, ParseError> {
        match self.peek() {
            None => Err(self.err("unexpected end of input")),
            Some(b'n') => self.expect(b"null").map(|_| Value::Null),
            Some(b't') => self.expect(b"true").map(|_| Value::Bool(true)),
            Some(b'f') => self.expect(b"false").map(|_| Value::Bool(false)),
            Some(b'"') => self.string().map(Value::Str),
            Some(b'[') => self.array(depth + 1),
            Some(b'{') => self.object(depth + 1),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(_) => Err(self.err("unexpected character")),
        }
    }

    fn array(&mut self, depth: usize) -> Result<Value, ParseError> {
        if depth > MAX_DEPTH {
            return Err(self.err(format!("nesting deeper than {MAX_DEPTH}")));
        }
        self.i += 1;
        let mut items = Vec::new();
        self.ws();
        if self.peek() == Some(b']') {
            self.i += 1;
            return Ok(Value::Array(items));
        }
        loop {
            self.ws();
            items.push(self.value(depth)?);
            self.ws();
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b']') => {
                    self.i += 1;
                    return Ok(Value::Array(items));
                }
                _ => return Err(self.err("expected ',' or ']'")),
            }
        }
    }

    fn object(&mut self, depth: usize) -> Result<Value, ParseError> {
        if depth > MAX_DEPTH {
            return Err(self.err(format!("nesting deeper than {MAX_DEPTH}")));
        }
        self.i += 1;
        let mut map = Map::new();
        self.ws();
        if self.peek() == Some(b'}') {
            self.i += 1;
            return Ok(Value::Object(map));
        }
        loop {
            self.ws();
            if self.peek() != Some(b'"') {
                return Err(self.err("expected a string key"));
            }
            let at = self.i;
            let key = self.string()?;
            self.ws();
            if self.peek() != Some(b':') {
                return Err(self.err("expected ':'"));
            }
            self.i += 1;
            self.ws();
            let v = self.value(depth)?;
            if map.contains_key(&key) {
                return Err(ParseError {
                    offset: at,
                    message: format!("duplicate key {key:?}"),
                });
            }
            map.insert(key, v);
            self.ws();
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b'}') => {
                    self.i += 1;
                    return Ok(Value::Object(map));
                }
                _ => return Err(self.err("expected ',' or '}'")),
            }
        }
    }

    fn hex4(&mut self) -> Result<u32, ParseError> {
        let digits = self
            .b
            .get(self.i..self.i + 4)
            .ok_or_else(|| self.err("truncated \\u escape"))?;
        let mut v = 0u32;
        for &d in digits {
            let x = (d as char)
                .to_digit(16)
                .ok_or_else(|| self.err("invalid \\u escape"))?;
            v = v * 16 + x;
        }
        self.i += 4;
        Ok(v)
    }

    fn string(&mut self) -> Result<String, ParseError> {
        self.i += 1;
        let mut out = String::new();
        loop {
            let start = self.i;
            while let Some(c) = self.peek() {
                if c == b'"' || c == b'\\' || c < 0x20 {
                    break;
                }
                self.i += 1;
            }
            // The input was validated as UTF-8 and the run stops only at ASCII bytes.
            out.push_str(std::str::from_utf8(&self.b[start..self.i]).expect("validated utf-8"));
            match self.peek() {
                None => return Err(self.err("unterminated string")),
                Some(b'"') => {
                    self.i += 1;
                    return Ok(out);
                }
                Some(b'\\') => {
                    self.i += 1;
                    let e = self.peek().ok_or_else(|| self.err("truncated escape"))?;
                    self.i += 1;
                    match e {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => {
                            let hi = self.hex4()?;
                            let cp = match hi {
                                0xD800..=0xDBFF => {
                                    if !self.b[self.i..].starts_with(b"\\u") {
                                        return Err(self.err("lone high surrogate"));
                                    }
                                    self.i += 2;
                                    let lo = self.hex4()?;
                                    if !(0xDC00..=0xDFFF).contains(&lo) {
                                        return Err(
                                            self.err("high surrogate without low surrogate")
                                        );
                                    }
                                    0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
                                }
                                0xDC00..=0xDFFF => return Err(self.err("lone low surrogate")),
                                _ => hi,
                            };
                            out.push(
                                char::from_u32(cp).ok_or_else(|| self.err("invalid code point"))?,
                            );
                        }
                        _ => return Err(self.err("invalid escape")),
                    }
                }
                Some(_) => return Err(self.err("control character in string")),
            }
        }
    }

    fn digits(&mut self) -> usize {
        let start = self.i;
        while let Some(b'0'..=b'9') = self.peek() {
            self.i += 1;
        }
        self.i - start
    }

    fn number(&mut self) -> Result<Value, ParseError> {
        let start = self.i;
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        match self.peek() {
            Some(b'0') => self.i += 1,
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return Err(self.err("invalid number")),
        }
        let mut is_float = false;
        if self.peek() == Some(b'.') {
            self.i += 1;
            if self.digits() == 0 {
                return Err(self.err("invalid number: no digits after '.'"));
            }
            is_float = true;
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.i += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.i += 1;
            }
            if self.digits() == 0 {
                return Err(self.err("invalid number: no exponent digits"));
            }
            is_float = true;
        }
        let text = std::str::from_utf8(&self.b[start..self.i]).expect("ascii");
        if is_float {
            let f: f64 = text.parse().map_err(|_| ParseError {
                offset: start,
                message: "invalid number".into(),
            })?;
            if !f.is_finite() {
                return Err(ParseError {
                    offset: start,
                    message: format!("float {text} overflows binary64"),
                });
            }
            Ok(Value::Float(f))
        } else {
            text.parse::<i64>().map(Value::Int).map_err(|_| ParseError {
                offset: start,
                message: format!("integer {text} is outside the signed 64-bit range"),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::to_canonical_string;

    fn refuses(input: &str) {
        assert!(
            parse_strict(input.as_bytes()).is_err(),
            "accepted {input:?}"
        );
    }

    #[test]
    fn strict_reader_refusals() {
        for bad in [
            "",
            "{",
            "[1,]",
            "{\"a\":1,}",
            "NaN",
            "Infinity",
            "-Infinity",
            "01",
            "1.",
            ".5",
            "1e",
            "{\"a\":1,\"a\":2}",
            "{\"x\":{\"b\":1,\"b\":1}}",
            "9223372036854775808",
            "-9223372036854775809",
            "1e400",
            "\"\\ud800\"",
            "\"\\udc00\"",
            "\"\\ud800\\u0041\"",
            "1 2",
            "\"a\" x",
            "// c\n1",
            "\"\u{1}\"",
            "+1",
            "tru",
            "\"\\x\"",
            "[1]]",
        ] {
            refuses(bad);
        }
        assert!(parse_strict(b"\"\xff\"").is_err());
    }

    #[test]
    fn strict_reader_accepts_and_types_numbers() {
        assert_eq!(parse_strict(b" -0 ").unwrap(), Value::Int(0));
        assert_eq!(parse_strict(b"1.0").unwrap(), Value::Float(1.0));
        assert_eq!(parse_strict(b"1E2").unwrap(), Value::Float(100.0));
        assert_eq!(
            parse_strict(b"9223372036854775807").unwrap(),
            Value::Int(i64::MAX)
        );
        assert_eq!(
            parse_strict(b"\"\\ud83d\\ude00\\/\"").unwrap(),
            Value::Str("\u{1f600}/".into())
        );
    }

    #[test]
    fn depth_64_is_accepted_and_beyond_128_refused() {
        let ok = format!("{}{}", "[".repeat(64), "]".repeat(64));
        parse_strict(ok.as_bytes()).unwrap();
        let bad = format!("{}{}", "[".repeat(129), "]".repeat(129));
        refuses(&bad);
    }

    #[test]
    fn canonical_bytes_round_trip() {
        let text = r#"{"Z":{},"a":[],"f":[1.5,1e-05,1e+16],"s":"\u00e9\ud83d\ude00"}"#;
        let v = parse_strict(text.as_bytes()).unwrap();
        assert_eq!(to_canonical_string(&v).unwrap(), text);
    }
}
