//! What the integration tests on the reference artifact share: its key, the
//! repository's paths, libtorch from the venv and float32 bytes read back.
#![allow(dead_code)] // each test binary uses its own part of it

use std::path::{Path, PathBuf};

/// The key of the 0.2.0 reference artifact (`testdata/reference-0.2.0`).
pub const KEY: &str = "cg-key-v1-ddd506362c49696787e3eb3d0e44c08b00a6358015d9004ba1cd363a";

/// The repository's root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A file of the reference artifact's fixtures.
pub fn fixture(name: &str) -> PathBuf {
    root().join("testdata/reference-0.2.0").join(name)
}

/// libtorch's directory: `$TCG_TORCH_LIB`, else the project venv's torch.
pub fn torch_lib() -> PathBuf {
    std::env::var_os("TCG_TORCH_LIB")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".venv/lib/python3.11/site-packages/torch/lib"))
}

/// Little-endian float32 bytes as values.
pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}
