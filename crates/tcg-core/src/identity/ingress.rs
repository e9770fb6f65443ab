use std::collections::{BTreeSet, HashSet};

use tcg_cj::{is_canonical_string, Map, Value};

use super::hex_cj;
use crate::{Code, Error, Kind, Result};

/// Version of the call-ingress object (SPEC-v1 §3.9).
pub const CALL_INGRESS_VERSION: i64 = 1;

const INGRESS_KEYS: [&str; 6] = [
    "excluded_inputs",
    "flat_arity",
    "inputs",
    "parameters",
    "symbols",
    "v",
];
const ROW_KEYS: [&str; 8] = [
    "dtype",
    "exported_name",
    "name",
    "param",
    "param_position",
    "path",
    "position",
    "shape",
];

fn bad(message: impl Into<String>) -> Error {
    Error::new(
        Code::DeclarationIngressInvalid,
        format!("call ingress is invalid: {}", message.into()),
    )
}

fn exact_keys(map: &Map, keys: &[&str], what: &str) -> Result<()> {
    let have: BTreeSet<&str> = map.keys().map(String::as_str).collect();
    let want: BTreeSet<&str> = keys.iter().copied().collect();
    if have != want {
        let missing: Vec<&str> = want.difference(&have).copied().collect();
        let extra: Vec<&str> = have.difference(&want).copied().collect();
        return Err(bad(format!(
            "{what} members differ (missing {missing:?}, extra {extra:?})"
        )));
    }
    Ok(())
}

fn int(v: &Value, what: &str) -> Result<i64> {
    v.as_i64()
        .ok_or_else(|| bad(format!("{what} must be an integer")))
}

fn string<'a>(v: &'a Value, what: &str) -> Result<&'a str> {
    v.as_str()
        .ok_or_else(|| bad(format!("{what} must be a string")))
}

