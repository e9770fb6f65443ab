use std::collections::BTreeMap;

use tcg_cj::{is_canonical_string, Map, Value};

use super::hex_n;
use crate::{Code, Error, Result};

/// Names that never enter the toolchain axis: model libraries, not compilers
/// (SPEC-v1 §3.4). Exact and case-sensitive.
pub const TOOLCHAIN_EXCLUDED: [&str; 3] = ["diffusers", "peft", "transformers"];

/// The toolchain member whose value names the compile policy a graph was
/// compiled under (docs/keys.md, "Variants").
pub const SETTINGS_DECLARATION: &str = "settings_declaration";

/// The `settings_declaration` digests of this version's compile policies,
/// with how `explain` names each: the default policy and the libtorch-free
/// variant `shim-v1` (issue 34). The digests are `hex16` of the canonical JSON
/// of Python's `policy_of(variant).settings_declaration()`; a Python test pins
/// that they agree. A digest not listed (a caller's own block) has no name.
pub const COMPILE_POLICIES: [(&str, &str); 2] = [
    ("e498023a9ea8081a", "default policy"),
    ("c2b5fae3810f44f2", "libtorch-free variant shim-v1"),
];

/// How `explain` names the compile policy behind a `settings_declaration`
/// digest, or `None` for a digest of no known policy.
pub fn compile_policy_title(digest: &str) -> Option<&'static str> {
    COMPILE_POLICIES
        .iter()
        .find(|(d, _)| *d == digest)
        .map(|(_, title)| *title)
}

/// Validate a toolchain block: a non-empty object whose keys and values are
/// canonical strings. Refusals carry `code` (`declaration.toolchain_invalid`
/// for callers, `artifact.metadata_schema` when reading metadata).
pub fn validate_toolchain_block(block: &Value, code: Code) -> Result<BTreeMap<String, String>> {
    let map = match block {
        Value::Object(m) if !m.is_empty() => m,
        Value::Object(_) => return Err(Error::new(code, "toolchain block is empty")),
        other => {
            return Err(Error::new(
                code,
                format!(
                    "toolchain block must be an object, got {}",
                    other.type_name()
                ),
            ))
        }
    };
    let mut out = BTreeMap::new();
    for (k, v) in map {
        if !is_canonical_string(k) {
            return Err(Error::new(
                code,
                format!("toolchain member name {k:?} is not a non-empty trimmed string"),
            ));
        }
        match v {
            Value::Str(s) if is_canonical_string(s) => {
                out.insert(k.clone(), s.clone());
            }
            _ => {
                return Err(Error::new(
                    code,
                    format!("toolchain member {k:?} must be a non-empty trimmed string"),
                ))
            }
        }
    }
    Ok(out)
}

/// The toolchain axis: `hex16(CJ(members))` over the block without the
/// excluded names (SPEC-v1 §3.4). The block must already be validated.
pub fn toolchain_axis(block: &BTreeMap<String, String>) -> String {
    let members: Map = block
        .iter()
        .filter(|(k, _)| !TOOLCHAIN_EXCLUDED.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), Value::Str(v.clone())))
        .collect();
    let bytes = tcg_cj::to_canonical(&Value::Object(members)).expect("strings always encode");
    hex_n(&bytes, 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_fold_is_the_hash_of_an_empty_object() {
        let mut b = BTreeMap::new();
        b.insert("peft".to_string(), "x".to_string());
        assert_eq!(toolchain_axis(&b), hex_n(b"{}", 16));
    }

    #[test]
    fn invalid_blocks_are_refused_with_the_callers_code() {
        for bad in [
            Value::Null,
            Value::Object(Map::new()),
            Value::Object([("torch".to_string(), Value::Int(1))].into_iter().collect()),
            Value::Object(
                [("torch".to_string(), Value::from(" x"))]
                    .into_iter()
                    .collect(),
            ),
            Value::Object(
                [(" torch".to_string(), Value::from("x"))]
                    .into_iter()
                    .collect(),
            ),
        ] {
            let err =
                validate_toolchain_block(&bad, Code::DeclarationToolchainInvalid).unwrap_err();
            assert_eq!(err.code(), Code::DeclarationToolchainInvalid);
        }
    }
}
