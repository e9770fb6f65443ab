//! Safetensors files: their headers parsed and checked, their tensors read
//! later into memory this process owns.
//!
//! A file is opened once and read with `pread(2)` from that one descriptor,
//! never mapped: a mapping of a file that another process truncates or
//! rewrites faults (`SIGBUS`) on the next touch of a vanished page and kills
//! the process. Opening reads only the header (bounded, as the safetensors
//! format bounds it) and checks that the file holds exactly the bytes the
//! header declares; the tensors are read by the weights pipeline
//! ([`crate::pipeline`]) straight into their final place. A file that is
//! truncated or changed after it was opened is a typed refusal (a short read,
//! or a size or modification time that differs from what was seen at open),
//! never a crash.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use safetensors::tensor::{Metadata, TensorInfo};
use tcg_core::artifact::literals::dtype_by_code;
use tcg_core::{Code, Error, Result};

/// The most bytes a safetensors header may hold (the format's own bound).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor of a file: its dtype name, shape and where its bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Inductor's dtype name, or the lower-cased safetensors code for a dtype
    /// inductor has no name for.
    pub dtype: String,
    /// The shape.
    pub shape: Vec<usize>,
    /// The absolute offset of its first byte in the file.
    pub offset: u64,
    /// Its length in bytes.
    pub len: usize,
}

/// What identifies a file's contents cheaply: compared at open and after a read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
    ino: u64,
}

fn stamp(meta: &std::fs::Metadata) -> Stamp {
    Stamp {
        len: meta.len(),
        mtime: (meta.mtime(), meta.mtime_nsec()),
        ctime: (meta.ctime(), meta.ctime_nsec()),
        ino: meta.ino(),
    }
}

/// A safetensors file, open, its header parsed and checked against its size.
pub struct Source {
    path: PathBuf,
    file: File,
    stamp: Stamp,
    code: Code,
    /// Bytes of tensor data read so far (the header is not counted).
    read: AtomicU64,
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Source").field("path", &self.path).finish()
    }
}

/// Open `path` for reading only if it is a regular file (after symlinks):
/// the descriptor is opened with `O_NONBLOCK`, so a FIFO or a device opens
/// at once instead of waiting for a writer, and the *opened descriptor* is
/// checked with `fstat` (no window between a check of the path and the open).
/// Symlinks are followed on purpose: the Hugging Face cache links every file
/// of a snapshot to a blob. Returns the file (blocking again) and its metadata.
pub fn open_regular(path: &Path, code: Code) -> Result<(File, std::fs::Metadata)> {
    use std::os::unix::fs::OpenOptionsExt;
    use std::os::unix::io::AsRawFd;
    let err = |what: String| Error::new(code, format!("{}: {what}", path.display()));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| err(format!("cannot open: {e}")))?;
    let meta = file
        .metadata()
        .map_err(|e| err(format!("cannot stat: {e}")))?;
    if !meta.is_file() {
        return Err(err(format!(
            "is not a regular file ({}); weights are read from regular files only",
            kind_of(&meta)
        )));
    }
    // Reads of a regular file never wait on O_NONBLOCK, but the flag is
    // cleared so that the descriptor behaves as an ordinary one.
    // SAFETY: fcntl on a descriptor this function owns.
    unsafe {
        let fd = file.as_raw_fd();
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
        }
    }
    Ok((file, meta))
}

fn kind_of(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else {
        "not a plain file"
    }
}

