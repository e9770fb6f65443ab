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

/// A safetensors file of float32 tensors `(name, shape, values)`, with
/// optional `lora_adapter_metadata` in its header.
pub fn write_f32<N: AsRef<str>>(
    path: &Path,
    tensors: &[(N, Vec<usize>, Vec<f32>)],
    metadata: Option<&str>,
) {
    let mut parts = Vec::new();
    let mut data = Vec::new();
    if let Some(m) = metadata {
        parts.push(format!(
            r#""__metadata__":{{"lora_adapter_metadata":{m:?}}}"#
        ));
    }
    for (name, shape, values) in tensors {
        let name = name.as_ref();
        let at = data.len();
        for v in values {
            data.extend_from_slice(&v.to_le_bytes());
        }
        parts.push(format!(
            r#""{name}":{{"dtype":"F32","shape":{shape:?},"data_offsets":[{at},{}]}}"#,
            data.len()
        ));
    }
    let header = format!("{{{}}}", parts.join(","));
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&data);
    std::fs::write(path, bytes).unwrap();
}
