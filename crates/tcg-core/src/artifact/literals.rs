//! The literal payload `constants.safetensors` (SPEC-v1 §8.8): verification
//! with a streamed digest, and the writer.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{SeekFrom, Write};
use std::path::Path;

use tcg_cj::{Map, Value};

use super::limits::MAX_SAFETENSORS_HEADER_BYTES;
use super::metadata::{ConstantRow, Metadata};
use crate::error::{Code, Error, Result};
use crate::identity::LiteralHasher;

/// Safetensors dtype codes with inductor's short name and the item size.
pub const DTYPES: [(&str, &str, u64); 20] = [
    ("BOOL", "bool", 1),
    ("U8", "uint8", 1),
    ("I8", "int8", 1),
    ("I16", "int16", 2),
    ("U16", "uint16", 2),
    ("I32", "int32", 4),
    ("U32", "uint32", 4),
    ("I64", "int64", 8),
    ("U64", "uint64", 8),
    ("F16", "float16", 2),
    ("BF16", "bfloat16", 2),
    ("F32", "float32", 4),
    ("F64", "float64", 8),
    ("C64", "complex64", 8),
    ("C128", "complex128", 16),
    ("F8_E4M3", "float8_e4m3fn", 1),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz", 1),
    ("F8_E5M2", "float8_e5m2", 1),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz", 1),
    ("F8_E8M0", "float8_e8m0fnu", 1),
];

/// `(name, item size)` of a safetensors dtype code.
pub fn dtype_by_code(code: &str) -> Option<(&'static str, u64)> {
    DTYPES.iter().find(|d| d.0 == code).map(|d| (d.1, d.2))
}

/// `(code, item size)` of an inductor dtype name.
pub fn dtype_by_name(name: &str) -> Option<(&'static str, u64)> {
    DTYPES.iter().find(|d| d.1 == name).map(|d| (d.0, d.2))
}

/// Chunk size of the streamed digest (at most 1 MiB, §8.8).
pub const DIGEST_CHUNK: usize = 1 << 20;

fn payload(m: impl std::fmt::Display) -> Error {
    Error::new(
        Code::ArtifactLiteralPayload,
        format!("literal payload is invalid: {m}"),
    )
}

fn read_err(path: &Path, e: &std::io::Error) -> Error {
    Error::io(format_args!("cannot read {}", path.display()), e)
}

struct Entry<'a> {
    name: &'a str,
    start: u64,
    end: u64,
    row: &'a ConstantRow,
    torch_dtype: String,
}

/// Verify the literal payload of validated metadata: present iff it has
/// literal rows (`artifact.literals_mismatch`), then [`verify_payload`].
pub fn verify_literals(path: Option<&Path>, metadata: &Metadata) -> Result<()> {
    metadata.check_has_literals(path.is_some())?;
    match path {
        Some(p) => verify_payload(p, &metadata.literal_rows(), metadata.literal_values()),
        None => Ok(()),
    }
}

/// Verify a payload file against the literal rows and the recorded literal
/// digest (§8.8).
pub fn verify_payload(path: &Path, rows: &[&ConstantRow], literal_values: &str) -> Result<()> {
    let mut f = File::open(path).map_err(|e| read_err(path, &e))?;
    let size = f.metadata().map_err(|e| read_err(path, &e))?.len();
    verify_payload_from(&mut f, size, path, rows, literal_values)
}