/// The tensors a safetensors header declares, checked against the size of
/// the file that holds it: `header` is the JSON (the `n` bytes after the
/// 8-byte length) and `file_size` the whole file's. The data section must
/// hold exactly the bytes the header declares. Every size and offset comes
/// from untrusted bytes, so all arithmetic on them is checked: a header
/// whose offsets end near 2^64 is a refusal, never an overflow. Errors are
/// messages for the caller to put a path in front of.
pub fn header_entries(
    header: &[u8],
    file_size: u64,
) -> std::result::Result<BTreeMap<String, Entry>, String> {
    let n = header.len() as u64;
    if n > MAX_HEADER_BYTES {
        return Err(format!(
            "is not a valid safetensors file: its header claims {n} bytes, more than the {MAX_HEADER_BYTES} allowed"
        ));
    }
    let data_start = 8 + n;
    if data_start > file_size {
        return Err(format!(
            "is truncated: its header claims {n} bytes, the file holds {file_size} in all"
        ));
    }
    let held = file_size - data_start;
    let parsed =
        parse_header(header).map_err(|e| format!("is not a valid safetensors file: {e}"))?;
    let data_len = u64::try_from(parsed.data_len()).unwrap_or(u64::MAX);
    if data_len != held {
        return Err(if data_len > held {
            format!(
                "is truncated: its header declares {data_len} bytes of tensors, the file holds {held}"
            )
        } else {
            format!(
                "holds {} bytes after the tensors its header declares (not a safetensors file as written)",
                held - data_len
            )
        });
    }
    let mut out = BTreeMap::new();
    for (name, info) in parsed.tensors() {
        let st_code = info.dtype.to_string();
        let dtype = match dtype_by_code(&st_code) {
            Some((name, _)) => name.to_owned(),
            None => st_code.to_lowercase(),
        };
        // A dimension must be an int64 for libtorch (with a zero dimension
        // elsewhere, the byte size cannot tell).
        if info.shape.iter().any(|&d| i64::try_from(d).is_err()) {
            return Err(format!(
                "tensor {name:?} has shape {:?}, beyond int64",
                info.shape
            ));
        }
        let (start, end) = info.data_offsets;
        // The crate checked that the ranges tile `0..data_len` and that each
        // length is its shape's; checked again here, so that no header can
        // make an offset wrap whatever the crate's version does.
        let range = u64::try_from(start)
            .ok()
            .zip(u64::try_from(end).ok())
            .filter(|(s, e)| s <= e && *e <= data_len)
            .and_then(|(s, e)| Some((data_start.checked_add(s)?, usize::try_from(e - s).ok()?)));
        let Some((offset, len)) = range else {
            return Err(format!(
                "tensor {name:?} has data offsets {:?} outside the {data_len} bytes of tensors",
                info.data_offsets
            ));
        };
        out.insert(
            name,
            Entry {
                dtype,
                shape: info.shape.clone(),
                offset,
                len,
            },
        );
    }
    Ok(out)
}

/// A whole safetensors file image (its 8-byte header length, header and
/// tensors, `file_size` bytes in all, of which `bytes` are the start) parsed
/// as [`Source::open`] parses a file: for tests and the `safetensors_header`
/// fuzz target, which cannot make files of every size.
pub fn image_entries(
    bytes: &[u8],
    file_size: u64,
) -> std::result::Result<BTreeMap<String, Entry>, String> {
    let Some(len) = bytes.get(..8) else {
        return Err(format!(
            "is not a valid safetensors file: {file_size} bytes, too short for a header"
        ));
    };
    let n = u64::from_le_bytes(len.try_into().expect("8 bytes"));
    if n > MAX_HEADER_BYTES {
        return Err(format!(
            "is not a valid safetensors file: its header claims {n} bytes, more than the {MAX_HEADER_BYTES} allowed"
        ));
    }
    let header = usize::try_from(n)
        .ok()
        .and_then(|n| bytes.get(8..8 + n))
        .ok_or_else(|| {
            format!("is truncated: its header claims {n} bytes, the file holds {file_size} in all")
        })?;
    header_entries(header, file_size)
}

impl Source {
    /// Open `path` (a regular file: see [`open_regular`]) and parse its
    /// header; every refusal is an error of `code`. Nothing past the header
    /// is read. Returns the file and its tensors by name.
    pub fn open(path: &Path, code: Code) -> Result<(Source, BTreeMap<String, Entry>)> {
        let err = |what: String| Error::new(code, format!("{}: {what}", path.display()));
        let (file, meta) = open_regular(path, code)?;
        let size = meta.len();
        let mut n = [0u8; 8];
        file.read_exact_at(&mut n, 0).map_err(|_| {
            err(format!(
                "is not a valid safetensors file: {size} bytes, too short for a header"
            ))
        })?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER_BYTES {
            return Err(err(format!(
                "is not a valid safetensors file: its header claims {n} bytes, more than the {MAX_HEADER_BYTES} allowed"
            )));
        }
        if 8 + n > size {
            return Err(err(format!(
                "is truncated: its header claims {n} bytes, the file holds {size} in all"
            )));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact_at(&mut header, 8)
            .map_err(|e| err(format!("cannot read the header: {e}")))?;
        let out = header_entries(&header, size).map_err(err)?;
        Ok((
            Source {
                path: path.to_owned(),
                file,
                stamp: stamp(&meta),
                code,
                read: AtomicU64::new(0),
            },
            out,
        ))
    }

    /// The path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Fill `buf` from `offset`; a short read (the file shrank) is an error.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.read.fetch_add(buf.len() as u64, Ordering::Relaxed);
        self.file.read_exact_at(buf, offset).map_err(|e| {
            Error::new(
                self.code,
                format!(
                    "{}: cannot read {} bytes at offset {offset} (the file changed or was truncated after it was opened?): {e}",
                    self.path.display(),
                    buf.len()
                ),
            )
        })
    }

