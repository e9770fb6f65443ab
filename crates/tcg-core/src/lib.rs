//! The core of torch-compiled-graphs: identity, artifacts, host-ISA admission
//! and the engine. Plain Rust: no pyo3 and no torch.
//!
//! SPEC-v1 (the design folder's `SPEC-v1.md`) is the byte-level authority for
//! everything here.
#![deny(missing_docs)]

pub mod artifact;
pub mod engine;
pub mod error;
pub mod host_isa;
pub mod identity;
pub mod text;

pub use error::{Code, Error, Kind, Result};