/// [`verify_payload`] of `size` bytes read from `f` (named `path` in errors).
pub fn verify_payload_from(
    f: &mut dyn super::package::ReadSeek,
    size: u64,
    path: &Path,
    rows: &[&ConstantRow],
    literal_values: &str,
) -> Result<()> {
    let mut n8 = [0u8; 8];
    if size < 8 {
        return Err(payload(format_args!(
            "file is {size} bytes, shorter than the header length"
        )));
    }
    f.read_exact(&mut n8).map_err(|e| read_err(path, &e))?;
    let n = u64::from_le_bytes(n8);
    if n == 0 || n % 8 != 0 || n > MAX_SAFETENSORS_HEADER_BYTES || n > size - 8 {
        return Err(payload(format_args!(
            "header length {n} must be non-zero, a multiple of 8, at most {MAX_SAFETENSORS_HEADER_BYTES} and within the {size}-byte file"
        )));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).map_err(|e| read_err(path, &e))?;
    let root = tcg_cj::parse_strict(&header)
        .map_err(|e| payload(format_args!("header is not strict JSON: {e}")))?;
    let Value::Object(root) = root else {
        return Err(payload("header root is not an object"));
    };
    let data_size = size - 8 - n;
    let by_fqn: BTreeMap<&str, &ConstantRow> = rows.iter().map(|r| (r.fqn.as_str(), *r)).collect();
    let mut names = BTreeSet::new();
    for (k, v) in &root {
        if k == "__metadata__" {
            let ok = matches!(v, Value::Object(m) if m.values().all(|x| x.as_str().is_some()));
            if !ok {
                return Err(payload("__metadata__ must be an object of strings"));
            }
            continue;
        }
        names.insert(k.as_str());
    }
    let declared: BTreeSet<&str> = by_fqn.keys().copied().collect();
    if names != declared {
        let missing: Vec<&str> = declared.difference(&names).copied().collect();
        let extra: Vec<&str> = names.difference(&declared).copied().collect();
        return Err(payload(format_args!(
            "names do not match declared literals (missing {missing:?}, extra {extra:?})"
        )));
    }
    let mut entries = Vec::with_capacity(names.len());
    for name in names {
        let row = by_fqn[name];
        entries.push(check_entry(name, &root[name], row, data_size)?);
    }
    // Tiling: sorted by (start, end, name), the entries cover [0, data_size).
    let mut order: Vec<&Entry<'_>> = entries.iter().collect();
    order.sort_by(|a, b| (a.start, a.end, a.name).cmp(&(b.start, b.end, b.name)));
    let mut cursor = 0u64;
    for e in &order {
        if e.start != cursor {
            let what = if e.start > cursor {
                "a gap"
            } else {
                "an overlap"
            };
            return Err(payload(format_args!(
                "{what} at byte {cursor} before tensor {:?}",
                e.name
            )));
        }
        cursor = e.end;
    }
    if cursor != data_size {
        return Err(payload(format_args!(
            "tensors end at byte {cursor}, but the data section has {data_size} bytes"
        )));
    }
    // Digest, rows in name order (entries are already sorted by name).
    let mut hasher = LiteralHasher::new();
    let mut buf = vec![0u8; DIGEST_CHUNK];
    for e in &entries {
        hasher
            .begin_row(e.name, &e.torch_dtype, &e.row.shape)
            .map_err(|err| payload(err.message()))?;
        f.seek(SeekFrom::Start(8 + n + e.start))
            .map_err(|er| read_err(path, &er))?;
        let mut left = e.end - e.start;
        while left > 0 {
            let take = left.min(DIGEST_CHUNK as u64) as usize;
            f.read_exact(&mut buf[..take])
                .map_err(|er| read_err(path, &er))?;
            hasher.update(&buf[..take]);
            left -= take as u64;
        }
    }
    let digest = hasher.finish();
    if digest != literal_values {
        return Err(Error::new(
            Code::ArtifactLiteralDigestMismatch,
            format!("safetensors values do not match graph_class literal_values ({digest} != {literal_values})"),
        ));
    }
    Ok(())
}

fn check_entry<'a>(
    name: &'a str,
    v: &Value,
    row: &'a ConstantRow,
    data_size: u64,
) -> Result<Entry<'a>> {
    let m = v
        .as_object()
        .ok_or_else(|| payload(format_args!("entry {name:?} is not an object")))?;
    if !m
        .keys()
        .map(String::as_str)
        .eq(["data_offsets", "dtype", "shape"])
    {
        return Err(payload(format_args!(
            "entry {name:?} must have exactly dtype, shape and data_offsets"
        )));
    }
    let code = m["dtype"]
        .as_str()
        .ok_or_else(|| payload(format_args!("entry {name:?} dtype is not a string")))?;
    let (dtype, item) = dtype_by_code(code).ok_or_else(|| {
        payload(format_args!(
            "entry {name:?} dtype {code:?} is not supported"
        ))
    })?;
    if dtype != row.dtype {
        return Err(payload(format_args!(
            "entry {name:?} dtype {dtype} does not match the declared {}",
            row.dtype
        )));
    }
    let shape = match &m["shape"] {
        Value::Array(dims) => dims
            .iter()
            .map(|d| match d {
                Value::Int(x) if *x >= 0 => Ok(*x as u64),
                _ => Err(payload(format_args!(
                    "entry {name:?} shape must be integers >= 0"
                ))),
            })
            .collect::<Result<Vec<u64>>>()?,
        _ => {
            return Err(payload(format_args!(
                "entry {name:?} shape is not an array"
            )))
        }
    };
    if shape != row.shape {
        return Err(payload(format_args!(
            "entry {name:?} shape {shape:?} does not match the declared {:?}",
            row.shape
        )));
    }
    let (start, end) = match &m["data_offsets"] {
        Value::Array(o) if o.len() == 2 => match (&o[0], &o[1]) {
            (Value::Int(s), Value::Int(e)) if *s >= 0 && *e >= 0 => (*s as u64, *e as u64),
            _ => {
                return Err(payload(format_args!(
                    "entry {name:?} data_offsets must be integers >= 0"
                )))
            }
        },
        _ => {
            return Err(payload(format_args!(
                "entry {name:?} data_offsets must be [start, end]"
            )))
        }
    };
    if start > end || end > data_size {
        return Err(payload(format_args!(
            "entry {name:?} data_offsets [{start}, {end}] are outside [0, {data_size}]"
        )));
    }
    let expected = shape
        .iter()
        .try_fold(item, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| payload(format_args!("entry {name:?} byte size overflows")))?;
    if end - start != expected {
        return Err(payload(format_args!(
            "entry {name:?} spans {} bytes, but its shape and dtype need {expected}",
            end - start
        )));
    }
    Ok(Entry {
        name,
        start,
        end,
        row,
        torch_dtype: format!("torch.{dtype}"),
    })
}

