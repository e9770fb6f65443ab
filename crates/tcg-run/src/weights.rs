//! Safetensors files, read into memory this process owns and checked against
//! the constant table.
//!
//! The file is read with `read(2)`, not mapped: a mapping of a file that
//! another process truncates or rewrites faults (`SIGBUS`) on the next touch
//! of a vanished page and kills the process. Reading costs one copy from the
//! page cache, which is small next to the container's own copy of every
//! constant, and the buffer is dropped as soon as the constants are bound.
//! A file that changes while it is read gives either a consistent read or a
//! typed refusal (a header or tensor that no longer fits), never a crash.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use tcg_core::artifact::literals::dtype_by_code;
use tcg_core::{Code, Error, Result};

/// One tensor of a mapped file: its dtype name, shape and where its bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Inductor's dtype name, or the lower-cased safetensors code for a dtype
    /// inductor has no name for.
    pub dtype: String,
    /// The shape.
    pub shape: Vec<usize>,
    range: std::ops::Range<usize>,
}

/// A safetensors file read into an owned buffer.
pub struct Mapped {
    path: PathBuf,
    map: Vec<u8>,
}

impl std::fmt::Debug for Mapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapped").field("path", &self.path).finish()
    }
}

impl Mapped {
    /// Read `path`; a missing or unreadable file is an error of `code`.
    pub fn open(path: &Path, code: Code) -> Result<Mapped> {
        let mut file = File::open(path)
            .map_err(|e| Error::new(code, format!("cannot open {}: {e}", path.display())))?;
        let hint = file.metadata().map(|m| m.len()).unwrap_or(0);
        let mut map = Vec::new();
        map.try_reserve_exact(usize::try_from(hint).unwrap_or(0))
            .map_err(|e| Error::new(code, format!("cannot read {}: {e}", path.display())))?;
        file.read_to_end(&mut map)
            .map_err(|e| Error::new(code, format!("cannot read {}: {e}", path.display())))?;
        Ok(Mapped {
            path: path.to_owned(),
            map,
        })
    }

    /// The path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Parse the header (bounded by the safetensors crate: header size,
    /// offsets inside the file, no overlap) and list every tensor by name.
    pub fn tensors(&self, code: Code) -> Result<BTreeMap<String, Entry>> {
        let parsed = SafeTensors::deserialize(&self.map).map_err(|e| {
            Error::new(
                code,
                format!(
                    "{} is not a valid safetensors file: {e}",
                    self.path.display()
                ),
            )
        })?;
        let base = self.map.as_ptr() as usize;
        let mut out = BTreeMap::new();
        for (name, view) in parsed.tensors() {
            // Inductor's name through the artifact layer's one safetensors table.
            let st_code = view.dtype().to_string();
            let dtype = match dtype_by_code(&st_code) {
                Some((name, _)) => name.to_owned(),
                None => st_code.to_lowercase(),
            };
            let data = view.data();
            // A dimension must be an int64 for libtorch (with a zero
            // dimension elsewhere, the byte size below cannot tell).
            if view.shape().iter().any(|&d| i64::try_from(d).is_err()) {
                return Err(Error::new(
                    code,
                    format!(
                        "{}: tensor {name:?} has shape {:?}, beyond int64",
                        self.path.display(),
                        view.shape()
                    ),
                ));
            }
            let numel = view
                .shape()
                .iter()
                .try_fold(1usize, |n, &d| n.checked_mul(d));
            let expected = numel.and_then(|n| n.checked_mul(view.dtype().bitsize() / 8));
            if expected != Some(data.len()) {
                return Err(Error::new(
                    code,
                    format!(
                        "{}: tensor {name:?} holds {} bytes, its shape needs {expected:?}",
                        self.path.display(),
                        data.len()
                    ),
                ));
            }
            let start = data.as_ptr() as usize - base;
            out.insert(
                name,
                Entry {
                    dtype,
                    shape: view.shape().to_vec(),
                    range: start..start + data.len(),
                },
            );
        }
        Ok(out)
    }

    /// The bytes of `entry`, a tensor of this file.
    pub fn bytes(&self, entry: &Entry) -> &[u8] {
        &self.map[entry.range.clone()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors file of one tensor with this JSON shape and no bytes.
    fn file(dir: &Path, shape: &str) -> PathBuf {
        let header = format!(r#"{{"t":{{"dtype":"F32","shape":{shape},"data_offsets":[0,0]}}}}"#);
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        let p = dir.join("w.safetensors");
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn shapes_beyond_int64_or_overflowing_are_refused_with_the_code() {
        let d = tempfile::tempdir().unwrap();
        // A zero dimension hides a dimension libtorch cannot take.
        let p = file(d.path(), "[0,18446744073709551615]");
        let err = Mapped::open(&p, Code::RunWeightsInvalid)
            .unwrap()
            .tensors(Code::RunWeightsInvalid)
            .unwrap_err();
        assert_eq!(err.code(), Code::RunWeightsInvalid);
        assert!(err.message().contains("beyond int64"), "{err}");
        // An element count that overflows: refused (by the parser's checked
        // arithmetic or ours), never a panic.
        let p = file(d.path(), "[4294967296,4294967296,2]");
        let err = Mapped::open(&p, Code::RunWeightsInvalid)
            .unwrap()
            .tensors(Code::RunWeightsInvalid)
            .unwrap_err();
        assert_eq!(err.code(), Code::RunWeightsInvalid);
        // A sane empty tensor is fine.
        let p = file(d.path(), "[0,4]");
        let t = Mapped::open(&p, Code::RunWeightsInvalid)
            .unwrap()
            .tensors(Code::RunWeightsInvalid)
            .unwrap();
        assert_eq!(t["t"].shape, vec![0, 4]);
    }
}