    /// Bytes of tensor data read from this file so far.
    pub fn bytes_read(&self) -> u64 {
        self.read.load(Ordering::Relaxed)
    }

    /// Refuse a file whose size, inode or modification time differ from
    /// what was seen when it was opened (it was rewritten in place meanwhile).
    pub fn check_unchanged(&self) -> Result<()> {
        let now = self.file.metadata().map_err(|e| {
            Error::new(
                self.code,
                format!("{}: cannot stat: {e}", self.path.display()),
            )
        })?;
        if stamp(&now) != self.stamp {
            return Err(Error::new(
                self.code,
                format!(
                    "{} changed while its weights were read (size or modification time differ from when it was opened); nothing was bound",
                    self.path.display()
                ),
            ));
        }
        Ok(())
    }

    /// The bytes of `entry`, a tensor of this file, read into a new buffer.
    pub fn read_entry(&self, entry: &Entry) -> Result<Vec<u8>> {
        let mut buf = Vec::new();
        buf.try_reserve_exact(entry.len).map_err(|e| {
            Error::new(
                Code::RunWeightsTooLarge,
                format!(
                    "cannot hold {} bytes of {}: {e}",
                    entry.len,
                    self.path.display()
                ),
            )
        })?;
        buf.resize(entry.len, 0);
        self.read_at(&mut buf, entry.offset)?;
        Ok(buf)
    }
}

