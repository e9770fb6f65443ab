use tcg_cj::{is_canonical_string, Map, Value};

use super::{hex_cj, KEY_AXES, KEY_DIGEST_HEX, KEY_SCHEME, MAX_KEY_LENGTH};
use crate::{Code, Error, Kind, Result};

/// Whether `s` is a compiled-graph key (SPEC-v1 §3.1).
///
/// The check is anchored at the end: the digest is the 56-hex suffix and the
/// scheme is whatever precedes the `-` before it. It never splits on the first `-`.
pub fn is_compiled_graph_key(s: &str) -> bool {
    split_key(s).is_some()
}

/// Split a key into `(scheme, digest)`, or `None` when it is not a key.
pub fn split_key(s: &str) -> Option<(&str, &str)> {
    let b = s.as_bytes();
    if b.len() > MAX_KEY_LENGTH || b.len() < KEY_DIGEST_HEX + 2 {
        return None;
    }
    let (head, digest) = b.split_at(b.len() - KEY_DIGEST_HEX);
    if !digest
        .iter()
        .all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'))
    {
        return None;
    }
    let (scheme, sep) = head.split_at(head.len() - 1);
    if sep != b"-" || scheme.is_empty() {
        return None;
    }
    if !matches!(scheme[0], b'a'..=b'z' | b'0'..=b'9') {
        return None;
    }
    if !scheme[1..]
        .iter()
        .all(|c| matches!(c, b'a'..=b'z' | b'0'..=b'9' | b'.' | b'_' | b'-'))
    {
        return None;
    }
    // Every byte checked above is ASCII, so these slices are on char boundaries.
    Some((&s[..scheme.len()], &s[s.len() - KEY_DIGEST_HEX..]))
}

/// Derive a `cg-key-v1` key from the three axis values (SPEC-v1 §3.2).
pub fn derive_key(graph: &str, sm: &str, toolchain: &str) -> Result<String> {
    let mut axes = Map::new();
    axes.insert("graph".into(), graph.into());
    axes.insert("sm".into(), sm.into());
    axes.insert("toolchain".into(), toolchain.into());
    derive_key_from_axes(&axes)
}

/// Derive a `cg-key-v1` key from an axes object, validating it in the order
/// of SPEC-v1 §3.2 (unknown, missing, not canonical, key-shaped).
pub fn derive_key_from_axes(axes: &Map) -> Result<String> {
    if let Some(unknown) = axes.keys().find(|k| !KEY_AXES.contains(&k.as_str())) {
        return Err(Error::new(
            Code::IdentityAxisUnknown,
            format!("unknown key axis {unknown:?}; the axes are graph, sm and toolchain"),
        ));
    }
    if let Some(missing) = KEY_AXES.iter().find(|k| !axes.contains_key(**k)) {
        return Err(Error::new(
            Code::IdentityAxisMissing,
            format!("key axis {missing:?} is missing"),
        ));
    }
    for name in KEY_AXES {
        let value = &axes[name];
        let text = match value {
            Value::Str(s) if is_canonical_string(s) => s,
            _ => {
                return Err(Error::new(
                    Code::IdentityAxisNotCanonical,
                    format!("key axis {name:?} must be a non-empty trimmed string"),
                ))
            }
        };
        if is_compiled_graph_key(text) {
            return Err(Error::new(
                Code::IdentityAxisIsKey,
                format!("key axis {name:?} is itself a compiled-graph key: {text:?}"),
            ));
        }
    }
    let digest = hex_cj(&Value::Object(axes.clone()), KEY_DIGEST_HEX, Kind::Identity)?;
    Ok(format!("{KEY_SCHEME}-{digest}"))
}

/// The key of an artifact from its recorded facts (SPEC-v1 §3.3): `kind`
/// must be `aot-inductor`; the axes are `graph_class.class_hash`, `sm` and the
/// toolchain axis of a valid `toolchain` block. Missing or invalid facts are
/// `identity.metadata_incomplete`.
pub fn key_from_metadata(metadata: &Map) -> Result<String> {
    let incomplete = |what: &str| {
        Error::new(
            Code::IdentityMetadataIncomplete,
            format!("metadata lacks {what}"),
        )
    };
    if metadata.get("kind").and_then(Value::as_str) != Some(super::ARTIFACT_KIND) {
        return Err(incomplete("kind \"aot-inductor\""));
    }
    let class_hash = metadata
        .get("graph_class")
        .and_then(Value::as_object)
        .and_then(|g| g.get("class_hash"))
        .and_then(Value::as_str)
        .ok_or_else(|| incomplete("graph_class.class_hash"))?;
    let sm = metadata
        .get("sm")
        .and_then(Value::as_str)
        .ok_or_else(|| incomplete("sm"))?;
    let block = metadata
        .get("toolchain")
        .ok_or_else(|| incomplete("toolchain"))?;
    let block = super::validate_toolchain_block(block, Code::IdentityMetadataIncomplete)?;
    derive_key(class_hash, sm, &super::toolchain_axis(&block))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axes_vector_of_the_spec() {
        assert_eq!(
            derive_key("fedcba9876543210", "sm_89", "0123456789abcdef").unwrap(),
            "cg-key-v1-aefe4c6d52d304f8ef7cc6f9ffae296113b1546defe761e1c12ac2cf"
        );
    }

    #[test]
    fn axis_refusals_follow_the_spec_order() {
        let mut axes = Map::new();
        axes.insert("graph".into(), "g".into());
        axes.insert("extra".into(), "x".into());
        assert_eq!(
            derive_key_from_axes(&axes).unwrap_err().code(),
            Code::IdentityAxisUnknown
        );
        axes.remove("extra");
        assert_eq!(
            derive_key_from_axes(&axes).unwrap_err().code(),
            Code::IdentityAxisMissing
        );
        axes.insert("sm".into(), " sm_89".into());
        axes.insert("toolchain".into(), "t".into());
        assert_eq!(
            derive_key_from_axes(&axes).unwrap_err().code(),
            Code::IdentityAxisNotCanonical
        );
        axes.insert("sm".into(), Value::Int(89));
        assert_eq!(
            derive_key_from_axes(&axes).unwrap_err().code(),
            Code::IdentityAxisNotCanonical
        );
        axes.insert(
            "sm".into(),
            "cg-key-v1-aefe4c6d52d304f8ef7cc6f9ffae296113b1546defe761e1c12ac2cf".into(),
        );
        assert_eq!(
            derive_key_from_axes(&axes).unwrap_err().code(),
            Code::IdentityAxisIsKey
        );
    }

    #[test]
    fn key_with_hyphenated_scheme_is_split_at_the_suffix() {
        let k = "cg-key-v1-7692c3ad3540bb803c02-7692c3ad3540bb803c020b3aee66cd8887123234ea0c6e7143c0add7";
        let (scheme, digest) = split_key(k).unwrap();
        assert_eq!(scheme, "cg-key-v1-7692c3ad3540bb803c02");
        assert_eq!(digest.len(), 56);
        assert!(!is_compiled_graph_key(
            "é-7692c3ad3540bb803c020b3aee66cd8887123234ea0c6e7143c0add7"
        ));
    }
}
