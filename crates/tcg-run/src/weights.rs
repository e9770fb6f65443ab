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

use std::collections::{BTreeMap, BTreeSet};
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

/// How the names of a checkpoint become the graph's names: names that do not
/// start with `strip_prefix` (when set) belong to another component and are
/// skipped; the prefix is removed from the others, then `add_prefix` is put
/// in front.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Naming {
    /// Removed from the front of every name (`"unet."` for a pipeline's checkpoint).
    pub strip_prefix: String,
    /// Put in front of every name after stripping.
    pub add_prefix: String,
}

/// The most bytes a sharded checkpoint's index (`*.safetensors.index.json`) may hold.
pub const MAX_INDEX_BYTES: u64 = 64 << 20;

/// One or more safetensors files read into memory this process owns, their
/// tensors named as the graph names them ([`Naming`]).
pub struct Checkpoint {
    files: Vec<Mapped>,
    names: BTreeMap<String, (usize, Entry)>,
    skipped: usize,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("files", &self.files)
            .field("tensors", &self.names.len())
            .finish()
    }
}

fn weights_err(what: impl std::fmt::Display) -> Error {
    Error::new(Code::RunWeightsInvalid, what.to_string())
}

fn plain_file_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains('/') && !name.contains('\0')
}

/// The safetensors files a weights path stands for: a `.safetensors` file;
/// a sharded checkpoint's index (`*.safetensors.index.json`, as
/// `save_pretrained` writes it), whose shards sit beside it; or a directory
/// holding exactly one index or, without one, exactly one `.safetensors` file.
/// With an index, each shard must hold exactly the names the index maps to it.
pub fn checkpoint_files(path: &Path) -> Result<Vec<(PathBuf, Option<BTreeSet<String>>)>> {
    let meta = std::fs::metadata(path)
        .map_err(|e| weights_err(format_args!("cannot open {}: {e}", path.display())))?;
    if meta.is_dir() {
        let mut index = Vec::new();
        let mut plain = Vec::new();
        let entries = std::fs::read_dir(path)
            .map_err(|e| weights_err(format_args!("cannot list {}: {e}", path.display())))?;
        for entry in entries {
            let entry = entry
                .map_err(|e| weights_err(format_args!("cannot list {}: {e}", path.display())))?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if name.ends_with(".safetensors.index.json") {
                index.push(entry.path());
            } else if name.ends_with(".safetensors") {
                plain.push(entry.path());
            }
        }
        index.sort();
        plain.sort();
        return match (index.len(), plain.len()) {
            (1, _) => checkpoint_files(&index[0]),
            (0, 1) => Ok(vec![(plain.remove(0), None)]),
            (0, 0) => Err(weights_err(format_args!(
                "{} holds no .safetensors file and no .safetensors.index.json",
                path.display()
            ))),
            (0, n) => Err(weights_err(format_args!(
                "{} holds {n} .safetensors files and no index; name the file or its *.safetensors.index.json",
                path.display()
            ))),
            (n, _) => Err(weights_err(format_args!(
                "{} holds {n} .safetensors.index.json files; name one",
                path.display()
            ))),
        };
    }
    let is_index = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.ends_with(".index.json"));
    if !is_index {
        return Ok(vec![(path.to_owned(), None)]);
    }
    if meta.len() > MAX_INDEX_BYTES {
        return Err(weights_err(format_args!(
            "{} is {} bytes, more than the {MAX_INDEX_BYTES} an index may hold",
            path.display(),
            meta.len()
        )));
    }
    let bytes = std::fs::read(path)
        .map_err(|e| weights_err(format_args!("cannot read {}: {e}", path.display())))?;
    let value = tcg_cj::parse_strict(&bytes)
        .map_err(|e| weights_err(format_args!("{} is not valid JSON: {e}", path.display())))?;
    let map = value
        .as_object()
        .and_then(|o| o.get("weight_map"))
        .and_then(|m| m.as_object())
        .ok_or_else(|| {
            weights_err(format_args!(
                "{} has no weight_map object (not a safetensors index)",
                path.display()
            ))
        })?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut shards: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (name, shard) in map {
        let shard = shard
            .as_str()
            .filter(|s| plain_file_name(s))
            .ok_or_else(|| {
                weights_err(format_args!(
                    "{}: the shard of {name:?} is not a plain file name beside the index",
                    path.display()
                ))
            })?;
        shards
            .entry(shard.to_owned())
            .or_default()
            .insert(name.clone());
    }
    Ok(shards
        .into_iter()
        .map(|(shard, names)| (dir.join(shard), Some(names)))
        .collect())
}

impl Checkpoint {
    /// Read every file of `paths` (each as [`checkpoint_files`] resolves it)
    /// and name its tensors by `naming`. A name two files hold is refused,
    /// as is a shard that does not hold exactly what its index maps to it.
    pub fn open(paths: &[PathBuf], naming: &Naming) -> Result<Checkpoint> {
        if paths.is_empty() {
            return Err(weights_err("no weights file was given"));
        }
        let mut files = Vec::new();
        let mut names: BTreeMap<String, (usize, Entry)> = BTreeMap::new();
        let mut skipped = 0usize;
        for path in paths {
            for (file, expected) in checkpoint_files(path)? {
                let mapped = Mapped::open(&file, Code::RunWeightsInvalid)?;
                let tensors = mapped.tensors(Code::RunWeightsInvalid)?;
                if let Some(expected) = &expected {
                    let held: BTreeSet<&String> = tensors.keys().collect();
                    let want: BTreeSet<&String> = expected.iter().collect();
                    if held != want {
                        let extra: Vec<_> = held.difference(&want).take(8).collect();
                        let missing: Vec<_> = want.difference(&held).take(8).collect();
                        return Err(weights_err(format_args!(
                            "{} does not hold what its index maps to it (not in the index: {extra:?}; missing: {missing:?})",
                            file.display()
                        )));
                    }
                }
                let index = files.len();
                for (name, entry) in tensors {
                    let local = if naming.strip_prefix.is_empty() {
                        name.as_str()
                    } else {
                        match name.strip_prefix(&naming.strip_prefix) {
                            Some(rest) => rest,
                            None => {
                                skipped += 1;
                                continue;
                            }
                        }
                    };
                    let graph_name = format!("{}{local}", naming.add_prefix);
                    if let Some((other, _)) = names.get(&graph_name) {
                        return Err(weights_err(format_args!(
                            "{graph_name:?} is in both {} and {}",
                            files
                                .get(*other)
                                .map(|m: &Mapped| m.path().display().to_string())
                                .unwrap_or_else(|| file.display().to_string()),
                            file.display()
                        )));
                    }
                    names.insert(graph_name, (index, entry));
                }
                files.push(mapped);
            }
        }
        Ok(Checkpoint {
            files,
            names,
            skipped,
        })
    }

    /// The graph names of every tensor.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.names.keys().map(String::as_str)
    }

    /// A tensor by graph name: its entry and bytes.
    pub fn get(&self, name: &str) -> Option<(&Entry, &[u8])> {
        self.names
            .get(name)
            .map(|(i, e)| (e, self.files[*i].bytes(e)))
    }

    /// The file a tensor was read from.
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        self.names.get(name).map(|(i, _)| self.files[*i].path())
    }

    /// How many tensors were skipped for lying outside `strip_prefix`.
    pub fn skipped(&self) -> usize {
        self.skipped
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
