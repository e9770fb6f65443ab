//! The indented form `json.dumps(x, sort_keys=True, indent=2)` of Python:
//! what the CLI of 0.2.0 printed for an artifact's metadata, so that scripts
//! written against it parse the same bytes.

use crate::value::Value;
use crate::writer::{to_canonical_string, CjError};

/// `json.dumps(value, sort_keys=True, indent=indent)` of Python (ASCII
/// escapes, `", "`-free item separators with indent, `": "` after keys,
/// `[]`/`{}` for empty containers), without a trailing newline.
pub fn to_python_indented(value: &Value, indent: usize) -> Result<String, CjError> {
    let mut out = String::new();
    write(&mut out, value, indent, 0)?;
    Ok(out)
}

fn newline(out: &mut String, indent: usize, level: usize) {
    out.push('\n');
    out.extend(std::iter::repeat_n(' ', indent * level));
}

fn write(out: &mut String, value: &Value, indent: usize, level: usize) -> Result<(), CjError> {
    match value {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                newline(out, indent, level + 1);
                write(out, item, indent, level + 1)?;
            }
            newline(out, indent, level);
            out.push(']');
        }
        Value::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                newline(out, indent, level + 1);
                out.push_str(&to_canonical_string(&Value::Str(k.clone()))?);
                out.push_str(": ");
                write(out, v, indent, level + 1)?;
            }
            newline(out, indent, level);
            out.push('}');
        }
        // Scalars and empty containers print as in CJ (which is ensure_ascii
        // and uses Python's float repr).
        other => out.push_str(&to_canonical_string(other)?),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_python_json_dumps_indent_2() {
        // python3 -c 'import json;print(json.dumps({"b":[1,{"x":[]}],"a":{"é\n":1.5e-07,"z":{}},"c":None,"d":True},sort_keys=True,indent=2))'
        let v = crate::parse_strict(
            "{\"b\":[1,{\"x\":[]}],\"a\":{\"\u{e9}\\n\":1.5e-07,\"z\":{}},\"c\":null,\"d\":true}"
                .as_bytes(),
        )
        .unwrap();
        let want = "{\n  \"a\": {\n    \"z\": {},\n    \"\\u00e9\\n\": 1.5e-07\n  },\n  \"b\": [\n    1,\n    {\n      \"x\": []\n    }\n  ],\n  \"c\": null,\n  \"d\": true\n}";
        assert_eq!(to_python_indented(&v, 2).unwrap(), want);
    }
}