/// One literal tensor to write: its fqn, inductor dtype name, shape and raw
/// little-endian element bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiteralTensor {
    /// The wrapper fqn.
    pub fqn: String,
    /// Inductor's short dtype name, for example `float32`.
    pub dtype: String,
    /// The shape.
    pub shape: Vec<u64>,
    /// The element bytes.
    pub bytes: Vec<u8>,
}

/// Write a literal payload (§8.8 writer): a CJ header padded with spaces to a
/// multiple of 8, then the data ordered by descending item size, then name.
/// Returns the number of bytes written.
pub fn write_payload<W: Write>(out: &mut W, tensors: &[LiteralTensor]) -> Result<u64> {
    let mut order: Vec<(&LiteralTensor, &'static str, u64)> = Vec::with_capacity(tensors.len());
    let mut seen = BTreeSet::new();
    for t in tensors {
        let (code, item) = dtype_by_name(&t.dtype).ok_or_else(|| {
            Error::new(
                Code::AdmissionLiteralSerialize,
                format!("literal {:?} has unsupported dtype {}", t.fqn, t.dtype),
            )
        })?;
        let need = t.shape.iter().try_fold(item, |a, &d| a.checked_mul(d));
        if need != Some(t.bytes.len() as u64) {
            return Err(Error::new(
                Code::AdmissionLiteralSerialize,
                format!(
                    "literal {:?} has {} bytes, its shape and dtype need {need:?}",
                    t.fqn,
                    t.bytes.len()
                ),
            ));
        }
        if !seen.insert(t.fqn.as_str()) {
            return Err(Error::new(
                Code::AdmissionLiteralSerialize,
                format!("literal {:?} appears twice", t.fqn),
            ));
        }
        order.push((t, code, item));
    }
    order.sort_by(|a, b| b.2.cmp(&a.2).then_with(|| a.0.fqn.cmp(&b.0.fqn)));
    let mut header = Map::new();
    let mut offset = 0u64;
    for (t, code, _) in &order {
        let end = offset + t.bytes.len() as u64;
        let mut e = Map::new();
        e.insert(
            "data_offsets".into(),
            Value::Array(vec![Value::Int(offset as i64), Value::Int(end as i64)]),
        );
        e.insert("dtype".into(), Value::Str((*code).into()));
        e.insert(
            "shape".into(),
            Value::Array(t.shape.iter().map(|&d| Value::Int(d as i64)).collect()),
        );
        header.insert(t.fqn.clone(), Value::Object(e));
        offset = end;
    }
    let mut h = tcg_cj::to_canonical(&Value::Object(header))
        .map_err(|e| Error::from_cj(crate::Kind::Admission, &e))?;
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let w = |out: &mut W, b: &[u8]| {
        out.write_all(b)
            .map_err(|e| Error::io("cannot write the literal payload", &e))
    };
    w(out, &(h.len() as u64).to_le_bytes())?;
    w(out, &h)?;
    for (t, _, _) in &order {
        w(out, &t.bytes)?;
    }
    Ok(8 + h.len() as u64 + offset)
}

/// The payload bytes of `tensors` (see [`write_payload`]).
pub fn payload_bytes(tensors: &[LiteralTensor]) -> Result<Vec<u8>> {
    let mut v = Vec::new();
    write_payload(&mut v, tensors)?;
    Ok(v)
}
