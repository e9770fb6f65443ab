use std::fmt::Write as _;

use crate::float::python_repr;
use crate::value::Value;

/// Stable codes of CJ refusals (SPEC-v1 §2.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CjErrorCode {
    /// NaN or an infinity.
    NonFinite,
    /// An integer outside the signed 64-bit range.
    IntegerRange,
    /// A value outside the CJ model.
    InvalidValue,
}

impl CjErrorCode {
    /// The stable code string.
    pub fn as_str(self) -> &'static str {
        match self {
            CjErrorCode::NonFinite => "cj.non_finite",
            CjErrorCode::IntegerRange => "cj.integer_range",
            CjErrorCode::InvalidValue => "cj.invalid_value",
        }
    }
}

/// A CJ refusal, naming the JSON path of the offending value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message} at {path}")]
pub struct CjError {
    /// The stable code.
    pub code: CjErrorCode,
    /// The JSON path of the value, such as `$.graph.pytree[2]`.
    pub path: String,
    /// What is wrong, in lowercase prose.
    pub message: String,
}

impl CjError {
    /// A refusal at `path`.
    pub fn new(code: CjErrorCode, path: impl Into<String>, message: impl Into<String>) -> Self {
        CjError {
            code,
            path: path.into(),
            message: message.into(),
        }
    }
}

/// CJ bytes of `value`.
pub fn to_canonical(value: &Value) -> Result<Vec<u8>, CjError> {
    to_canonical_string(value).map(String::into_bytes)
}

/// CJ of `value` as a string (always ASCII).
pub fn to_canonical_string(value: &Value) -> Result<String, CjError> {
    let mut out = String::new();
    write_value(&mut out, value).map_err(|(code, mut rev_path, message)| {
        rev_path.reverse();
        let path = format!("${}", rev_path.concat());
        CjError::new(code, path, message)
    })?;
    Ok(out)
}

type Failure = (CjErrorCode, Vec<String>, String);

fn write_value(out: &mut String, value: &Value) -> Result<(), Failure> {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        Value::Int(i) => {
            let _ = write!(out, "{i}");
        }
        Value::Float(f) => {
            if !f.is_finite() {
                return Err((
                    CjErrorCode::NonFinite,
                    Vec::new(),
                    format!("float {f} is not finite"),
                ));
            }
            out.push_str(&python_repr(*f));
        }
        Value::Str(s) => write_string(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(out, item).map_err(|mut f| {
                    f.1.push(format!("[{i}]"));
                    f
                })?;
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(out, k);
                out.push(':');
                write_value(out, v).map_err(|mut f| {
                    f.1.push(format!(
                        "[{}]",
                        to_canonical_string(&Value::Str(k.clone())).unwrap_or_default()
                    ));
                    f
                })?;
            }
            out.push('}');
        }
    }
    Ok(())
}

/// Append the CJ string literal of `s` (quotes included) to `out`.
pub fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Map;
    use sha2::{Digest, Sha256};

    fn probe() -> Value {
        let mut m = Map::new();
        m.insert("Z".into(), Value::Object(Map::new()));
        m.insert("a".into(), Value::Array(vec![]));
        m.insert(
            "f".into(),
            Value::Array(vec![
                Value::Float(1.5),
                Value::Float(1e-5),
                Value::Float(1e16),
            ]),
        );
        m.insert(
            "n".into(),
            Value::Array(vec![
                Value::Int(0),
                Value::Int(-1),
                Value::Bool(true),
                Value::Bool(false),
                Value::Null,
            ]),
        );
        m.insert("q".into(), "a\"b\\c/d\n\r\t\u{8}\u{c}".into());
        m.insert("s".into(), "\u{e9}\u{7f}\u{1}\u{2028}\u{1f600}".into());
        m.insert("\u{e9}".into(), Value::Int(1));
        Value::Object(m)
    }

    #[test]
    fn probe_p_matches_the_spec_bytes_and_digest() {
        let cj = to_canonical_string(&probe()).unwrap();
        assert_eq!(
            cj,
            r#"{"Z":{},"a":[],"f":[1.5,1e-05,1e+16],"n":[0,-1,true,false,null],"q":"a\"b\\c/d\n\r\t\b\f","s":"\u00e9\u007f\u0001\u2028\ud83d\ude00","\u00e9":1}"#
        );
        assert_eq!(
            hex::encode(Sha256::digest(cj.as_bytes())),
            "a3896a4c49d865c49166f1c6722b3370d472219dd90eff9b71dbd3f77d413951"
        );
    }

    #[test]
    fn integer_extremes_encode_as_themselves() {
        assert_eq!(
            to_canonical_string(&Value::Int(i64::MAX)).unwrap(),
            "9223372036854775807"
        );
        assert_eq!(
            to_canonical_string(&Value::Int(i64::MIN)).unwrap(),
            "-9223372036854775808"
        );
    }

    #[test]
    fn non_finite_floats_are_refused_with_their_path() {
        let mut m = Map::new();
        m.insert(
            "x".into(),
            Value::Array(vec![Value::Int(1), Value::Float(f64::NAN)]),
        );
        let err = to_canonical(&Value::Object(m)).unwrap_err();
        assert_eq!(err.code, CjErrorCode::NonFinite);
        assert_eq!(err.path, "$[\"x\"][1]");
        assert_eq!(err.code.as_str(), "cj.non_finite");
        let err = to_canonical(&Value::Float(f64::NEG_INFINITY)).unwrap_err();
        assert_eq!(err.code, CjErrorCode::NonFinite);
    }
}