/// Validate a call-ingress object (SPEC-v1 §3.9), refusing with
/// `declaration.ingress_invalid`.
pub fn validate_ingress(value: &Value) -> Result<()> {
    let map = value.as_object().ok_or_else(|| bad("not an object"))?;
    exact_keys(map, &INGRESS_KEYS, "ingress")?;
    if map["v"] != Value::Int(CALL_INGRESS_VERSION) {
        return Err(bad(format!("v must be the integer {CALL_INGRESS_VERSION}")));
    }
    let parameters: Vec<&str> = map["parameters"]
        .as_array()
        .ok_or_else(|| bad("parameters must be an array"))?
        .iter()
        .map(|p| match p {
            Value::Str(s) if is_canonical_string(s) => Ok(s.as_str()),
            _ => Err(bad("parameters must be non-empty trimmed strings")),
        })
        .collect::<Result<_>>()?;
    if parameters.iter().collect::<HashSet<_>>().len() != parameters.len() {
        return Err(bad("parameters are not unique"));
    }
    let flat_arity = int(&map["flat_arity"], "flat_arity")?;
    if flat_arity <= 0 {
        return Err(bad("flat_arity must be positive"));
    }

    let symbols = map["symbols"]
        .as_object()
        .ok_or_else(|| bad("symbols must be an object"))?;
    for (name, range) in symbols {
        match range.as_array().map(Vec::as_slice) {
            Some([Value::Int(lo), Value::Int(hi)]) if lo <= hi => {}
            _ => {
                return Err(bad(format!(
                    "symbol {name:?} must map to [lo, hi] integers with lo <= hi"
                )))
            }
        }
    }

    let excluded: Vec<&str> = map["excluded_inputs"]
        .as_array()
        .ok_or_else(|| bad("excluded_inputs must be an array"))?
        .iter()
        .map(|e| string(e, "excluded_inputs entries"))
        .collect::<Result<_>>()?;
    if excluded.windows(2).any(|w| w[0] >= w[1]) {
        return Err(bad("excluded_inputs must be sorted and unique"));
    }

    let inputs = map["inputs"]
        .as_array()
        .ok_or_else(|| bad("inputs must be an array"))?;
    let mut names = HashSet::new();
    let mut exported_names = HashSet::new();
    let mut used_symbols = BTreeSet::new();
    let mut last_position: Option<i64> = None;
    let mut last_param_position: Option<i64> = None;
    for (i, row) in inputs.iter().enumerate() {
        let row = row
            .as_object()
            .ok_or_else(|| bad(format!("input {i} must be an object")))?;
        exact_keys(row, &ROW_KEYS, &format!("input {i}"))?;
        let name = string(&row["name"], "name")?;
        let param = string(&row["param"], "param")?;
        let exported_name = string(&row["exported_name"], "exported_name")?;
        let dtype = string(&row["dtype"], "dtype")?;
        if !is_canonical_string(dtype) || dtype.starts_with("torch.") {
            return Err(bad(format!(
                "input {i} dtype {dtype:?} must be torch's dtype without the torch. prefix"
            )));
        }
        let position = int(&row["position"], "position")?;
        if position < 0 || position >= flat_arity || last_position.is_some_and(|p| position <= p) {
            return Err(bad(format!(
                "input {i} position {position} must increase strictly and stay below flat_arity"
            )));
        }
        last_position = Some(position);
        let param_position = int(&row["param_position"], "param_position")?;
        if param_position < 0 || last_param_position.is_some_and(|p| param_position < p) {
            return Err(bad(format!(
                "input {i} param_position {param_position} must not decrease"
            )));
        }
        last_param_position = Some(param_position);
        if parameters.get(param_position as usize) != Some(&param) {
            return Err(bad(format!(
                "input {i} param {param:?} is not parameters[{param_position}]"
            )));
        }
        let path = row["path"]
            .as_array()
            .ok_or_else(|| bad("path must be an array"))?;
        let mut derived_name = param.to_string();
        let mut derived_exported = param.to_string();
        for step in path {
            match step {
                Value::Str(s) => {
                    derived_name = s.clone();
                    derived_exported.push('_');
                    derived_exported.push_str(s);
                }
                Value::Int(n) if *n >= 0 => {
                    derived_name.push_str(&format!(".{n}"));
                    derived_exported.push_str(&format!("_{n}"));
                }
                _ => {
                    return Err(bad(format!(
                        "input {i} path steps must be strings or non-negative integers"
                    )))
                }
            }
        }
        if name != derived_name {
            return Err(bad(format!(
                "input {i} name {name:?} does not follow its path ({derived_name:?})"
            )));
        }
        if exported_name != derived_exported {
            return Err(bad(format!(
                "input {i} exported_name {exported_name:?} does not follow its path ({derived_exported:?})"
            )));
        }
        if !names.insert(name) {
            return Err(bad(format!("input name {name:?} is repeated")));
        }
        if !exported_names.insert(exported_name) {
            return Err(bad(format!("exported name {exported_name:?} is repeated")));
        }
        let shape = row["shape"]
            .as_array()
            .ok_or_else(|| bad("shape must be an array"))?;
        for dim in shape {
            match dim {
                Value::Int(n) if *n >= 0 => {}
                Value::Str(s) => {
                    if !symbols.contains_key(s) {
                        return Err(bad(format!("input {i} uses undeclared symbol {s:?}")));
                    }
                    used_symbols.insert(s.as_str());
                }
                _ => {
                    return Err(bad(format!(
                        "input {i} shape items must be non-negative integers or symbols"
                    )))
                }
            }
        }
    }
    if let Some(unused) = symbols.keys().find(|s| !used_symbols.contains(s.as_str())) {
        return Err(bad(format!("symbol {unused:?} is declared but never used")));
    }
    if let Some(both) = excluded.iter().find(|e| names.contains(**e)) {
        return Err(bad(format!("{both:?} is both an input and excluded")));
    }
    Ok(())
}

/// Validate a call ingress and return `hex32(CJ(ingress))`.
pub fn ingress_digest(value: &Value) -> Result<String> {
    validate_ingress(value)?;
    hex_cj(value, 32, Kind::Declaration)
}
