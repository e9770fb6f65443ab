//! Identity (SPEC-v1 §3): key grammar, cg-key-v1, toolchain axis, graph-class
//! declarations and facts-v3, literal and call-ingress digests.
//!
//! Every digest that names a compiled graph is produced here and nowhere else.

mod declaration;
mod explain;
mod ingress;
mod key;
mod literal;
mod toolchain;

pub use declaration::{DeclarationInput, GraphClassDeclaration};
pub use explain::{
    diff_facts, differing_axes, graph_diffs, line_diff, value_diff, Difference, KeyFacts,
    WitnessLines, LINE_DIFF_MAX_LINES, LINE_DIFF_MAX_LINE_BYTES, VALUE_DIFF_MAX,
    WITNESS_LINES_MAX_BYTES, WITNESS_LINES_MAX_LINES,
};
pub use ingress::{ingress_digest, validate_ingress, CALL_INGRESS_VERSION};
pub use key::{
    derive_key, derive_key_from_axes, is_compiled_graph_key, key_from_metadata, split_key,
};
pub use literal::{literal_digest, shape_text, LiteralHasher, LiteralRow};
pub use toolchain::{
    compile_policy_title, toolchain_axis, validate_toolchain_block, COMPILE_POLICIES,
    SETTINGS_DECLARATION, TOOLCHAIN_EXCLUDED,
};

use sha2::{Digest, Sha256};

/// The artifact format version, `compiled_graph_format` (SPEC-v1 §1.3).
pub const COMPILED_GRAPH_FORMAT: i64 = 1;
/// The artifact kind recorded in metadata.
pub const ARTIFACT_KIND: &str = "aot-inductor";
/// The key scheme of v1 keys.
pub const KEY_SCHEME: &str = "cg-key-v1";
/// The key axes, in their canonical order.
pub const KEY_AXES: [&str; 3] = ["graph", "sm", "toolchain"];
/// Hex digits of a key's digest.
pub const KEY_DIGEST_HEX: usize = 56;
/// Longest valid key, in bytes.
pub const MAX_KEY_LENGTH: usize = 96;
/// Version of the graph-class facts (and of the graph interface `v`).
pub const GRAPH_FACTS_VERSION: i64 = 3;

/// `hexN(b)`: the first `n` lowercase hex characters of SHA-256(`bytes`).
pub fn hex_n(bytes: &[u8], n: usize) -> String {
    let mut h = hex::encode(Sha256::digest(bytes));
    h.truncate(n);
    h
}

/// `hexN(CJ(value))`, with CJ refusals raised as `kind`.
pub(crate) fn hex_cj(value: &tcg_cj::Value, n: usize, kind: crate::Kind) -> crate::Result<String> {
    let bytes = tcg_cj::to_canonical(value).map_err(|e| crate::Error::from_cj(kind, &e))?;
    Ok(hex_n(&bytes, n))
}

/// The graph witness: `hex16` of the canonical lines joined by LF, with no
/// trailing newline (SPEC-v1 §3.7). The lines are rendered by the torch adapter.
pub fn graph_witness<S: AsRef<str>>(lines: &[S]) -> String {
    let mut h = Sha256::new();
    for (i, line) in lines.iter().enumerate() {
        if i > 0 {
            h.update(b"\n");
        }
        h.update(line.as_ref().as_bytes());
    }
    let mut out = hex::encode(h.finalize());
    out.truncate(16);
    out
}