/// The header as the safetensors format defines it: a JSON object of tensor
/// infos (and an optional `__metadata__` map of strings), whose data ranges
/// must tile the data section exactly (checked by the safetensors crate).
fn parse_header(header: &[u8]) -> std::result::Result<Metadata, String> {
    let text = std::str::from_utf8(header).map_err(|e| format!("its header is not UTF-8: {e}"))?;
    let value: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(text).map_err(|e| format!("its header is not a JSON object: {e}"))?;
    let mut tensors: Vec<(String, TensorInfo)> = Vec::with_capacity(value.len());
    let mut extra = None;
    for (name, v) in value {
        if name == "__metadata__" {
            let m: std::collections::HashMap<String, String> = serde_json::from_value(v)
                .map_err(|e| format!("its __metadata__ is not a map of strings: {e}"))?;
            extra = Some(m);
            continue;
        }
        let info: TensorInfo = serde_json::from_value(v)
            .map_err(|e| format!("tensor {name:?} is not a tensor entry: {e}"))?;
        tensors.push((name, info));
    }
    tensors.sort_by_key(|(_, info)| info.data_offsets);
    Metadata::new(extra, tensors).map_err(|e| format!("{e}"))
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

/// The most bytes of each alias [`Checkpoint::same_values`] holds at once.
pub const COMPARE_CHUNK: usize = 1 << 20;

/// The most bytes a sharded checkpoint's index (`*.safetensors.index.json`) may hold.
pub const MAX_INDEX_BYTES: u64 = 64 << 20;

/// One or more safetensors files read into memory this process owns, their
/// tensors named as the graph names them ([`Naming`]).
pub struct Checkpoint {
    files: Vec<Source>,
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
    // The index is opened as the files are (a FIFO would block a plain read
    // forever), and bounded by what is read, not by a size seen earlier.
    let (file, meta) = open_regular(path, Code::RunWeightsInvalid)?;
    if meta.len() > MAX_INDEX_BYTES {
        return Err(weights_err(format_args!(
            "{} is {} bytes, more than the {MAX_INDEX_BYTES} an index may hold",
            path.display(),
            meta.len()
        )));
    }
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(
        &mut std::io::Read::take(&file, MAX_INDEX_BYTES + 1),
        &mut bytes,
    )
    .map_err(|e| weights_err(format_args!("cannot read {}: {e}", path.display())))?;
    if bytes.len() as u64 > MAX_INDEX_BYTES {
        return Err(weights_err(format_args!(
            "{} grew past the {MAX_INDEX_BYTES} bytes an index may hold while it was read",
            path.display()
        )));
    }
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
                let (mapped, tensors) = Source::open(&file, Code::RunWeightsInvalid)?;
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
                                .map(|m: &Source| m.path().display().to_string())
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

    /// A tensor by graph name: its entry and the index of its file.
    pub fn entry(&self, name: &str) -> Option<(usize, &Entry)> {
        self.names.get(name).map(|(i, e)| (*i, e))
    }

    /// The files, in the order [`Checkpoint::entry`] indexes them.
    pub fn sources(&self) -> &[Source] {
        &self.files
    }

    /// Whether the tensors `a` and `b` (graph names) hold the same bytes,
    /// compared in chunks of at most [`COMPARE_CHUNK`] bytes each, so that
    /// comparing two aliases of a large tensor holds two chunks in memory,
    /// never the two tensors; the first difference ends the comparison.
    /// Tensors of different lengths differ without a read. A name the
    /// checkpoint lacks is `run.constant_missing`.
    pub fn same_values(&self, a: &str, b: &str) -> Result<bool> {
        let get = |name: &str| {
            self.names.get(name).ok_or_else(|| {
                Error::new(
                    Code::RunConstantMissing,
                    format!("the weights lack {name:?}"),
                )
            })
        };
        let ((fa, ea), (fb, eb)) = (get(a)?, get(b)?);
        if ea.len != eb.len {
            return Ok(false);
        }
        let chunk = COMPARE_CHUNK.min(ea.len);
        let mut left = vec![0u8; chunk];
        let mut right = vec![0u8; chunk];
        let mut at = 0usize;
        while at < ea.len {
            let n = chunk.min(ea.len - at);
            self.files[*fa].read_at(&mut left[..n], ea.offset + at as u64)?;
            self.files[*fb].read_at(&mut right[..n], eb.offset + at as u64)?;
            if left[..n] != right[..n] {
                return Ok(false);
            }
            at += n;
        }
        Ok(true)
    }

    /// Bytes of tensor data read from every file so far (headers are not
    /// counted): what the tests use to show that a refusal read nothing.
    pub fn bytes_read(&self) -> u64 {
        self.files.iter().map(Source::bytes_read).sum()
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
        let err = Source::open(&p, Code::RunWeightsInvalid).unwrap_err();
        assert_eq!(err.code(), Code::RunWeightsInvalid);
        assert!(err.message().contains("beyond int64"), "{err}");
        // An element count that overflows: refused (by the parser's checked
        // arithmetic or ours), never a panic.
        let p = file(d.path(), "[4294967296,4294967296,2]");
        let err = Source::open(&p, Code::RunWeightsInvalid).unwrap_err();
        assert_eq!(err.code(), Code::RunWeightsInvalid);
        // A sane empty tensor is fine.
        let p = file(d.path(), "[0,4]");
        let (_, t) = Source::open(&p, Code::RunWeightsInvalid).unwrap();
        assert_eq!(t["t"].shape, vec![0, 4]);
    }

    fn two_tensors(dir: &Path) -> PathBuf {
        let header = r#"{"__metadata__":{"format":"pt"},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},"a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend((0u8..16).collect::<Vec<_>>());
        let p = dir.join("two.safetensors");
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn headers_are_read_alone_and_tensors_on_demand() {
        let d = tempfile::tempdir().unwrap();
        let p = two_tensors(d.path());
        let (src, t) = Source::open(&p, Code::RunWeightsInvalid).unwrap();
        assert_eq!(t["a"].dtype, "bfloat16");
        assert_eq!(t["b"].dtype, "float32");
        assert_eq!(
            src.read_entry(&t["b"]).unwrap(),
            (8u8..16).collect::<Vec<_>>()
        );
        assert_eq!(t["a"].len, 8);
        src.check_unchanged().unwrap();
    }

    #[test]
    fn truncated_padded_and_changed_files_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let p = two_tensors(d.path());
        let full = std::fs::read(&p).unwrap();
        // Truncated: the header declares more than the file holds.
        std::fs::write(&p, &full[..full.len() - 3]).unwrap();
        let err = Source::open(&p, Code::RunWeightsInvalid).unwrap_err();
        assert_eq!(err.code(), Code::RunWeightsInvalid);
        assert!(err.message().contains("truncated"), "{err}");
        // Trailing bytes the header does not declare.
        let mut long = full.clone();
        long.push(0);
        std::fs::write(&p, &long).unwrap();
        let err = Source::open(&p, Code::RunWeightsInvalid).unwrap_err();
        assert!(err.message().contains("after the tensors"), "{err}");
        // A header length beyond the file.
        std::fs::write(&p, 1000u64.to_le_bytes()).unwrap();
        let err = Source::open(&p, Code::RunWeightsInvalid).unwrap_err();
        assert!(err.message().contains("truncated"), "{err}");
        // Changed after open: truncated in place, then rewritten.
        std::fs::write(&p, &full).unwrap();
        let (src, t) = Source::open(&p, Code::RunWeightsInvalid).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.set_len(full.len() as u64 - 8).unwrap();
        let err = src.read_entry(&t["b"]).unwrap_err();
        assert_eq!(err.code(), Code::RunWeightsInvalid);
        let err = src.check_unchanged().unwrap_err();
        assert!(err.message().contains("changed while"), "{err}");
    }

    /// A header of U8 tensors of `lens` bytes tiling the data section, as
    /// its JSON: the offsets are whatever the lengths add up to (near 2^64
    /// for hostile ones), with no data behind them.
    fn tiled_header(lens: &[u64]) -> String {
        let mut at = 0u64;
        let mut parts = Vec::new();
        for (i, len) in lens.iter().enumerate() {
            parts.push(format!(
                r#""t{i:02}":{{"dtype":"U8","shape":[{len}],"data_offsets":[{at},{}]}}"#,
                at.wrapping_add(*len)
            ));
            at = at.wrapping_add(*len);
        }
        format!("{{{}}}", parts.join(","))
    }

    fn image(header: &str) -> Vec<u8> {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes
    }

    #[test]
    fn headers_whose_offsets_end_near_2_pow_64_are_refused_not_overflowed() {
        // Sixteen tensors of 2^60 bytes, the last one byte short: the data
        // section ends at 2^64 - 1, which the header's length would wrap.
        let mut lens = vec![1u64 << 60; 16];
        lens[15] -= 1;
        let header = tiled_header(&lens);
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("huge.safetensors");
        std::fs::write(&p, image(&header)).unwrap();
        let err = Source::open(&p, Code::RunWeightsInvalid).unwrap_err();
        assert_eq!(err.code(), Code::RunWeightsInvalid);
        assert!(err.message().contains("truncated"), "{err}");
        // The same header against every file size that could meet it.
        for size in [0, 8, u64::MAX, u64::MAX - 7, i64::MAX as u64, 1 << 63] {
            assert!(image_entries(&image(&header), size).is_err(), "{size}");
        }
        // One tensor whose end is u64::MAX (its length is not its shape's).
        let one = r#"{"t":{"dtype":"U8","shape":[1],"data_offsets":[18446744073709551614,18446744073709551615]}}"#;
        assert!(image_entries(&image(one), u64::MAX).is_err());
        // A length field of 2^64 - 1 and short images: refused.
        assert!(image_entries(&u64::MAX.to_le_bytes(), u64::MAX).is_err());
        assert!(image_entries(&[1, 2, 3], 3).is_err());
    }

    #[test]
    fn hostile_headers_never_panic_and_accepted_ones_lie_inside_the_file() {
        // Lengths and sizes at the edges of u64, in every combination.
        let edges = [
            0u64,
            1,
            255,
            256,
            (1 << 32) - 1,
            1 << 32,
            (1 << 60) - 1,
            1 << 60,
            i64::MAX as u64,
            (i64::MAX as u64) + 1,
            u64::MAX - 1,
            u64::MAX,
        ];
        for &a in &edges {
            for &b in &edges {
                let header = tiled_header(&[a, b]);
                let img = image(&header);
                let exact = (img.len() as u64).wrapping_add(a).wrapping_add(b);
                for size in [
                    exact,
                    exact.wrapping_sub(1),
                    exact.wrapping_add(1),
                    u64::MAX,
                    0,
                ] {
                    if let Ok(entries) = image_entries(&img, size) {
                        for e in entries.values() {
                            let end = e.offset.checked_add(e.len as u64).expect("no wrap");
                            assert!(
                                e.offset >= img.len() as u64 && end <= size,
                                "{a} {b} {size}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// A FIFO at `path` (nobody ever writes it).
    fn fifo(path: &Path) {
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    }

    /// Run `f` on a thread and fail (rather than hang the suite) when it has
    /// not returned within a generous bound: opening a FIFO for reading waits
    /// for a writer forever.
    fn within<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(std::time::Duration::from_secs(20))
            .expect("blocked on a non-regular file")
    }

    #[test]
    fn fifos_are_refused_as_files_shards_indexes_and_directory_members_without_blocking() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().to_owned();
        // A FIFO named as a weights file.
        fifo(&root.join("w.safetensors"));
        // A directory whose one .safetensors is a FIFO.
        std::fs::create_dir(root.join("dir")).unwrap();
        fifo(&root.join("dir/model.safetensors"));
        // A FIFO as the index, named directly and found in a directory.
        std::fs::create_dir(root.join("idx")).unwrap();
        fifo(&root.join("idx/model.safetensors.index.json"));
        // An index whose shard is a FIFO.
        std::fs::create_dir(root.join("shard")).unwrap();
        std::fs::write(
            root.join("shard/model.safetensors.index.json"),
            r#"{"weight_map":{"a":"a.safetensors"}}"#,
        )
        .unwrap();
        fifo(&root.join("shard/a.safetensors"));
        // A symlink to a FIFO: followed, then refused by what it opens.
        std::os::unix::fs::symlink(root.join("w.safetensors"), root.join("link.safetensors"))
            .unwrap();
        for path in [
            "w.safetensors",
            "dir",
            "idx",
            "idx/model.safetensors.index.json",
            "shard",
            "link.safetensors",
        ] {
            let p = root.join(path);
            let err = within(move || Checkpoint::open(&[p], &Naming::default()).unwrap_err());
            assert_eq!(err.code(), Code::RunWeightsInvalid, "{path}: {err}");
            assert!(
                err.message().contains("not a regular file"),
                "{path}: {err}"
            );
        }
        // A directory given where a file is read, and a device.
        let err = Source::open(&root, Code::RunWeightsInvalid).unwrap_err();
        assert!(err.message().contains("a directory"), "{err}");
        let err =
            within(|| Source::open(Path::new("/dev/null"), Code::RunLiteralPayload).unwrap_err());
        assert_eq!(err.code(), Code::RunLiteralPayload);
        assert!(err.message().contains("character device"), "{err}");
    }

    #[test]
    fn aliases_are_compared_in_chunks_to_the_last_byte() {
        let d = tempfile::tempdir().unwrap();
        // Two tensors of 2.5 chunks each, equal, then differing in the last byte.
        let len = COMPARE_CHUNK * 5 / 2;
        let write = |last: u8| {
            let header = format!(
                r#"{{"a":{{"dtype":"U8","shape":[{len}],"data_offsets":[0,{len}]}},"b":{{"dtype":"U8","shape":[{len}],"data_offsets":[{len},{}]}},"c":{{"dtype":"U8","shape":[1],"data_offsets":[{},{}]}}}}"#,
                2 * len,
                2 * len,
                2 * len + 1
            );
            let mut bytes = image(&header);
            let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            bytes.extend_from_slice(&data);
            let mut other = data.clone();
            *other.last_mut().unwrap() = last;
            bytes.extend_from_slice(&other);
            bytes.push(7);
            let p = d.path().join("t.safetensors");
            std::fs::write(&p, bytes).unwrap();
            Checkpoint::open(&[p], &Naming::default()).unwrap()
        };
        let same = write(((len - 1) % 251) as u8);
        assert!(same.same_values("a", "b").unwrap());
        assert_eq!(same.bytes_read(), 2 * len as u64);
        let differ = write(255);
        assert!(!differ.same_values("a", "b").unwrap());
        // Different lengths differ without a read; a missing name is typed.
        assert!(!differ.same_values("a", "c").unwrap());
        assert_eq!(differ.bytes_read(), 2 * len as u64);
        let err = differ.same_values("a", "nope").unwrap_err();
        assert_eq!(err.code(), Code::RunConstantMissing);
    }
}
