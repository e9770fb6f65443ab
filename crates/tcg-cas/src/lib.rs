//! The content-addressed store of torch-compiled-graphs (SPEC-v1 §9).
//!
//! It knows nothing about graphs: objects, manifests, refs, leases, GC.
#![deny(missing_docs)]

/// The ref prefix of compiled-graph records (SPEC-v1 §9.5, wire identity).
pub const GRAPH_REF_PREFIX: &str = "torch-compiled-graphs/v1/graphs/";
/// The ref prefix of quarantine markers (SPEC-v1 §9.5, wire identity).
pub const QUARANTINE_REF_PREFIX: &str = "torch-compiled-graphs/v1/quarantine/";
/// Fixed chunk length of manifests (SPEC-v1 §9.3).
pub const MAX_CHUNK_BYTES: u64 = 67_108_864;
